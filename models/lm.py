"""A loaded model: the record every stage passes around, whoever built it (`models.loading`, `models.tiny`).

It sits below the modules that build models so that none of them imports another to name what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers' model classes take seconds to import; they are only annotations here
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


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
