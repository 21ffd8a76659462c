"""What a request will hold in memory, estimated from the model's config before any weight is loaded.

A stage's peak is the sum of what it holds at once (`core.limits.Footprint`, checked against the device's memory by
`core.limits.MemoryLimit`); `ModelShape` gives each part from the sizes a config states:

- **weights**: every parameter and buffer of the model built on transformers' meta device (so nothing is
  allocated and tied embeddings count once), in the dtype the run loads it in;
- **KV cache** (`ModelShape.kv_bytes`): keys and values of every layer for the positions held, a sliding-window
  layer holding at most its window;
- **forward** (`ModelShape.forward_bytes`): the transient peak of the largest forward, i.e. one layer's activations for
  every token in flight (the residual stream and its norm beside the wider of the attention phase, with the
  grouped-query K/V repeated per query head, and the MLP phase, whose gate, up, activation and product coexist),
  the attention scores the eager kernel materialises with their fp32 softmax (the fused kernels never hold a
  ``[queries, keys]`` map), and the logits the forward returns with an fp32 copy for sampling;
- **runtime** (`RUNTIME_BYTES`): the interpreter, torch, transformers and a tokenizer, which hold about 310 MiB
  here before any model loads (the CUDA context is of the same order on a GPU).

Each stage composes these for what it runs (`tasks.generation.generation_footprint`,
`evictor.engine.eviction_footprint`, `forward_footprint` for a teacher-forced pass). The estimate is an upper
bound of the tensors PyTorch allocates; docs/limits.md gives its ratio to measured peaks on the tiny and the real
models (`tests/test_footprint.py` holds it to that).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.limits import Footprint

RUNTIME_BYTES = 512 * 2**20
FP32 = 4  # bytes of the softmax, sampling and attention-feed tensors, computed in float32 whatever the weights


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that its memory follows, read from its config (`model_shape`)."""

    model: str  # as the user named it
    layers: int
    hidden: int
    mlp: int  # the MLP width one token passes through (in a mixture of experts, its experts' widths summed)
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for a full-attention layer
    weight_bytes: int
    itemsize: int  # bytes per element of the dtype the model runs in

    def kv_bytes(self, rows: int, tokens: int) -> int:
        """Keys and values of `tokens` positions for `rows` sequences in every layer."""
        held = sum(tokens if window is None else min(tokens, window) for window in self.windows)
        return rows * held * 2 * self.kv_heads * self.head_dim * self.itemsize

    def layer_kv_bytes(self, rows: int, tokens: int) -> int:
        """One full-attention layer's keys and values: what a copy of one layer of a cache adds (a `torch.cat` that
        appends to it, a gather that compacts it)."""
        return rows * tokens * 2 * self.kv_heads * self.head_dim * self.itemsize

    def token_bytes(self) -> int:
        """Activations one token in flight holds inside a decoder layer: residual and normed stream, and the wider
        phase: attention (q and its rotated copy, k and v and the rotated k, both repeated per query head, the
        attention output) or the MLP (gate, up, activation, product)."""
        attention = 5 * self.q_heads * self.head_dim + 3 * self.kv_heads * self.head_dim
        return self.itemsize * (2 * self.hidden + max(attention, 4 * self.mlp))

    def forward_bytes(self, rows: int, queries: int, keys: int, *, logits: int = 1, eager: bool = False,
                      kept_maps: int = 0) -> int:
        """The transient peak of one forward of `queries` new tokens per row over `keys` positions: activations,
        the ``[rows, 1, queries, keys]`` attention mask transformers builds, the eager kernel's scores and fp32
        softmax (`eager`), `kept_maps` layers' attention maps returned with the output (``output_attentions``), and
        logits at `logits` positions per row with their fp32 copy."""
        scores = rows * self.q_heads * queries * keys
        return (rows * queries * self.token_bytes()
                + rows * queries * keys * self.itemsize
                + (scores * (self.itemsize + FP32) if eager else 0)
                + kept_maps * scores * self.itemsize
                + rows * logits * self.vocab * (self.itemsize + FP32))

    def weights(self) -> Footprint:
        """The weights and the runtime: what any process that loads the model holds."""
        return Footprint((("weights", self.weight_bytes), ("runtime", RUNTIME_BYTES)))


def model_shape(name: str, dtype: str | None = None, device: str | None = None) -> ModelShape:
    """The `ModelShape` of model `name` (anything `models.loading.load_model` takes) in the dtype `load_model` would
    give it on `device` for `dtype`; nothing is loaded (a registry model's converted copy is made on first use, as
    `models.loading.model_config` does)."""
    import torch

    from models.loading import default_device, model_config, resolve_dtype

    device_ = torch.device(device) if device is not None else default_device()
    return config_shape(name, model_config(name), resolve_dtype(dtype, device_).itemsize)


def config_shape(name: str, config, itemsize: int) -> ModelShape:
    """The `ModelShape` of a model built from transformers `config` (a random-init benchmark model), its weights
    `itemsize` bytes each; the parameters are counted on the meta device, so nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.attention import layer_kinds

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    weights = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    window = getattr(text, "sliding_window", None)
    return ModelShape(
        model=name,
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        mlp=_mlp_width(text),
        q_heads=text.num_attention_heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        vocab=text.vocab_size,
        windows=tuple(window if kind == "sliding_attention" else None for kind in layer_kinds(text)),
        weight_bytes=weights * itemsize,
        itemsize=itemsize,
    )


def _mlp_width(config) -> int:
    """The MLP width a token passes through: the experts a token is routed to (their width each) plus any shared
    expert in a mixture of experts, else the dense MLP's."""
    experts = getattr(config, "num_experts_per_tok", None)
    if not experts:
        return config.intermediate_size
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    return experts * width + shared


def forward_footprint(shape: ModelShape, rows: int, tokens: int, *, logits: int = 1, eager: bool = False,
                      kept_maps: int = 0) -> Footprint:
    """A teacher-forced pass: `rows` sequences of `tokens` positions in one forward, their KV cache built as it
    runs (`ModelShape.forward_bytes` says what `logits`, `eager` and `kept_maps` add)."""
    return shape.weights() + Footprint((
        ("KV cache", shape.kv_bytes(rows, tokens)),
        ("forward", shape.forward_bytes(rows, tokens, tokens, logits=logits, eager=eager, kept_maps=kept_maps)),
    ))
