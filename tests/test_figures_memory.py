"""models.memory.prefill_peak_memory on a tiny model and SmolLM2, its rows drawn by figures.prefill_memory, and the
memory benchmarks built on it (bench/prefill_memory.py, bench/equal_memory.py)."""

from __future__ import annotations

import csv
import importlib.util
import json
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

from core.errors import UsageError
from figures.prefill_memory import plot_prefill_memory, series_label
from models import memory
from models.memory import MB, PrefillSetup, attention_map_bytes, layer_bytes, prefill_peak_memory
from models.tiny import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0)


def bench(name: str):
    """A benchmark script of bench/ as a module (bench/ is a folder of scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


@pytest.mark.parametrize("kernel", ["sdpa", "eager+attentions"])
def test_layer_bytes_is_what_each_more_layer_adds_to_the_peak(kernel):
    n = 192
    peaks = {}
    for layers in (2, 4):
        lm = tiny_model("llama", seed=0, num_hidden_layers=layers)
        peaks[layers] = prefill_peak_memory(lm, [n], kernels=(kernel,))[0]["peak_mem_mb"] * MB
    per_layer = layer_bytes(lm.model, kernel, n, batch=1)
    # by hand: weights of a tiny layer, K and V [1, 2, n, 16] fp32, and for eager+attentions its [1, 4, n, n] map
    weights = sum(p.numel() for p in lm.model.model.layers[0].parameters()) * 4
    assert per_layer == weights + 2 * 2 * n * 16 * 4 + (4 * n * n * 4 if kernel == "eager+attentions" else 0)
    assert (peaks[4] - peaks[2]) / 2 == pytest.approx(per_layer, rel=0.02)


def test_a_setup_run_is_measured_with_its_forward(llama):
    held = []

    def scoring(model, forward):
        out = forward()
        held.append(torch.ones(16 * MB // 4))  # 16 MB of "scores", allocated while the forward's output is alive
        return out

    rows = prefill_peak_memory(llama, [64], kernels=("sdpa", PrefillSetup("sdpa+scores", "sdpa", run=scoring)))
    assert [r["kernel"] for r in rows] == ["sdpa", "sdpa+scores"] and len(held) == 1
    assert rows[1]["forward_mem_mb"] >= rows[0]["forward_mem_mb"] + 15


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


def test_figure_draws_one_depth_and_marks_extrapolated_points():
    rows = []
    for kernel, base in (("eager+attentions+h2o", 100.0), ("sdpa+valuediff", 50.0)):
        for ctx in (1024, 2048):
            rows.append({"kernel": kernel, "ctx": ctx, "peak_mem_mb": base + ctx / 100, "oom": False, "layers": 2,
                         "extrapolated": False})
            rows.append({"kernel": kernel, "ctx": ctx, "peak_mem_mb": 16 * base + ctx, "oom": False, "layers": 32,
                         "extrapolated": True})
    ax = plot_prefill_memory(pd.DataFrame(rows)).axes[0]
    eager = [line for line in ax.lines if line.get_label() == "eager + output_attentions=True, H2O"][0]
    assert eager.get_ydata().tolist() == [1600 + 1024, 1600 + 2048]  # the deepest rows by default
    hollow = [line for line in ax.lines if line.get_markerfacecolor() == "white"]
    assert len(hollow) == 2 and all(len(line.get_xdata()) == 2 for line in hollow)
    labels = [t.get_text() for legend in ax.figure.legends for t in legend.get_texts()]
    assert "extrapolated in depth" in labels and "SDPA, ValueDiff" in labels
    shallow = plot_prefill_memory(pd.DataFrame(rows), layers=2)
    sdpa = [line for line in shallow.axes[0].lines if line.get_label() == "SDPA, ValueDiff"][0]
    assert sdpa.get_ydata().tolist() == [50 + 10.24, 50 + 20.48]
    assert "extrapolated in depth" not in [t.get_text() for lg in shallow.legends for t in lg.get_texts()]
    with pytest.raises(UsageError, match="no rows at 4 layers; the table has 2, 32"):
        plot_prefill_memory(pd.DataFrame(rows), layers=4)
    with pytest.raises(UsageError, match="no layers column"):
        plot_prefill_memory(pd.DataFrame(rows).drop(columns="layers"), layers=2)


def test_series_labels():
    assert series_label("sdpa") == "SDPA"
    assert series_label("eager+attentions") == "eager + output_attentions=True"
    assert series_label("sdpa+epikv") == "SDPA, EpiKV"
    assert series_label("my-kernel") == "my-kernel"


def test_prefill_bench_scores_every_setup_and_extrapolates_in_depth(llama):
    prefill = bench("prefill_memory")
    n, target = 64, 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EpiKV's bands rescaled to the tiny depth
        rows = prefill.measure(llama, [n], target_layers=target)
    by = {(r["kernel"], r["layers"]): r for r in rows}
    assert set(by) == {(s, d) for s in ("eager+attentions+h2o", "sdpa+valuediff", "sdpa+epikv") for d in (4, target)}
    assert by["eager+attentions+h2o", 4]["forward_mem_mb"] > by["sdpa+valuediff", 4]["forward_mem_mb"]
    # H2O and ValueDiff keep one float32 score per key, KV head and layer; EpiKV one per token for all layers
    assert by["eager+attentions+h2o", 4]["layer_score_mb"] * MB == 2 * n * 4
    assert by["sdpa+epikv", 4]["layer_score_mb"] == 0
    for setup in ("eager+attentions+h2o", "sdpa+valuediff", "sdpa+epikv"):
        measured, grown = by[setup, 4], by[setup, target]
        assert not measured["extrapolated"] and grown["extrapolated"] and not grown["measured"]
        kernel = "eager+attentions" if setup.startswith("eager") else "sdpa"
        per_layer = layer_bytes(llama.model, kernel, n, 1) + measured["layer_score_mb"] * MB
        assert (grown["peak_mem_mb"] - measured["peak_mem_mb"]) * MB == pytest.approx((target - 4) * per_layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        limited = prefill.measure(llama, [n], target_layers=target, memory_limit=1)  # no eager forward fits
    skipped = [r for r in limited if r["kernel"] == "eager+attentions+h2o"]
    assert len(skipped) == 1 and skipped[0]["oom"] and not skipped[0]["measured"]
    resident = sum(t.numel() * t.element_size() for t in (*llama.model.parameters(), *llama.model.buffers()))
    weights = layer_bytes(llama.model, "sdpa", 0, 1)
    maps = target * 4 * n * n * 4  # every layer's [1, 4, n, n] fp32 map at the target depth
    assert skipped[0]["target_floor_mb"] * MB == resident + (target - 4) * weights + maps


def test_equal_memory_batch_comes_from_the_engine_cache(llama, monkeypatch):
    from evictor.engine import EvictionEngine
    from evictor.protocol import EvictionConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))  # its scripts import `common`
    equal = bench("equal_memory")
    config = EvictionConfig(budget=32, buffer=8, block=16, protect="sinks")
    # tiny llama: 4 layers x 2 KV heads; a slot holds K and V (2 x 16 fp32) and its int32 position
    slot = 4 * 2 * (2 * 16 * 4 + 4)
    assert equal.sequence_bytes(EvictionEngine(llama, "full", config), 100, 10) == 110 * slot
    assert equal.sequence_bytes(EvictionEngine(llama, "random", config), 100, 10) == (32 + 16 + 16 + 1) * slot
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epikv = EvictionEngine(llama, "epikv", config)
    assert equal.sequence_bytes(epikv, 100, 10) == (32 + 16 + 16 + 1) * (slot + 4 * 2 * 4)  # + a frozen fp32 score
    rows = equal.measure(llama, ["random"], memory=3 * 112 * slot, context=100, new_tokens=12, budget=32, buffer=8,
                         block=16, max_batch=4, repeats=2)
    assert [(r["policy"], r["fits"], r["batch"]) for r in rows] == [("full", 3, 3), ("random", 5, 4)]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    assert [r["kv_mb"] * MB for r in rows] == [3 * 112 * slot, 4 * 65 * slot]  # what the engine really allocated
    short = equal.measure(llama, ["random"], memory=3 * 112 * slot, context=100, new_tokens=12, budget=32, buffer=8,
                          block=16, max_batch=4, short_prompt=True)
    assert [(r["prompt"], r["seq_mb"]) for r in short] == [(100, 112 * slot / MB), (32 + 8 + 16, 65 * slot / MB)]


def test_equal_memory_writes_its_table_and_settings_with_out(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    equal = bench("equal_memory")
    out = tmp_path / "equal"
    argv = ["--model", str(tiny_dir), "--policies", "random,valuediff", "--memory-gb", "0.001", "--context", "100",
            "--budget", "32", "--buffer", "8", "--block", "16", "--new-tokens", "12", "--max-batch", "2",
            "--device", "cpu", "--out", str(out)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert equal.main(argv) == 0
    with open(out / "equal_memory.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["policy"], r["batch"]) for r in rows] == [("full", "2"), ("random", "2"), ("valuediff", "2")]
    assert float(rows[0]["ratio"]) == 1.0 and all(float(r["ratio"]) > 0 for r in rows)
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["memory_gb"] == 0.001 and config["identity"]["policies"] == "random,valuediff"
    assert f"written to {out}/equal_memory.csv" in capsys.readouterr().out
