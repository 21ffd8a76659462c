"""Which attention kernel ran (models/kernels.py): SDPA's backend per call, the math fallback caught, and the eviction
engine refusing a non-FlashAttention run when a speed study requires FlashAttention."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from core.errors import UsageError
from evictor.engine import EvictionEngine
from models.kernels import REQUIRE_FLASH_ENV, attention_kernels_run, check_flash
from models.tiny import tiny_model

IDS = torch.arange(40, 80)[None]


@torch.inference_mode()
def test_each_sdpa_call_is_counted_under_the_backend_that_serves_it(tiny_llama):
    layers = tiny_llama.model.config.num_hidden_layers
    with attention_kernels_run(tiny_llama.model) as counts:
        tiny_llama.model(input_ids=IDS)
    assert counts == {"sdpa:flash": layers}  # torch's CPU flash kernel takes an unpadded causal prefill
    check_flash(counts, "prefill")
    with sdpa_kernel([SDPBackend.MATH]), attention_kernels_run(tiny_llama.model) as counts:
        tiny_llama.model(input_ids=IDS)
    assert counts == {"sdpa:math": layers}
    with pytest.raises(UsageError, match=r"^prefill: attention ran sdpa:math x4, not FlashAttention"):
        check_flash(counts, "prefill")


@torch.inference_mode()
def test_a_model_not_on_sdpa_reports_its_implementation():
    eager = tiny_model("llama", seed=0, attn_implementation="eager")
    with attention_kernels_run(eager.model) as counts:
        eager.model(input_ids=IDS)
    assert counts == {"eager": 1}
    with pytest.raises(UsageError, match="attention ran eager x1"):
        check_flash(counts, "prefill")
    with pytest.raises(UsageError, match="no attention call"):
        check_flash(Counter(), "nothing")


def test_the_eviction_engine_stops_a_required_flash_run_that_fell_back(tiny_llama, monkeypatch):
    engine = EvictionEngine(tiny_llama, "random")
    prompt = list(range(40, 70))
    monkeypatch.setenv(REQUIRE_FLASH_ENV, "1")
    assert len(engine.generate([prompt], 4).sequences[0].generated_ids) <= 4  # flash ran: no objection
    with sdpa_kernel([SDPBackend.MATH]), pytest.raises(UsageError, match="eviction engine's prefill: attention ran"):
        engine.generate([prompt], 4)
    monkeypatch.delenv(REQUIRE_FLASH_ENV)
    with sdpa_kernel([SDPBackend.MATH]):
        engine.generate([prompt], 4)  # not required: runs on whatever kernel
