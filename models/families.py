"""Model families: what kvscope must know about an architecture beyond what its modules and config already say.

Every model-driven stage reaches a model by its own module paths (``model.layers.{l}.self_attn.k_proj``) and reads
its geometry from its config (heads, head size, ``layer_types``, ``sliding_window``), so a family record holds only
the facts that differ from a Llama-style decoder:

- where the decoder layers are, if not ``model.layers``;
- which module each projection hook reads, when it is not ``self_attn.q_proj|k_proj|v_proj`` (the QK-norm's output,
  or a slice of a fused ``qkv_proj``), and that module's output layout (`HookPoint`);
- what the attention kernel call receives that its module's attributes do not tell apart (`softcap`, `sinks`);
- the transformers config class a random-init tiny model is built from (`models.tiny`), and the tiny fields that
  differ from the shared ones;
- for the nnsight and TransformerLens cross-checks (`models.interop`): the order in which a layer's forward
  produces the projection hooks, and the bridge's name for them, where they differ.

`models.hooks`, `models.attention`, `models.tiny` and `models.interop` derive everything from these records, so a
family is added by one `Family` among those registered below (or, from a test or an extension, `register_family`);
the family tests (tests/test_families.py, tests/test_hooks.py, tests/test_interop.py) then run on its tiny model.
Wherever a stage needs a family's facts (hooks, attention recomputation, tiny models, interop), a model whose
``model_type`` has no record is refused with one line naming the known families.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from core.errors import UsageError, unknown_choice

if TYPE_CHECKING:  # transformers takes seconds to import; the table names its config classes instead
    import torch
    from transformers import PretrainedConfig

# Output layouts of the module a hook reads. "flat": [b, pos, heads*d]; "bphd": [b, pos, heads, d];
# "bhpd": [b, heads, pos, d]. `HookPoint.read` returns every one as [b, heads, pos, d].
FLAT, BPHD, BHPD = "flat", "bphd", "bhpd"
_FUSED_PARTS = ("q", "k", "v")


@dataclass(frozen=True)
class HookPoint:
    """A module whose output a hook reads (path relative to the decoder layer, or a bridge hook name), its layout,
    and whose head count shapes it (``"q"`` or ``"kv"``). `part` names the slice of a fused ``[q | k | v]``
    projection (Phi-3's ``qkv_proj``: query heads first, then key heads, then value heads)."""

    module: str
    layout: str = FLAT
    heads: str = "kv"
    part: str | None = None

    def read(self, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
        """The module's output `tensor` as ``[batch, heads, pos, d_head]``."""
        n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
        if self.part is not None:
            d_head = tensor.shape[-1] // (n_q + 2 * n_kv)
            sizes = (n_q * d_head, n_kv * d_head, n_kv * d_head)
            tensor = tensor.split(sizes, dim=-1)[_FUSED_PARTS.index(self.part)]
        if self.layout == FLAT:
            b, pos, width = tensor.shape
            heads = n_q if self.heads == "q" else n_kv
            return tensor.view(b, pos, heads, width // heads).transpose(1, 2)
        if self.layout == BPHD:
            return tensor.transpose(1, 2)
        return tensor


# Llama's attention: separate projections whose flat outputs are the pre-RoPE queries, keys and values.
PROJECTIONS = MappingProxyType({
    "attn.hook_q": HookPoint("self_attn.q_proj", FLAT, "q"),
    "attn.hook_k": HookPoint("self_attn.k_proj", FLAT, "kv"),
    "attn.hook_v": HookPoint("self_attn.v_proj", FLAT, "kv"),
})
# Where each hook falls in a decoder layer's forward (nnsight asks for values in this order).
NNSIGHT_ORDER = MappingProxyType({
    "hook_resid_pre": 0, "attn.hook_q": 1, "attn.hook_k": 2, "attn.hook_v": 3, "attn.hook_cache_k": 4,
    "attn.hook_cache_v": 4, "hook_resid_post": 5,
})
# TransformerLens bridge hooks (under ``blocks.{l}.``) of each canonical point; the post-RoPE key is ``hook_rot_k``.
TL_POINTS = MappingProxyType({
    "hook_resid_pre": HookPoint("hook_resid_pre"),
    "hook_resid_post": HookPoint("hook_resid_post"),
    "attn.hook_q": HookPoint("attn.hook_q", BPHD, "q"),
    "attn.hook_k": HookPoint("attn.hook_k", BPHD),
    "attn.hook_v": HookPoint("attn.hook_v", BPHD),
    "attn.hook_cache_k": HookPoint("attn.hook_rot_k", BPHD),
    "attn.hook_cache_v": HookPoint("attn.hook_v", BPHD),
})


def _frozen(mapping: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Family:
    """One architecture (``config.model_type``) and what kvscope must be told about it."""

    model_type: str
    # transformers' config class of the family, or its name in transformers (imported only when `config_type` is
    # asked, so reading the table does not import transformers); `models.tiny` builds the tiny config from it
    config_class: type[PretrainedConfig] | str
    # fields of the tiny config that differ from the shared ones (`models.tiny.tiny_config`)
    tiny: Mapping[str, Any] = field(default_factory=_frozen)
    # the name of the tiny model, ``tiny-<name>``; the model_type when empty
    tiny_name: str = ""
    layers: str = "model.layers"  # the decoder-layer list
    projections: Mapping[str, HookPoint] = field(default_factory=_frozen)  # where they differ from `PROJECTIONS`
    # The kernel call passes ``softcap=module.attn_logit_softcapping`` (Gemma2). Gemma3 keeps the attribute but never
    # passes it, so reading the attribute alone would cap logits the model does not cap.
    softcap: bool = False
    # The kernel call passes ``s_aux=module.sinks``: one learned logit per query head joins every softmax as a key
    # that carries no value (gpt-oss), so a query's probabilities over the real keys sum to less than 1.
    sinks: bool = False
    nnsight_order: Mapping[str, float] = field(default_factory=_frozen)  # where they differ from `NNSIGHT_ORDER`
    # where they differ from `TL_POINTS`; None: the bridge exposes no hook for that point
    tl_points: Mapping[str, HookPoint | None] = field(default_factory=_frozen)

    def __post_init__(self) -> None:
        for name in ("tiny", "projections", "nnsight_order", "tl_points"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def name(self) -> str:
        return self.tiny_name or self.model_type

    def config_type(self) -> type[PretrainedConfig]:
        """The family's transformers config class."""
        if isinstance(self.config_class, str):
            import transformers

            return getattr(transformers, self.config_class)
        return self.config_class

    def hook_table(self) -> dict[str, HookPoint]:
        """Projection hook name -> the module it reads."""
        return {**PROJECTIONS, **self.projections}

    def interop_order(self) -> dict[str, float]:
        return {**NNSIGHT_ORDER, **self.nnsight_order}

    def interop_points(self) -> dict[str, HookPoint | None]:
        return {**TL_POINTS, **self.tl_points}


# QK-norm over one head's features, applied to [b, pos, head, d] before the transpose (Qwen3).
_QK_NORM_BPHD = {
    "attn.hook_q": HookPoint("self_attn.q_norm", BPHD, "q"),
    "attn.hook_k": HookPoint("self_attn.k_norm", BPHD, "kv"),
}
# The bridge exposes the normed projections of a QK-norm family as their own hooks, already [b, head, pos, d].
_TL_QK_NORMED = {
    "attn.hook_q": HookPoint("attn.hook_q_normed", BHPD, "q"),
    "attn.hook_k": HookPoint("attn.hook_k_normed", BHPD),
}

FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add `family` to `FAMILIES`; a second record for the same model_type or tiny name is refused."""
    taken = {f.name for f in FAMILIES.values()} | set(FAMILIES)
    if family.model_type in FAMILIES or family.name in taken:
        raise UsageError(f"model family {family.model_type!r} ({family.name!r}) is already registered")
    FAMILIES[family.model_type] = family
    return family


for _family in (
    Family("llama", "LlamaConfig"),
    Family("mistral", "MistralConfig", tiny={"sliding_window": 16}),  # every layer slides, through the mask alone
    Family("qwen2", "Qwen2Config"),
    Family("qwen3", "Qwen3Config", tiny={"attention_bias": False}, projections=_QK_NORM_BPHD, tl_points=_TL_QK_NORMED),
    Family("qwen3_moe", "Qwen3MoeConfig",
           tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
           projections=_QK_NORM_BPHD, tl_points=_TL_QK_NORMED),
    Family("gemma2", "Gemma2Config", tiny={"sliding_window": 16, "query_pre_attn_scalar": 16}, softcap=True),
    Family(
        "gemma3_text", "Gemma3TextConfig", tiny_name="gemma3",
        # three sliding-window layers, then a global one
        tiny={"sliding_window": 16, "query_pre_attn_scalar": 16, "sliding_window_pattern": 4},
        # QK-norm applied to [b, head, pos, d] after the transpose, which comes after v_proj
        projections={"attn.hook_q": HookPoint("self_attn.q_norm", BHPD, "q"),
                     "attn.hook_k": HookPoint("self_attn.k_norm", BHPD, "kv")},
        nnsight_order={"attn.hook_v": 0.5}, tl_points=_TL_QK_NORMED,
    ),
    Family(
        "phi3", "Phi3Config",
        projections={  # one fused projection, [q | k | v]
            point: HookPoint("self_attn.qkv_proj", FLAT, "q" if part == "q" else "kv", part)
            for point, part in (("attn.hook_q", "q"), ("attn.hook_k", "k"), ("attn.hook_v", "v"))},
        tl_points={"attn.hook_cache_k": None},  # the bridge's joint-QKV attention keeps its rotated keys inside
    ),
    Family(
        "olmo2", "Olmo2Config",
        # QK-norm over the whole projection (every head's features at once), before the head reshape
        projections={"attn.hook_q": HookPoint("self_attn.q_norm", FLAT, "q"),
                     "attn.hook_k": HookPoint("self_attn.k_norm", FLAT, "kv")},
        tl_points={"attn.hook_q": HookPoint("attn.hook_q_normed", FLAT, "q"),
                   "attn.hook_k": HookPoint("attn.hook_k_normed", FLAT)},
    ),
    # sliding and full layers alternate (the config's default layer_types); the MLP is a mixture of experts
    Family("gpt_oss", "GptOssConfig", tiny={"sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
           sinks=True),
):
    register_family(_family)


def family_of(config: PretrainedConfig) -> Family:
    """The record of `config`'s model_type; a `UsageError` naming the known families if there is none."""
    if config.model_type not in FAMILIES:
        raise unknown_choice("model family", config.model_type, FAMILIES)
    return FAMILIES[config.model_type]


def family_names() -> list[str]:
    """The name of every family (``tiny-<name>`` models), in registration order."""
    return [family.name for family in FAMILIES.values()]


def family_named(name: str) -> Family:
    """The family whose tiny model is ``tiny-<name>``."""
    for family in FAMILIES.values():
        if family.name == name:
            return family
    raise unknown_choice("tiny model family", name, family_names())
