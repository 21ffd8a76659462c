"""The settings both probes share (`ProbeConfig`), and their command-line flags.

Protocol: ``--protocol random_attention|epikv|valuediff|custom`` and the protocol flags (`evictor.protocol`) set the
trigger, buffer, recency window, budget scope and protection; the probes teacher-force every token, so sampling does
not apply. The resolved protocol is part of the run's identity and of every row, with the peak cache slots per head.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from core.backend import BackendConfig, add_backend_arguments
from core.cli import add_device_arguments, positive_int, seed_int, thread_count
from core.errors import UsageError
from core.limits import MemoryLimit
from evictor.protocol import (
    SAMPLING_FIELDS,
    EvictionConfig,
    Protocol,
    add_protocol_arguments,
    protocol_overrides,
    resolve_protocol,
    token_flags,
)
from models.loading import KERNELS, load_model, model_limits
from models.registry import DEFAULT_MODEL, REGISTRY
from probes.instances import check_filler_dataset
from scoring.policy import Policy
from validation.stats import check_replicates

C = TypeVar("C", bound="ProbeConfig")


# The protocol settings a probe takes from the command line: everything `evictor.protocol` presets but the sampling
# (every token is teacher-forced, so nothing is sampled) and what the probe sets itself (its --budget and --seed).
_NOT_PROBE_SETTINGS = ("budget", "seed", "keep_log", *SAMPLING_FIELDS)


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """The settings both probes share; each is the command-line flag of the same name (``data_file``:
    ``--data-file``), except `protocol_settings`: the protocol flags given explicitly (``--buffer 8`` ->
    ``{"buffer": 8}``), which override the `protocol` preset."""

    model: str = DEFAULT_MODEL
    n: int = 20  # instances; a finished run may be resumed with more
    seed: int = 0
    budget: int = 256  # K per KV head in tokens, prompt included
    protocol: str = "custom"  # its schedule is Random Attention's: an interval trigger with a buffer of 64
    protocol_settings: dict[str, Any] = field(default_factory=dict)
    lead: int = 32  # filler tokens before the fact
    box: int = 16  # tokens of the fact box
    filler: str | None = None  # a generations.jsonl (or its run directory) to cut filler from
    dataset: str = "math500"  # whose reference solutions are the filler when `filler` is None
    data_file: str | None = None
    batch_size: int = 8
    n_boot: int = 4000
    level: float = 0.95
    kernel: str | None = None
    device: str | None = None
    dtype: str | None = None
    max_memory: int | None = None  # bytes a run may use (None: the device's memory; `core.limits.MemoryLimit`)

    def check(self) -> None:
        """Refuse settings that are wrong before anything is loaded or written."""
        for name in ("n", "budget", "lead", "box", "batch_size", "n_boot"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not 0 < self.level < 1:
            raise UsageError(f"--level must be in (0, 1), got {self.level}")
        check_replicates(self.n_boot, self.n, 3 * self.n)  # the bootstrap at the end, checked before anything runs
        if self.data_file is not None and not Path(self.data_file).expanduser().is_file():
            raise UsageError(f"--data-file {self.data_file!r} does not exist")
        if self.filler is None:
            check_filler_dataset(self.dataset)
        self.check_limits()
        sampling = [key for key in SAMPLING_FIELDS if self.protocol_settings.get(key) is not None]
        if sampling:
            flags = " and ".join("--" + key.replace("_", "-") for key in sampling)
            raise UsageError(f"{flags}: the probes teacher-force every token, so nothing is sampled; leave "
                             f"{'them' if len(sampling) > 1 else 'it'} out")
        self.resolved()

    def check_limits(self) -> None:
        """Refuse token counts beyond the model's context (read from its config, before the weights load): no
        instance could hold them, so the probe would run for nothing or fail deep in the model."""
        limits = model_limits(self.model)
        limits.check_flags({"--budget": self.budget, "--lead": self.lead, "--box": self.box,
                            **token_flags(self.protocol_settings)})

    def check_memory(self, policies: Sequence[Policy], prompt: int, total: int, backend: BackendConfig,
                     dense_logits: int = 0) -> None:
        """Refuse the probe when this machine (the driver and any local Ray workers, `BackendConfig.footprint`)
        would need more memory than the device has or ``--max-memory`` allows: each batch of instances prefills
        `prompt` tokens and is teacher-forced to `total` under each of `policies`
        (`evictor.engine.eviction_footprint`) and, with `dense_logits` value positions, in one dense forward."""
        from evictor.engine import eviction_footprint
        from models.footprint import forward_footprint, model_shape

        shape = model_shape(self.model, self.dtype, self.device)
        rows = min(self.batch_size, self.n)
        eager = self.kernel == "eager"
        footprints = [eviction_footprint(shape, policy, self.eviction(), [prompt] * rows, total - prompt, rows,
                                         eager=eager) for policy in policies]
        if dense_logits:
            footprints.append(forward_footprint(shape, rows, total, logits=dense_logits, eager=eager))
        workers = f" on {backend.workers} local Ray workers" if backend.local_workers else ""
        backend.footprint(shape.weights(), max(footprints, key=lambda footprint: footprint.total)).check(
            f"{self.model} teacher-forcing {rows} instance(s) of {total} tokens at once (--batch-size "
            f"{self.batch_size}){workers},", MemoryLimit.of(self.device, self.max_memory),
            "lower --batch-size, the distance to the question or --budget" + (" or --workers" if workers else ""))

    def resolved(self) -> Protocol:
        """The protocol preset with the explicit settings, at this probe's budget and seed."""
        settings = {k: v for k, v in self.protocol_settings.items() if k not in _NOT_PROBE_SETTINGS}
        protocol = resolve_protocol(self.protocol, settings)
        return replace(protocol, config=replace(protocol.config, budget=self.budget, seed=self.seed))

    def eviction(self) -> EvictionConfig:
        return self.resolved().config

    def protocol_record(self) -> dict[str, Any]:
        """The resolved protocol as every probe record and row states it (no sampling: nothing is sampled)."""
        return {k: v for k, v in self.resolved().to_dict().items()
                if k not in ("seed", "keep_log", *SAMPLING_FIELDS)}

    def identity(self) -> dict[str, Any]:
        """The shared settings that change what an instance record holds (a resumed run must match them); the
        instance count, the bootstrap, the device and the backend do not."""
        return {"model": self.model, "seed": self.seed, "batch_size": self.batch_size, "lead": self.lead,
                "box": self.box, "dtype": self.dtype, "kernel": self.kernel, "protocol": self.protocol_record()}

    def load_model(self):
        return load_model(self.model, device=self.device, dtype=self.dtype, attn_implementation=self.kernel)

    def out_parts(self) -> list[str]:
        """The protocol part of the default output directory's name."""
        return [self.protocol, f"K{self.budget}", f"r{self.eviction().buffer}"]


def config_from_arguments(cls: type[C], args: argparse.Namespace, **parsed: Any) -> C:
    """A probe's config from its parsed command line: every field is the flag of the same name, except those given
    in `parsed` (flags the command line spells differently) and the protocol settings given explicitly."""
    flags = vars(args)
    settings = {k: v for k, v in protocol_overrides(flags).items() if v is not None and k not in ("budget", "seed")}
    return cls(**{f.name: flags[f.name] for f in fields(cls) if f.name not in parsed and f.name in flags},
               protocol_settings=settings, **parsed)


def add_common_arguments(p: argparse.ArgumentParser, default_model: str = DEFAULT_MODEL) -> None:
    p.add_argument("--model", default=default_model, help=f"registry name ({', '.join(sorted(REGISTRY))}), local HF "
                   f"directory, .gguf file or hub id (default: {default_model})")
    p.add_argument("--n", type=positive_int, default=20,
                   help="instances; rerunning a finished run with a larger --n adds instances (default: 20)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="draws each instance's variable, value and filler start, and seeds the eviction (default: 0)")
    p.add_argument("--budget", type=positive_int, default=256,
                   help="K per KV head in tokens; Random Attention's 1024 scaled to a 135M model (default: 256)")
    add_protocol_arguments(p, sampling=False)
    p.add_argument("--lead", type=positive_int, default=32, help="filler tokens before the fact (default: 32)")
    p.add_argument("--box", type=positive_int, default=16,
                   help="tokens of the fact box: the fact sentence, padded with the following filler (default: 16)")
    p.add_argument("--filler", default=None,
                   help="a generations.jsonl (or its run directory) of the model's dense traces to cut filler from "
                   "(default: the --dataset reference solutions)")
    p.add_argument("--dataset", default="math500", help="benchmark whose solutions are the filler (default: math500)")
    p.add_argument("--data-file", default=None, help="read the --dataset problems from this JSONL")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="instances decoded together; the rows of a batch share the eviction draws' generator, so "
                   "results are reproducible for the same --n and --batch-size (default: 8)")
    p.add_argument("--n-boot", type=positive_int, default=4000, help="bootstrap replicates (default: 4000)")
    p.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals, in (0, 1) "
                   "(default: 0.95)")
    p.add_argument("--kernel", default=None, choices=KERNELS, help="attention kernel (default: sdpa, FA2 on CUDA)")
    add_device_arguments(p)
    p.add_argument("--threads", type=thread_count, default=None,
                   help="CPU threads for torch (default: torch's choice); 1 is fastest on a CPU shared with other jobs")
    add_backend_arguments(p)
    p.add_argument("--out", default=None, help="output directory; rerun the same command to resume it "
                   "(default: runs/<probe>/<model>-<settings>)")
