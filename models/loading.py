"""Load a causal LM by registry name, local HF directory, `.gguf` file, hub id or ``tiny-<family>``
(`models.tiny`), with a converted-weights cache; what it returns is a `models.lm.LoadedModel`.

GGUF weights are dequantised once into a safetensors copy under `cache_root()/converted/<sha256>`; later loads
read that copy (seconds instead of the 20-60 s dequantisation). The copy is written to a temporary directory and
renamed into place, so an interrupted conversion never leaves a half-written model that a later load would trust.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from core.errors import UsageError, unknown_choice
from core.limits import ModelLimits
from models.expand import with_expanded_kv_heads
from models.families import family_names
from models.lm import LoadedModel
from models.registry import DEFAULT_MODEL, REGISTRY, cache_root, sha256_file
from models.tiny import tiny_config, tiny_model, tiny_tokenizer

# transformers is imported by the functions that load: importing it takes a second or more, and the command lines
# import this module before they have read their arguments (`--help` answers without it).
log = logging.getLogger(__name__)

KERNELS = ("sdpa", "flash_attention_2", "eager")
# Inside `shared_loads`: the models loaded so far, by (name, device, dtype, kernel); None outside.
_SHARED: ContextVar[dict[tuple[str, str, torch.dtype, str | None], LoadedModel] | None] = ContextVar(
    "kvscope_shared_loads", default=None)


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


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype `load_model` loads weights in: `dtype` by name, or bfloat16 on CUDA and float32 elsewhere."""
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
    torch_dtype = resolve_dtype(dtype, device)
    chosen = choose_kernel(attn_implementation, device)
    # Unasked, SDPA is left to transformers, whose default it is: a class without it (Gemma2, gpt-oss) runs eager.
    kernel = None if attn_implementation is None and chosen == "sdpa" else chosen
    shared = _SHARED.get()
    if shared is None:
        return _load(name, device, torch_dtype, kernel)
    key = (name, str(device), torch_dtype, kernel)
    if key not in shared:
        shared[key] = _load(name, device, torch_dtype, kernel)
    return shared[key]


@contextlib.contextmanager
def shared_loads() -> Iterator[None]:
    """Inside it, `load_model` with the same name, device, dtype and kernel returns the model it loaded the first time,
    so the stages of one run that share a process share one copy (`study.run_study`: the traces, the labeller, the
    replay and the evictor's driver); outside it, every call loads a fresh copy. Sharing is safe because nothing in
    kvscope changes a loaded model: hooks are scoped and a kernel switch restores the model's own. A nested use keeps
    the outer one's models."""
    if _SHARED.get() is not None:
        yield
        return
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _load(name: str, device: torch.device, torch_dtype: torch.dtype, kernel: str | None) -> LoadedModel:
    if name.startswith("tiny-"):  # random-init test models
        return tiny_model(name.removeprefix("tiny-"), attn_implementation=kernel, dtype=torch_dtype)
    if (expands := _expands(name)) is not None:  # built on load from the entry it expands
        # A copy of its own, never a shared one: the expansion changes the model in place.
        return with_expanded_kv_heads(_load(expands, device, torch_dtype, kernel), name)
    start = time.perf_counter()
    directory, source, info = locate_weights(name)
    model, tokenizer = _from_pretrained(directory, torch_dtype, kernel, name)
    model.to(device).eval()
    return LoadedModel(model, tokenizer, name, source, time.perf_counter() - start, info)


def _expands(name: str) -> str | None:
    """The registry entry whose model `name`'s expands (`RegistryEntry.expands`), if any."""
    return REGISTRY[name].expands if name in REGISTRY else None


def locate_weights(name: str) -> tuple[Path | str, str, dict[str, Any]]:
    """``(directory, source, info)``: the HuggingFace directory (or hub id) `load_model` reads `name`'s weights from
    (a registry name or a ``.gguf`` file: its converted safetensors copy, made now on first use), where they came from,
    and what `LoadedModel.info` records. Other engines (vLLM) load the same directory. Random-init (``tiny-*``) and
    expanded registry models are built in memory and have none."""
    if name.startswith("tiny-") or _expands(name) is not None:
        raise UsageError(f"model {name!r} is built in memory by kvscope and has no weights directory")
    check_model_name(name)
    if name in REGISTRY:
        entry = REGISTRY[name]
        assert entry.locate_gguf is not None  # an entry that expands no other has weights of its own
        gguf = entry.locate_gguf()
        if not gguf.exists():
            raise UsageError(f"model {name!r}: weights file {gguf} is missing; reinstall with: {entry.install_hint()}")
        directory, digest = _converted_copy(gguf, expected_sha256=entry.sha256)
        return directory, str(gguf), {"gguf_sha256": digest}
    if name.endswith(".gguf"):
        directory, digest = _converted_copy(Path(name).expanduser())
        return directory, str(Path(name).expanduser()), {"gguf_sha256": digest}
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser(), str(Path(name).expanduser()), {}
    return name, f"hub:{name}", {}


def load_tokenizer(name: str):
    """`name`'s tokenizer alone (what `load_model` would pair with it), without loading the weights: for reading a
    stored trace's tokens back as text."""
    if name.startswith("tiny-"):
        check_model_name(name)
        return tiny_tokenizer()
    if (expands := _expands(name)) is not None:
        return load_tokenizer(expands)  # an expansion changes only the KV heads
    from transformers import AutoTokenizer

    directory, _, _ = locate_weights(name)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise _cannot_load(name, directory, err) from None


def check_model_name(name: str) -> None:
    """Refuse a name `load_model` could never load, without loading anything: registry names, ``tiny-<family>``, a
    local HuggingFace directory, an existing ``.gguf`` file and hub ids (org/name, whose existence shows on load)."""
    path = Path(name).expanduser()
    if name in REGISTRY or name.startswith("tiny-") and name.removeprefix("tiny-") in family_names():
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
        choices = sorted(REGISTRY) + [f"tiny-{family}" for family in family_names()]
        raise unknown_choice("model", name, choices + ["<local HF dir>", "<file.gguf>", "<hub org/name>"])


# The sizes every causal LM's config.json states (at its top level or in its text_config): without them transformers
# silently substitutes its defaults, a differently shaped model than the weights.
REQUIRED_CONFIG = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def model_config(name: str):
    """`name`'s transformers config, read without its weights (a registry model's converted copy is made on first use,
    as `load_model` would); a config.json that cannot be read, names no known architecture or lacks the sizes of
    `REQUIRED_CONFIG` is a one-line `UsageError`."""
    if name.startswith("tiny-"):
        check_model_name(name)
        return tiny_config(name.removeprefix("tiny-"))
    if (expands := _expands(name)) is not None:  # the entry it expands, with one KV head per query head
        config = copy.deepcopy(model_config(expands))
        text = config.get_text_config()
        text.num_key_value_heads = text.num_attention_heads
        return config
    directory, _, _ = locate_weights(name)
    if isinstance(directory, Path):
        _check_config_file(name, directory / "config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise _cannot_load(name, directory, err) from None


def model_limits(name: str) -> ModelLimits:
    """The context, vocabulary and depth `name`'s config states (`model_config`), to check a request against before
    the model loads."""
    return ModelLimits.from_config(name, model_config(name))


def _check_config_file(name: str, path: Path) -> None:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise UsageError(f"model {name!r}: {path} is not a readable JSON file ({_first_line(err)})") from None
    if not isinstance(config, dict):
        raise UsageError(f"model {name!r}: {path} holds a JSON {type(config).__name__}, not a model configuration")
    text_config = config.get("text_config")
    text = text_config if isinstance(text_config, dict) else config
    missing = [key for key in ("model_type", *REQUIRED_CONFIG) if key not in text and key not in config]
    if missing:
        raise UsageError(f"model {name!r}: {path} lacks {', '.join(missing)}; it is not a model configuration "
                         "transformers can build the model from")


def _cannot_load(name: str, directory: Path | str, err: BaseException) -> UsageError:
    hub_id = isinstance(directory, str) and "/" in directory and not Path(directory).exists()
    if hub_id and isinstance(err, OSError):
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        why = "HF_HUB_OFFLINE=1 is set" if offline else "the hub could not be reached or has no such model"
        return UsageError(f"cannot load hub model {name!r}: {why} ({_first_line(err)})")
    return UsageError(f"cannot load model {name!r} from {directory}: {_first_line(err)}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _from_pretrained(directory, torch_dtype, kernel, name):
    if isinstance(directory, Path):
        _check_config_file(name, directory / "config.json")
    # No weight-loading bar: an error found after loading must stay the one line on stderr the CLI contract promises.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, attn_implementation=kernel)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:  # what a malformed directory raises
        raise _cannot_load(name, directory, err) from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:  # the GGUF reader raises many types on a corrupt file
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise UsageError(f"cannot read GGUF file {gguf}: {type(err).__name__}: {first_line}") from None
    # A GGUF-loaded model refuses save_pretrained while its quantizer is attached; the weights are already dense.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types the attribute as always set
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
