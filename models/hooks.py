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
- ``blocks.{l}.attn.hook_rot_q``  ``[batch, q_head, pos, d_head]``  query after RoPE: ``hook_q`` rotated by the
  attention module's own ``apply_rotary_pos_emb`` with the ``(cos, sin)`` the module received
- ``blocks.{l}.attn.hook_rot_k``  ``[batch, kv_head, pos, d_head]`` key after RoPE, likewise (equals
  ``hook_cache_k``, but needs no cache)
- ``blocks.{l}.attn.hook_pattern`` ``[batch, q_head, query_pos, key_pos]`` float32 attention probabilities of this
  forward's queries over every key the layer attended to (the cache's keys, when the forward has a cache, in the
  cache's order), recomputed by `models.attention` from ``hook_rot_q``, those keys and the mask the module received,
  under any kernel. They equal the eager kernel's ``attn_weights``, except that a query that sees no key (a padding
  row) reads zeros. Each forward has its own key axis, so a capture of several forwards is read with ``calls``.

Each projection hook reads a module of the decoder layer, by the model's own module path: ``self_attn.q_proj`` (and
``k_proj``, ``v_proj``) unless the family's record (`models.families.Family.projections`) names another one (the
QK-norm, a slice of a fused ``qkv_proj``) and the layout of its output. The cache hooks (and the keys of
``hook_pattern``) are recorded by wrapping, for the duration of the context only, the ``update`` method of the cache
*instance* the attention layers receive; nothing is patched on a class or at import time.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.errors import UsageError
from models.attention import LayerSpec, attention_probabilities, layer_spec, rotate, visible_from_module_mask
from models.families import HookPoint, family_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

RESID_HOOKS = ("hook_resid_pre", "hook_resid_post")
ATTN_HOOKS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_cache_k", "attn.hook_cache_v")
DERIVED_HOOKS = ("attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_pattern")  # computed, not read off a module
_NAME = re.compile(
    r"^blocks\.(\d+)\.(hook_resid_pre|hook_resid_post|attn\.hook_(?:q|k|v|cache_k|cache_v|rot_q|rot_k|pattern))$"
)


def hook_name(layer: int, point: str) -> str:
    """`hook_name(3, "attn.hook_v")` -> ``"blocks.3.attn.hook_v"``."""
    return f"blocks.{layer}.{point}"


def all_hook_names(model: PreTrainedModel) -> list[str]:
    n_layers = model.config.num_hidden_layers
    return [hook_name(layer, point) for layer in range(n_layers) for point in RESID_HOOKS + ATTN_HOOKS + DERIVED_HOOKS]


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = model.get_submodule(family_of(model.config).layers)
    assert isinstance(layers, nn.ModuleList)  # every family's decoder layers are one (`Family.layers`)
    return layers


def layer_specs(model: PreTrainedModel) -> list[LayerSpec]:
    """What each decoder layer's attention does (scaling, sliding window, soft cap), read from its module."""
    return [layer_spec(layer.get_submodule("self_attn"), model.config, index)
            for index, layer in enumerate(decoder_layers(model))]


def parse_hook_name(model: PreTrainedModel, name: str) -> tuple[int, str]:
    """Split a canonical name into (layer, point), raising a `UsageError` if it does not resolve on `model`."""
    match = _NAME.match(name)
    if not match:
        raise UsageError(
            f"hook name {name!r} does not resolve; valid forms: "
            f"blocks.<layer>.{{{', '.join(RESID_HOOKS + ATTN_HOOKS + DERIVED_HOOKS)}}}"
        )
    layer, point = int(match.group(1)), match.group(2)
    n_layers = model.config.num_hidden_layers
    if layer >= n_layers:
        raise UsageError(f"hook name {name!r} does not resolve: layer {layer} out of range 0..{n_layers - 1}")
    family_of(model.config)
    return layer, point


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
        if len(parts) == 1:
            return parts[0]
        if name.endswith("hook_pattern"):
            raise ValueError(f"{name!r} was captured over {len(parts)} forwards, each with its own keys; "
                             f"read them with calls({name!r})")
        return torch.cat(parts, dim=1 if "resid" in name else 2)

    def __contains__(self, name: str) -> bool:
        return name in self._store

    def keys(self) -> list[str]:
        return list(self._store)

    def clear(self) -> None:
        self._store.clear()


@contextlib.contextmanager
def capture(
    model: PreTrainedModel,
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
    table = family_of(model.config).hook_table()
    config = model.config
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
    derived_wanted: dict[int, dict[str, str]] = defaultdict(dict)  # layer -> {point: name}
    # layer -> what to call with (new keys, new values, every key the layer attends to) at each cache update
    cache_listeners: dict[int, list[Callable]] = defaultdict(list)
    wrapped_caches: list[Cache] = []

    try:
        for name, layer, point in parsed:
            block = layers[layer]
            if point == "hook_resid_pre":
                handles.append(block.register_forward_pre_hook(_resid_pre_hook(name, emit), with_kwargs=True))
            elif point == "hook_resid_post":
                handles.append(block.register_forward_hook(_resid_post_hook(name, emit)))
            elif point in ("attn.hook_cache_k", "attn.hook_cache_v"):
                cache_wanted[layer][point[-1]] = name
            elif point in DERIVED_HOOKS:
                derived_wanted[layer][point] = name
            else:
                module = block.get_submodule(table[point].module)
                handles.append(module.register_forward_hook(_projection_hook(name, table[point], config, emit)))
        for layer, wanted in cache_wanted.items():
            cache_listeners[layer].append(_cache_emitter(wanted, emit))
        for layer, wanted in derived_wanted.items():
            block = layers[layer]
            attn = block.get_submodule("self_attn")
            derived = _DerivedPoints(attn, layer_spec(attn, config, layer), wanted, emit)
            handles.append(attn.register_forward_pre_hook(derived.before, with_kwargs=True))
            for point, store in (("attn.hook_q", derived.query), ("attn.hook_k", derived.key)):
                module = block.get_submodule(table[point].module)
                handles.append(module.register_forward_hook(_projection_hook(point, table[point], config, store)))
            handles.append(attn.register_forward_hook(derived.after))
            if "attn.hook_pattern" in wanted:
                cache_listeners[layer].append(derived.attended)
        for layer in cache_listeners:
            attn = layers[layer].get_submodule("self_attn")
            hook = _cache_wrapping_hook(cache_listeners, wrapped_caches, needs_cache=layer in cache_wanted)
            handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
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


def _projection_hook(name: str, point: HookPoint, config, emit):
    def hook(module, args, output):
        emit(name, point.read(output, config))

    return hook


def _cache_emitter(wanted: dict[str, str], emit):
    def listener(key_states, value_states, attended_keys):
        if "k" in wanted:
            emit(wanted["k"], key_states)
        if "v" in wanted:
            emit(wanted["v"], value_states)

    return listener


def _cache_wrapping_hook(listeners: dict[int, list[Callable]], wrapped_caches: list[Cache], needs_cache: bool):
    """Wrap the `update` of the cache instance this attention layer receives, once per cache object; the wrapper
    hands every layer's listeners what the layer stored and what it attends to."""

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:
            if needs_cache:
                raise UsageError("attn.hook_cache_k/v needs a forward with a KV cache (use_cache=True)")
            return
        if any(c is cache for c in wrapped_caches):
            return
        original = type(cache).update.__get__(cache)

        def update(key_states, value_states, layer_idx, *rest, **kw):
            keys, values = original(key_states, value_states, layer_idx, *rest, **kw)
            for listener in listeners.get(layer_idx, ()):
                listener(key_states, value_states, keys)
            return keys, values

        cache.update = update
        wrapped_caches.append(cache)

    return hook


class _DerivedPoints:
    """``hook_rot_q|rot_k|pattern`` of one layer, assembled during its attention module's forward: the inputs the
    module receives (pre-hook), its pre-RoPE projections, the keys its cache returns, then computed when it returns."""

    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin)
    mask: torch.Tensor | None
    q: torch.Tensor | None
    k: torch.Tensor | None
    attended_keys: torch.Tensor | None

    def __init__(self, module: nn.Module, spec: LayerSpec, wanted: dict[str, str], emit) -> None:
        self.module = module
        self.spec = spec
        self.wanted = wanted
        self.emit = emit
        self._clear()

    def _clear(self) -> None:
        self.position_embeddings = self.mask = self.q = self.k = self.attended_keys = None

    def before(self, module, args, kwargs) -> None:
        self._clear()
        self.position_embeddings = kwargs["position_embeddings"]
        self.mask = kwargs.get("attention_mask")

    def query(self, point: str, tensor: torch.Tensor) -> None:
        self.q = tensor

    def key(self, point: str, tensor: torch.Tensor) -> None:
        self.k = tensor

    def attended(self, key_states, value_states, attended_keys: torch.Tensor) -> None:
        self.attended_keys = attended_keys

    def after(self, module, args, output) -> None:
        # set during this forward: by `before` (the module's pre-hook) and by its q and k projections' hooks
        assert self.position_embeddings is not None and self.q is not None and self.k is not None
        cos, sin = self.position_embeddings
        # [batch, q_head, pos, d_head] and [batch, kv_head, pos, d_head]
        rot_q, rot_k = rotate(self.module, self.q, self.k, cos, sin)
        if "attn.hook_rot_q" in self.wanted:
            self.emit(self.wanted["attn.hook_rot_q"], rot_q)
        if "attn.hook_rot_k" in self.wanted:
            self.emit(self.wanted["attn.hook_rot_k"], rot_k)
        if "attn.hook_pattern" in self.wanted:
            keys = rot_k if self.attended_keys is None else self.attended_keys  # [b, kv_head, key_pos, d_head]
            visible = visible_from_module_mask(self.mask, rot_q.shape[2], keys.shape[2], self.spec.window, rot_q.device)
            pattern = attention_probabilities(rot_q, keys, scaling=self.spec.scaling, softcap=self.spec.softcap,
                                              sinks=self.spec.sinks, visible=visible)  # [b, q_head, query_pos, key_pos]
            self.emit(self.wanted["attn.hook_pattern"], pattern)
        self._clear()
