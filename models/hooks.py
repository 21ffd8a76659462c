"""The canonical, architecture-independent hook namespace and a scoped capture context.

Names (shapes are those of the captured tensors):

- ``blocks.{l}.hook_resid_pre``   ``[batch, pos, d_model]``  input of decoder layer l
- ``blocks.{l}.hook_resid_post``  ``[batch, pos, d_model]``  output of decoder layer l (before any final norm)
- ``blocks.{l}.attn.hook_q``      ``[batch, q_head, pos, d_head]``  query projection (after QK-norm where the
  architecture has one), before RoPE
- ``blocks.{l}.attn.hook_k|v``    ``[batch, kv_head, pos, d_head]`` key/value projection, same convention; keys
  are pre-RoPE
- ``blocks.{l}.attn.hook_cache_k|v`` ``[batch, kv_head, pos, d_head]`` exactly what the attention layer hands the
  KV cache to store (post-RoPE keys), for the tokens of this forward

One declarative table per model family maps each name to a module path and the layout of that module's output.
The cache hooks are recorded by wrapping, for the duration of the context only, the ``update`` method of the cache
*instance* the attention layers receive; nothing is patched on a class or at import time.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from core.errors import UsageError, unknown_choice

# Output layouts of the modules a hook reads. "flat": [b, pos, heads*d]; "bphd": [b, pos, heads, d];
# "bhpd": [b, heads, pos, d]. Everything is returned as [b, heads, pos, d].
FLAT, BPHD, BHPD = "flat", "bphd", "bhpd"


@dataclass(frozen=True)
class HookPoint:
    module: str  # path relative to the decoder layer
    layout: str = FLAT
    heads: str = "kv"  # "q" or "kv": which head count reshapes a flat output


_LLAMA_LIKE = {
    "attn.hook_q": HookPoint("self_attn.q_proj", FLAT, "q"),
    "attn.hook_k": HookPoint("self_attn.k_proj", FLAT, "kv"),
    "attn.hook_v": HookPoint("self_attn.v_proj", FLAT, "kv"),
}
_QK_NORM_BPHD = {  # Qwen3: norms applied to [b, pos, h, d] before the transpose
    "attn.hook_q": HookPoint("self_attn.q_norm", BPHD, "q"),
    "attn.hook_k": HookPoint("self_attn.k_norm", BPHD, "kv"),
    "attn.hook_v": HookPoint("self_attn.v_proj", FLAT, "kv"),
}
_QK_NORM_BHPD = {  # Gemma3: norms applied to [b, h, pos, d] after the transpose
    "attn.hook_q": HookPoint("self_attn.q_norm", BHPD, "q"),
    "attn.hook_k": HookPoint("self_attn.k_norm", BHPD, "kv"),
    "attn.hook_v": HookPoint("self_attn.v_proj", FLAT, "kv"),
}

# model_type -> (path of the decoder-layer list, per-layer attention hook table)
HOOK_TABLES: dict[str, tuple[str, dict[str, HookPoint]]] = {
    "llama": ("model.layers", _LLAMA_LIKE),
    "mistral": ("model.layers", _LLAMA_LIKE),
    "qwen2": ("model.layers", _LLAMA_LIKE),
    "qwen3": ("model.layers", _QK_NORM_BPHD),
    "gemma3_text": ("model.layers", _QK_NORM_BHPD),
}

RESID_HOOKS = ("hook_resid_pre", "hook_resid_post")
ATTN_HOOKS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_cache_k", "attn.hook_cache_v")
_NAME = re.compile(r"^blocks\.(\d+)\.(hook_resid_pre|hook_resid_post|attn\.hook_(?:q|k|v|cache_k|cache_v))$")


def hook_name(layer: int, point: str) -> str:
    """`hook_name(3, "attn.hook_v")` -> ``"blocks.3.attn.hook_v"``."""
    return f"blocks.{layer}.{point}"


def all_hook_names(model: nn.Module) -> list[str]:
    n_layers = model.config.num_hidden_layers
    return [hook_name(layer, point) for layer in range(n_layers) for point in RESID_HOOKS + ATTN_HOOKS]


def _family_table(model: nn.Module) -> tuple[str, dict[str, HookPoint]]:
    model_type = model.config.model_type
    if model_type not in HOOK_TABLES:
        raise unknown_choice("model family for hooks", model_type, HOOK_TABLES)
    return HOOK_TABLES[model_type]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(_family_table(model)[0])


def parse_hook_name(model: nn.Module, name: str) -> tuple[int, str]:
    """Split a canonical name into (layer, point), raising a `UsageError` if it does not resolve on `model`."""
    match = _NAME.match(name)
    if not match:
        raise UsageError(
            f"hook name {name!r} does not resolve; valid forms: blocks.<layer>.{{{', '.join(RESID_HOOKS + ATTN_HOOKS)}}}"
        )
    layer, point = int(match.group(1)), match.group(2)
    n_layers = model.config.num_hidden_layers
    if layer >= n_layers:
        raise UsageError(f"hook name {name!r} does not resolve: layer {layer} out of range 0..{n_layers - 1}")
    _family_table(model)
    return layer, point


def _to_heads(tensor: torch.Tensor, point: HookPoint, n_heads: int) -> torch.Tensor:
    if point.layout == FLAT:
        b, pos, width = tensor.shape
        return tensor.view(b, pos, n_heads, width // n_heads).transpose(1, 2)
    if point.layout == BPHD:
        return tensor.transpose(1, 2)
    return tensor


class Capture:
    """What a `capture` context recorded: per hook name, one tensor per forward call.

    `capture[name]` concatenates the calls along the position axis, so a prefill followed by N decode steps reads
    as one ``[batch, ..., prompt + N, ...]`` tensor. `calls(name)` gives the per-call list.
    """

    def __init__(self) -> None:
        self._store: dict[str, list[torch.Tensor]] = defaultdict(list)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._store[name].append(tensor)

    def calls(self, name: str) -> list[torch.Tensor]:
        if name not in self._store:
            raise KeyError(f"{name!r} was not captured (captured: {sorted(self._store)})")
        return self._store[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        parts = self.calls(name)
        dim = 1 if "resid" in name else 2
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def __contains__(self, name: str) -> bool:
        return name in self._store

    def keys(self) -> list[str]:
        return list(self._store)

    def clear(self) -> None:
        self._store.clear()


@contextlib.contextmanager
def capture(
    model: nn.Module,
    names: Iterable[str],
    *,
    detach: bool = True,
    to_cpu: bool = False,
    callback: Callable[[str, torch.Tensor], None] | None = None,
) -> Iterator[Capture]:
    """Record the canonical hook points `names` on every forward inside the context.

    With `callback`, each tensor is passed to ``callback(name, tensor)`` instead of being stored (streaming use:
    the decode hot path keeps only what it needs). Exactly the handles installed here are removed on exit.
    """
    names = list(dict.fromkeys(names))
    if not names:
        raise UsageError("capture needs at least one hook name")
    parsed = [(name, *parse_hook_name(model, name)) for name in names]
    layers = decoder_layers(model)
    table = _family_table(model)[1]
    config = model.config
    n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
    result = Capture()

    def emit(name: str, tensor: torch.Tensor) -> None:
        if detach:
            tensor = tensor.detach()
        if to_cpu:
            tensor = tensor.cpu()
        if callback is not None:
            callback(name, tensor)
        else:
            result.add(name, tensor)

    handles: list[torch.utils.hooks.RemovableHandle] = []
    cache_wanted: dict[int, dict[str, str]] = defaultdict(dict)  # layer -> {"k"|"v": name}
    wrapped_caches: list[object] = []

    try:
        for name, layer, point in parsed:
            block = layers[layer]
            if point == "hook_resid_pre":
                handles.append(block.register_forward_pre_hook(_resid_pre_hook(name, emit), with_kwargs=True))
            elif point == "hook_resid_post":
                handles.append(block.register_forward_hook(_resid_post_hook(name, emit)))
            elif point in ("attn.hook_cache_k", "attn.hook_cache_v"):
                cache_wanted[layer][point[-1]] = name
            else:
                spec = table[point]
                module = block.get_submodule(spec.module)
                heads = n_q if spec.heads == "q" else n_kv
                handles.append(module.register_forward_hook(_projection_hook(name, spec, heads, emit)))
        for layer, wanted in cache_wanted.items():
            attn = layers[layer].get_submodule("self_attn")
            handles.append(
                attn.register_forward_pre_hook(
                    _cache_wrapping_hook(wanted, emit, wrapped_caches, cache_wanted), with_kwargs=True
                )
            )
        yield result
    finally:
        for handle in handles:
            handle.remove()
        for cache in wrapped_caches:
            with contextlib.suppress(AttributeError):
                del cache.update  # drop the instance attribute; the class method shows through again


def _resid_pre_hook(name, emit):
    def hook(module, args, kwargs):
        emit(name, args[0] if args else kwargs["hidden_states"])

    return hook


def _resid_post_hook(name, emit):
    def hook(module, args, output):
        emit(name, output[0] if isinstance(output, tuple) else output)

    return hook


def _projection_hook(name, spec, heads, emit):
    def hook(module, args, output):
        emit(name, _to_heads(output, spec, heads))

    return hook


def _cache_wrapping_hook(wanted, emit, wrapped_caches, cache_wanted):
    """Wrap the `update` of the cache instance this attention layer receives, once per cache object."""

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:
            raise UsageError("attn.hook_cache_k/v needs a forward with a KV cache (use_cache=True)")
        if any(c is cache for c in wrapped_caches):
            return
        original = type(cache).update.__get__(cache)

        def update(key_states, value_states, layer_idx, *rest, **kw):
            names = cache_wanted.get(layer_idx, {})
            if "k" in names:
                emit(names["k"], key_states)
            if "v" in names:
                emit(names["v"], value_states)
            return original(key_states, value_states, layer_idx, *rest, **kw)

        cache.update = update
        wrapped_caches.append(cache)

    return hook
