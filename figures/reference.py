"""Values reported in ValueDiff (Tables 4 and 5), drawn as grey reference points next to what kvscope measures.

Source: Park, Choi and Lee, "ValueDiff: Value-Geometric KV Cache Eviction for Sink-Suppressed LLMs", Appendix C.
Table 4: sink rate (fraction of heads whose leading-token weight exceeds 0.3), sigma_K and sigma_V (std of per-token
L2 distance from the cache mean, averaged over layers, heads and 20 prompts at 2048 tokens) and their ratio. Table 5:
mean BOS attention weight and BOS key cosine similarity to the mean content key. These are the paper's numbers for
its models, not measurements of ours; the columns carry kvscope's names (`geometry.survey`'s ``model.csv``).
"""

from __future__ import annotations

import pandas as pd

VALUEDIFF_TABLE4_LABEL = "ValueDiff Table 4 (reported)"
VALUEDIFF_TABLE5_LABEL = "ValueDiff Tables 4–5 (reported)"

# model, mechanism, sink_rate, sigma_k, sigma_v, sigma_ratio, alpha_bos, bos_cos
_ROWS = (
    ("Llama 3.1-8B", "None", 0.801, 1.783, 0.583, 0.33, 0.591, -0.604),
    ("Llama 3.2-3B", "None", 0.835, 1.478, 0.584, 0.40, 0.612, -0.586),
    ("Qwen2.5-3B", "None", 0.446, 1.561, 1.851, 1.19, 0.317, -0.091),
    ("Qwen2.5-7B", "None", 0.392, 1.597, 2.133, 1.34, 0.279, -0.337),
    ("Gemma2-2B", "Softcapping", 0.464, 1.807, 1.590, 0.88, 0.333, -0.350),
    ("Gemma2-9B", "Softcapping", 0.542, 1.808, 1.808, 1.00, 0.396, -0.424),
    ("Qwen3-4B", "QK-norm", 0.548, 2.322, 2.263, 0.97, 0.408, -0.182),
    ("Gemma3-4B", "QK-norm", 0.271, 12.506, 8.377, 0.67, 0.199, -0.555),
    ("Qwen3.5-4B", "Gated attn", 0.015, 1.596, 2.164, 1.36, 0.034, -0.115),
    ("Qwen3.5-9B", "Gated attn", 0.012, 2.344, 3.488, 1.49, 0.031, -0.137),
    ("GPT-OSS-20B", "Learned sink", 0.029, 2.191, 3.652, 1.67, 0.030, -0.663),
)


def valuediff_reference() -> pd.DataFrame:
    """ValueDiff's 11 models: model, mechanism, sink_rate, sigma_k, sigma_v, sigma_ratio, alpha_bos, bos_cos."""
    return pd.DataFrame(_ROWS, columns=["model", "mechanism", "sink_rate", "sigma_k", "sigma_v", "sigma_ratio",
                                        "alpha_bos", "bos_cos"])
