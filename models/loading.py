"""Load a causal LM by registry name, local HF directory, `.gguf` file or hub id, with a converted-weights cache.

GGUF weights are dequantised once into a safetensors copy under `cache_root()/converted/<sha256>`; later loads
read that copy (seconds instead of the 20-60 s dequantisation). The copy is written to a temporary directory and
renamed into place, so an interrupted conversion never leaves a half-written model that a later load would trust.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from core.errors import UsageError, unknown_choice
from models.expand import with_expanded_kv_heads
from models.registry import DEFAULT_MODEL, REGISTRY, cache_root, sha256_file

log = logging.getLogger(__name__)

KERNELS = ("sdpa", "flash_attention_2", "eager")


@dataclass
class LoadedModel:
    """A model, its tokenizer, and where they came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str
    load_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    @property
    def family(self) -> str:
        return self.model.config.model_type

    @property
    def kernel(self) -> str:
        return attention_kernel(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def describe(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "name": self.name,
            "source": self.source,
            "family": self.family,
            "layers": cfg.num_hidden_layers,
            "q_heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "kernel": self.kernel,
            "dtype": str(self.model.dtype),
            "device": str(self.device),
            **self.info,
        }


def attention_kernel(model: PreTrainedModel) -> str:
    """The attention implementation the model's attention modules dispatch to on their next forward.

    transformers looks `config._attn_implementation` up at every attention call, so this is what actually runs.
    """
    return model.config._attn_implementation


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def choose_kernel(requested: str | None, device: torch.device) -> str:
    """`sdpa` by default; `flash_attention_2` on CUDA when flash-attn is installed; `eager` only on request."""
    if requested is not None:
        if requested not in KERNELS:
            raise unknown_choice("attention kernel", requested, KERNELS)
        if requested == "flash_attention_2" and not _flash_attn_available(device):
            raise UsageError("attention kernel 'flash_attention_2' needs a CUDA device and the flash-attn package")
        return requested
    return "flash_attention_2" if _flash_attn_available(device) else "sdpa"


def _flash_attn_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise unknown_choice("dtype", dtype, names)
    return names[dtype]


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load `name`: a registry name, a local HF directory, a `.gguf` file, a hub id, or ``tiny-<family>``
    (`models.tiny`)."""
    device = torch.device(device) if device is not None else default_device()
    torch_dtype = _resolve_dtype(dtype, device)
    kernel = choose_kernel(attn_implementation, device)
    if name.startswith("tiny-"):  # random-init test models; lazy import: models.tiny imports this module
        from models.tiny import tiny_model
        return tiny_model(name.removeprefix("tiny-"), attn_implementation=kernel, dtype=torch_dtype)
    if name in REGISTRY and REGISTRY[name].expands is not None:  # built on load from the entry it expands
        base = load_model(REGISTRY[name].expands, device=device, dtype=torch_dtype, attn_implementation=kernel)
        return with_expanded_kv_heads(base, name)
    check_model_name(name)
    start = time.perf_counter()
    if name in REGISTRY:
        entry = REGISTRY[name]
        gguf = entry.locate_gguf()
        if not gguf.exists():
            raise UsageError(f"model {name!r}: weights file {gguf} is missing; reinstall with: {entry.install_hint()}")
        directory, digest = _converted_copy(gguf, expected_sha256=entry.sha256)
        source, info = str(gguf), {"gguf_sha256": digest}
    elif name.endswith(".gguf"):
        directory, digest = _converted_copy(Path(name).expanduser())
        source, info = str(Path(name).expanduser()), {"gguf_sha256": digest}
    elif Path(name).expanduser().is_dir():
        directory, source, info = Path(name).expanduser(), str(Path(name).expanduser()), {}
    else:
        directory, source, info = name, f"hub:{name}", {}
    model, tokenizer = _from_pretrained(directory, torch_dtype, kernel, name)
    model.to(device).eval()
    return LoadedModel(model, tokenizer, name, source, time.perf_counter() - start, info)


def check_model_name(name: str) -> None:
    """Refuse a name `load_model` could never load, without loading anything: registry names, ``tiny-<family>``, a
    local HuggingFace directory, an existing ``.gguf`` file and hub ids (org/name, whose existence shows on load)."""
    from models.tiny import TINY_FAMILIES  # lazy: models.tiny imports this module

    path = Path(name).expanduser()
    if name in REGISTRY or name.startswith("tiny-") and name.removeprefix("tiny-") in TINY_FAMILIES:
        return
    if name.endswith(".gguf"):
        if not path.is_file():
            raise UsageError(f"GGUF file {name!r} does not exist")
        return
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UsageError(f"directory {name!r} is not a HuggingFace model directory (no config.json)")
        return
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise UsageError(
            f"model path {name!r} is not an existing HF model directory or .gguf file (hub ids look like org/name)"
        )
    if "/" not in name:
        choices = sorted(REGISTRY) + [f"tiny-{family}" for family in TINY_FAMILIES]
        raise unknown_choice("model", name, choices + ["<local HF dir>", "<file.gguf>", "<hub org/name>"])


def _from_pretrained(directory, torch_dtype, kernel, name):
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, attn_implementation=kernel)
    except OSError as err:
        hub_id = isinstance(directory, str) and "/" in directory and not Path(directory).exists()
        if hub_id:
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            why = "HF_HUB_OFFLINE=1 is set" if offline else "the hub could not be reached or has no such model"
            raise UsageError(f"cannot load hub model {name!r}: {why} ({str(err).splitlines()[0]})") from None
        raise UsageError(f"cannot load model {name!r} from {directory}: {str(err).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _cached_sha256(gguf: Path) -> str:
    """sha256 of a GGUF, remembered by (path, size, mtime) so a warm load does not rehash hundreds of MB."""
    stat = gguf.stat()
    stamp_dir = cache_root() / "hashes"
    stamp = stamp_dir / f"{abs(hash((str(gguf.resolve()), stat.st_size, stat.st_mtime_ns))):x}.json"
    if stamp.exists():
        record = json.loads(stamp.read_text())
        if record.get("path") == str(gguf.resolve()) and record.get("size") == stat.st_size:
            return record["sha256"]
    digest = sha256_file(gguf)
    stamp_dir.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"path": str(gguf.resolve()), "size": stat.st_size, "sha256": digest}))
    os.replace(tmp, stamp)
    return digest


def _converted_copy(gguf: Path, expected_sha256: str | None = None) -> tuple[Path, str]:
    """Return a safetensors copy of `gguf`, converting it on first use; keyed by the file's sha256."""
    digest = _cached_sha256(gguf)
    if expected_sha256 and not digest.startswith(expected_sha256):
        raise UsageError(
            f"{gguf} has sha256 {digest[:16]}..., expected {expected_sha256[:16]}...; "
            "the file is corrupt or not this model"
        )
    target = cache_root() / "converted" / digest
    if (target / "kvscope-complete").exists():
        return target, digest
    log.info("converting %s once into %s (later loads reuse it)", gguf.name, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:  # the GGUF reader raises many types on a corrupt file
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise UsageError(f"cannot read GGUF file {gguf}: {type(err).__name__}: {first_line}") from None
    # A GGUF-loaded model refuses save_pretrained while its quantizer is attached; the weights are already dense.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{digest}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "kvscope-complete").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target, digest
