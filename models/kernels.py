"""Which attention kernel a forward really ran, so that a speed figure can name it.

transformers' ``sdpa`` implementation hands every attention call to `torch.nn.functional.scaled_dot_product_attention`,
which picks a backend per call (FlashAttention, memory-efficient, cuDNN, or the unfused math fallback) from the
device, dtype, mask and shapes, and falls back silently. `attention_kernels_run` intercepts each call and asks the
selection SDPA itself runs (``torch._fused_sdp_choice``, with the call's own arguments, under the caller's
`torch.nn.attention.sdpa_kernel` restrictions) which backend serves it. The other implementations
(``flash_attention_2``, ``eager``) have no fallback in transformers, so the model's configured one is what ran.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

from models.lm import attention_kernel

# torch.nn.attention.SDPBackend values, as torch._fused_sdp_choice returns them
SDPA_BACKENDS = {0: "sdpa:math", 1: "sdpa:flash", 2: "sdpa:efficient", 3: "sdpa:cudnn", 4: "sdpa:fused"}
FLASH_KERNELS = frozenset({"sdpa:flash", "flash_attention_2"})


@contextlib.contextmanager
def attention_kernels_run(model) -> Iterator[Counter]:
    """Count, by kernel, the attention calls run inside the block (filled in as they run): ``sdpa:flash``,
    ``sdpa:efficient``, ``sdpa:cudnn``, ``sdpa:fused`` or ``sdpa:math`` for a model on SDPA; otherwise the model's
    implementation (``flash_attention_2``, ``eager``), counted once."""
    from torch.overrides import TorchFunctionMode

    counts: Counter = Counter()
    kernel = attention_kernel(model)
    if kernel != "sdpa":
        counts[kernel] += 1
        yield counts
        return
    sdpa = torch.nn.functional.scaled_dot_product_attention

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa:
                choice = int(torch._fused_sdp_choice(*args, **kwargs))
                counts[SDPA_BACKENDS.get(choice, f"sdpa:{choice}")] += 1
            return func(*args, **kwargs)

    with Calls():
        yield counts


def check_flash(counts: Counter, what: str) -> None:
    """Refuse `counts` (from `attention_kernels_run`) unless every attention call ran FlashAttention."""
    from core.errors import UsageError

    if not counts or set(counts) - FLASH_KERNELS:
        ran = ", ".join(f"{kernel} x{n}" for kernel, n in sorted(counts.items())) or "no attention call"
        raise UsageError(f"{what}: attention ran {ran}, not FlashAttention (sdpa:flash or flash_attention_2); its "
                         "speed would be another kernel's")


REQUIRE_FLASH_ENV = "KVSCOPE_REQUIRE_FLASH"


@contextlib.contextmanager
def require_flash(model, what: str, when: bool = True) -> Iterator[None]:
    """With ``$KVSCOPE_REQUIRE_FLASH=1`` (and `when`), refuse the block's forwards unless every attention call ran
    FlashAttention (`check_flash`); otherwise do nothing. A speed study sets it: the eviction engine's prefill and
    first decode step run under it, so a silent fallback to another kernel stops the run instead of timing it."""
    import os

    if not when or os.environ.get(REQUIRE_FLASH_ENV) != "1":
        yield
        return
    with attention_kernels_run(model) as counts:
        yield
    check_flash(counts, what)
