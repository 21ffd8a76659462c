"""KV-cache throughput projection (EpiKV App. 14): the arithmetic by hand, the figure, the CLI."""

from __future__ import annotations

import pandas as pd
import pytest

from core.errors import UsageError
from figures.projection import (
    EPIKV_SETTING,
    concurrent_requests,
    kv_bytes_per_token,
    main,
    plot_projection,
    projection_table,
)

LLAMA_8B = {"n_layers": 32, "n_kv_heads": 8, "d_head": 128, "bytes_per_elem": 2}


def test_llama_8b_holds_128_kib_per_token():
    # 2 (K, V) x 32 layers x 8 heads x 128 dims x 2 bytes = 131072 bytes
    assert kv_bytes_per_token(**LLAMA_8B) == 128 * 1024


def test_epikv_claim_224_vs_14_on_an_80_gb_gpu():
    # 80 - 16 (weights) - 8 (10% reserve) = 56 GiB free.
    # Budget 2048: 2048 x 128 KiB = 256 MiB per request -> 56 GiB / 0.25 GiB = 224.
    # No eviction at 32768: 32768 x 128 KiB = 4 GiB per request -> floor(56 / 4) = 14.
    setting = dict(gpu_mem_gb=80, weight_gb=16, overhead_gb=8, **LLAMA_8B)
    assert concurrent_requests(ctx=32768, budget=2048, **setting) == 224
    assert concurrent_requests(ctx=32768, **setting) == 14
    assert concurrent_requests(ctx=32768, budget=2048, **EPIKV_SETTING) == 224


def test_without_reserve_the_same_gpu_holds_256_and_16():
    setting = dict(gpu_mem_gb=80, weight_gb=16, **LLAMA_8B)
    assert concurrent_requests(ctx=32768, budget=2048, **setting) == 256  # 64 GiB / 0.25 GiB
    assert concurrent_requests(ctx=32768, **setting) == 16  # 64 GiB / 4 GiB


def test_budget_at_or_above_context_changes_nothing_and_floor_rounds_down():
    setting = dict(gpu_mem_gb=80, weight_gb=16, **LLAMA_8B)
    assert concurrent_requests(ctx=1024, budget=2048, **setting) == concurrent_requests(ctx=1024, **setting) == 512
    # 64 GiB = 67108864 KiB over 3000 tokens x 128 KiB = 384000 KiB: 174.76 -> 174
    assert concurrent_requests(ctx=3000, **setting) == 174


def test_nothing_fits_is_zero_and_bad_values_are_usage_errors():
    assert concurrent_requests(gpu_mem_gb=16, weight_gb=16, ctx=1024, **LLAMA_8B) == 0
    assert concurrent_requests(gpu_mem_gb=8, weight_gb=16, ctx=1024, **LLAMA_8B) == 0
    with pytest.raises(UsageError, match="ctx must be positive"):
        concurrent_requests(gpu_mem_gb=80, weight_gb=16, ctx=0, **LLAMA_8B)
    with pytest.raises(UsageError, match="budget must be positive"):
        concurrent_requests(gpu_mem_gb=80, weight_gb=16, ctx=10, budget=0, **LLAMA_8B)
    with pytest.raises(UsageError, match="overhead_gb must be >= 0"):
        concurrent_requests(gpu_mem_gb=80, weight_gb=16, ctx=10, overhead_gb=-1, **LLAMA_8B)


def test_projection_table_and_plot():
    table = projection_table([1024, 2048, 4096], [None, 2048], **EPIKV_SETTING)
    assert table["requests"].tolist() == [448, 224, 112, 448, 224, 224]
    fig = plot_projection(table, annotate_ctx=4096, setting_note="80 GB GPU")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert sorted(t.get_text() for t in ax.texts) == ["112", "224"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["no eviction", "budget 2048"]
    assert ax.get_legend().get_title().get_text() == "KV cache\n80 GB GPU"


def test_budgets_sort_numerically_and_empty_series_is_a_usage_error():
    table = projection_table([1024, 4096], [None, 4096, 512], **EPIKV_SETTING)
    legend = [t.get_text() for t in plot_projection(table).axes[0].get_legend().get_texts()]
    assert legend == ["no eviction", "budget 512", "budget 4096"]
    starved = projection_table([1024], [None], gpu_mem_gb=8, weight_gb=16, **LLAMA_8B)
    with pytest.raises(UsageError, match="no request fits"):
        plot_projection(starved)


def test_cli_writes_figure_table_and_prints_the_claim(tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["--out", str(out), "--ctx-min", "1024", "--ctx-max", "65536"]) == 0
    assert {p.name for p in out.iterdir()} == {"projection.png", "projection.pdf", "projection.csv"}
    table = pd.read_csv(out / "projection.csv")
    assert table[(table["ctx"] == 32768) & table["budget"].isna()]["requests"].item() == 14
    assert table[(table["ctx"] == 32768) & (table["budget"] == 2048)]["requests"].item() == 224
    printed = capsys.readouterr().out
    assert "no eviction: 14 concurrent requests" in printed and "budget 2048: 224 concurrent requests" in printed


def test_cli_bad_range_exits_2_without_files(tmp_path):
    out = tmp_path / "figs"
    assert main(["--out", str(out), "--ctx-min", "5000", "--ctx-max", "1000"]) == 2
    assert main(["--out", str(out), "--ctx-min", "1025", "--ctx-max", "2047"]) == 2
    assert not out.exists()


def test_cli_out_a_file_or_under_one_exits_2(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["--out", str(blocker)]) == 2
    assert main(["--out", str(blocker / "figs")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(": error: --out" in line for line in errors), errors
    assert blocker.read_text() == "x"
