"""models.memory.prefill_peak_memory on a tiny model and SmolLM2, and its rows drawn by figures.prefill_memory."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from figures.prefill_memory import plot_prefill_memory
from models import memory
from core.errors import UsageError
from models.memory import MB, attention_map_bytes, prefill_peak_memory
from models.tiny import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0)


def test_attention_map_bytes_by_hand(llama):
    # tiny llama: 4 layers, 4 query heads, fp32. eager+attentions keeps every layer's [b, h, n, n] map.
    assert attention_map_bytes(llama.model, "eager+attentions", ctx=100, batch=2) == 4 * 2 * 4 * 100 * 100 * 4
    assert attention_map_bytes(llama.model, "eager", ctx=100, batch=2) == 2 * 4 * 100 * 100 * 4
    assert attention_map_bytes(llama.model, "sdpa", ctx=100, batch=2) == 0


def test_returned_attention_maps_show_up_in_the_peak(llama):
    n = 256
    rows = prefill_peak_memory(llama, [n], kernels=("sdpa", "eager+attentions"))
    by_kernel = {r["kernel"]: r for r in rows}
    assert all(r["measured"] and not r["oom"] for r in rows)
    maps_mb = 4 * 4 * n * n * 4 / MB  # 4 MB: layers x heads x n x n x fp32
    extra = by_kernel["eager+attentions"]["forward_mem_mb"] - by_kernel["sdpa"]["forward_mem_mb"]
    assert extra >= maps_mb
    tensors = [*llama.model.parameters(), *llama.model.buffers()]  # buffers: the rotary inverse frequencies
    resident_mb = sum(t.numel() * t.element_size() for t in tensors) / MB
    sdpa = by_kernel["sdpa"]
    assert sdpa["peak_mem_mb"] == pytest.approx(resident_mb + sdpa["forward_mem_mb"], rel=1e-9)
    assert sdpa["forward_mem_mb"] < maps_mb  # the fused kernel never holds the n x n maps
    assert llama.kernel == "sdpa"  # restored


def test_cpu_measurement_is_repeatable_and_grows_with_context(llama):
    first = prefill_peak_memory(llama, [64, 128], kernels=("sdpa",))
    second = prefill_peak_memory(llama, [64, 128], kernels=("sdpa",))
    assert [r["forward_mem_mb"] for r in first] == [r["forward_mem_mb"] for r in second]
    assert first[0]["forward_mem_mb"] < first[1]["forward_mem_mb"]
    assert [r["ctx"] for r in first] == [64, 128] and first[0]["method"].startswith("torch.profiler")


def test_oom_is_caught_and_longer_contexts_are_inferred(llama, monkeypatch):
    real_forward = llama.model.forward
    calls = []

    def forward(input_ids=None, **kwargs):
        calls.append(input_ids.shape[1])
        if input_ids.shape[1] > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real_forward(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(llama.model, "forward", forward)
    rows = prefill_peak_memory(llama, [256, 32, 128], kernels=("eager+attentions",))
    assert [(r["ctx"], r["oom"], r["measured"]) for r in rows] == [(32, False, True), (128, True, True),
                                                                    (256, True, False)]
    assert calls == [32, 128]
    assert rows[1]["peak_mem_mb"] is None
    assert llama.kernel == "sdpa"  # restored after the failure too


def test_other_errors_propagate(llama, monkeypatch):
    def forward(**kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(llama.model, "forward", forward)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        prefill_peak_memory(llama, [16], kernels=("sdpa",))
    assert llama.kernel == "sdpa"


def test_bad_arguments_are_usage_errors(llama):
    with pytest.raises(UsageError, match="unknown attention kernel 'eagr'"):
        prefill_peak_memory(llama, [16], kernels=("eagr",))
    with pytest.raises(UsageError, match="needs a CUDA device"):
        prefill_peak_memory(llama, [16], kernels=("flash_attention_2",))
    with pytest.raises(UsageError, match="positive integer"):
        prefill_peak_memory(llama, [0])
    with pytest.raises(UsageError, match="batch"):
        prefill_peak_memory(llama, [16], batch=0)


def test_unaffordable_cpu_run_is_skipped_not_attempted(llama, monkeypatch):
    monkeypatch.setattr(memory, "_measure", lambda *a, **k: pytest.fail("must not run"))
    rows = prefill_peak_memory(llama, [1_000_000], kernels=("eager+attentions",))  # 64 TB of maps
    assert rows[0]["oom"] and not rows[0]["measured"]


def test_rows_feed_the_prefill_figure(tiny_gemma3):
    rows = prefill_peak_memory(tiny_gemma3, [32, 64], kernels=("sdpa", "eager+attentions"))
    fig = plot_prefill_memory(pd.DataFrame(rows))
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert labels == ["SDPA", "eager + output_attentions=True"]
    assert tiny_gemma3.kernel == "sdpa"
    forward = plot_prefill_memory(pd.DataFrame(rows), memory="forward_mem_mb").axes[0]
    eager = [line for line in forward.lines if line.get_label() == "eager + output_attentions=True"][0]
    assert eager.get_ydata().tolist() == [r["forward_mem_mb"] for r in rows if r["kernel"] == "eager+attentions"]
    assert forward.get_ylabel().startswith("Forward's own peak memory (MB")
    with pytest.raises(UsageError, match="unknown memory column"):
        plot_prefill_memory(pd.DataFrame(rows), memory="rss")


@pytest.mark.realmodel
def test_smollm2_cli_writes_table(tmp_path, capsys):
    out = tmp_path / "mem"
    code = memory.main(["--model", "smollm2-135m", "--device", "cpu", "--ctx", "32",
                        "--kernels", "sdpa", "eager+attentions", "--out", str(out)])
    assert code == 0
    table = pd.read_csv(out / "prefill_memory.csv")
    assert table["kernel"].tolist() == ["sdpa", "eager+attentions"]
    # SmolLM2: 30 layers x 9 heads x 32 x 32 x fp32 = 1.05 MB of returned maps
    maps_mb = 30 * 9 * 32 * 32 * 4 / MB
    assert table["forward_mem_mb"][1] - table["forward_mem_mb"][0] >= maps_mb
    assert table["peak_mem_mb"].min() > 400  # 135 M fp32 parameters are ~515 MB
    assert (out / "config.json").exists()


def test_cli_bad_kernel_exits_2_without_files(tmp_path, capsys):
    out = tmp_path / "mem"
    assert memory.main(["--ctx", "64", "--kernels", "flash", "--out", str(out)]) == 2
    assert "unknown attention kernel 'flash'" in capsys.readouterr().err
    assert not out.exists()
