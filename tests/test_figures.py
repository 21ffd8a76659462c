"""Every figure on small synthetic tables: structure, readability rules, CLI outputs, and bad input."""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.colorbar import Colorbar
from matplotlib.text import Text

from core.errors import UsageError
from core.schemas import Cell, ProbeRow
from figures.accuracy_budget import plot_accuracy_vs_budget
from figures.bos_ratio import plot_bos_vs_ratio
from figures.cost_budget import plot_cost_vs_budget
from figures.head_sets import plot_head_set_retrieval
from figures.layer_geometry import plot_layer_geometry
from figures.layer_rho import from_validation_table, plot_layer_rho, significant_runs
from figures.prefill_memory import plot_prefill_memory
from figures.raw_vs_z import plot_raw_vs_z
from figures.reference import VALUEDIFF_TABLE4_LABEL, valuediff_reference
from figures.save import save_figure
from figures.sink_ratio import plot_sink_vs_ratio
from figures.style import SMALL_FONT_PT
from figures.tables import read_table

# ---------------------------------------------------------------- synthetic inputs, one per figure

def layer_table() -> pd.DataFrame:
    """Two signals over 12 layers; "a" is significantly positive on layers 3-5 and negative on 8-9."""
    rows = []
    for signal, scale in (("a", 1.0), ("b", 0.5)):
        for layer in range(12):
            rho = scale * (0.3 if 3 <= layer <= 5 else -0.25 if 8 <= layer <= 9 else 0.01)
            rows.append({"layer": layer, "signal": signal, "rho": rho, "rho_lo": rho - 0.1, "rho_hi": rho + 0.1,
                         "p_adj": 0.001 if abs(rho) > 0.1 else 0.5})
    return pd.DataFrame(rows)


def raw_z_table() -> pd.DataFrame:
    df = layer_table()
    return df.assign(signal=df["signal"].map({"a": "z", "b": "raw"}))


def model_table() -> pd.DataFrame:
    return pd.DataFrame({"model": ["SmolLM2-135M", "Gemma3-270M"], "sink_rate": [0.6, 0.3], "sigma_k": [2.0, 8.0],
                         "sigma_v": [1.0, 6.0], "sigma_ratio": [0.5, 0.75]})


def bos_table() -> pd.DataFrame:
    return pd.DataFrame({"model": ["SmolLM2-135M", "Gemma3-270M"], "bos_cos": [-0.5, -0.1], "sigma_ratio": [0.5, 0.75],
                         "gap": [-2.0, 4.0]})


def geometry_table() -> pd.DataFrame:
    kinds = ["sliding", "sliding", "full", "sliding", "sliding", "full"]
    return pd.DataFrame({"layer": range(6), "sigma_k": [3, 4, 5, 4, 3, 5], "sigma_v": [2, 2, 3, 2, 2, 4],
                         "sink_rate": [0.1, 0.5, 0.9, 0.4, 0.2, 0.8], "layer_type": kinds})


def accuracy_table() -> pd.DataFrame:
    rows = [{"policy": "full", "budget": None, "accuracy": 0.75, "ci_lo": 0.65, "ci_hi": 0.84}]
    for policy, shift in (("epikv", 0.0), ("h2o", -0.2)):
        for i, budget in enumerate((512, 1024, 2048)):
            acc = 0.4 + 0.1 * i + shift
            rows.append({"policy": policy, "budget": budget, "accuracy": acc, "ci_lo": acc - 0.08,
                         "ci_hi": acc + 0.08})
    return pd.DataFrame(rows)


def cost_table() -> pd.DataFrame:
    rows = [{"policy": "full", "budget": None, "wall_s": 100.0, "peak_mem_mb": 900.0}]
    for policy, base in (("epikv", 40.0), ("h2o", 60.0)):
        for budget in (512, 1024):
            for problem, extra in enumerate((0.0, 10.0, 20.0)):  # three problems: median = base + 10
                rows.append({"policy": policy, "budget": budget, "wall_s": base + extra + budget / 1024,
                             "peak_mem_mb": 500.0 + budget / 4 + problem})
    return pd.DataFrame(rows)


def prefill_table() -> pd.DataFrame:
    rows = []
    for ctx in (256, 512, 1024, 2048):
        rows.append({"kernel": "sdpa", "ctx": ctx, "peak_mem_mb": 300 + ctx / 10, "oom": False})
        eager = 300 + ctx**2 / 1000
        rows.append({"kernel": "eager+attentions", "ctx": ctx, "peak_mem_mb": None if ctx == 2048 else eager,
                     "oom": ctx == 2048})
    return pd.DataFrame(rows)


def head_set_table() -> pd.DataFrame:
    return pd.DataFrame({"condition": ["0,1,2", "1", "1,2", "0"], "n_heads": [3, 1, 2, 1],
                         "retrieval": [0.9, 0.05, 0.4, 0.02], "retrieval_lo": [0.8, 0.0, 0.3, 0.0],
                         "retrieval_hi": [0.97, 0.12, 0.5, 0.08], "R": [0.95, 0.2, 0.6, 0.1]})


# (module name, plot function, table factory, number of axes); each table's second column is one its figure needs
FIGURES = [
    ("layer_rho", plot_layer_rho, layer_table, 1),
    ("raw_vs_z", plot_raw_vs_z, raw_z_table, 1),
    ("sink_ratio", plot_sink_vs_ratio, model_table, 1),
    ("bos_ratio", plot_bos_vs_ratio, bos_table, 2),
    ("layer_geometry", plot_layer_geometry, geometry_table, 2),
    ("accuracy_budget", plot_accuracy_vs_budget, accuracy_table, 1),
    ("cost_budget", plot_cost_vs_budget, cost_table, 2),
    ("prefill_memory", plot_prefill_memory, prefill_table, 1),
    ("head_sets", plot_head_set_retrieval, head_set_table, 1),
]
IDS = [f[0] for f in FIGURES]


def _legend_texts(fig) -> list[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def _plot_axes(fig):
    """The data axes (a colour bar's axes has no axis labels of its own to check)."""
    colourbar_axes = [c.colorbar.ax for ax in fig.axes for c in ax.collections if getattr(c, "colorbar", None)]
    return [ax for ax in fig.axes if all(ax is not cb for cb in colourbar_axes)]


# ---------------------------------------------------------------- structure and readability, every figure

@pytest.mark.parametrize("name, plot, table, n_axes", FIGURES, ids=IDS)
def test_figure_structure(name, plot, table, n_axes):
    rc_before = dict(matplotlib.rcParams)
    fig = plot(table())
    assert dict(matplotlib.rcParams) == rc_before, f"{name}: changed global matplotlib state"
    assert plt.get_fignums() == [], f"{name}: left a figure in pyplot's registry"
    assert len(fig.axes) == n_axes
    for ax in fig.axes:
        drawn = len(ax.lines) + len(ax.collections) + len(ax.patches) + len(ax.images)
        assert drawn > 0, f"{name}: an empty panel"
    data_axes = _plot_axes(fig)
    assert all(ax.get_ylabel() for ax in data_axes), f"{name}: a panel without y label"
    assert any(ax.get_xlabel() for ax in data_axes), f"{name}: no x label"
    assert len(_legend_texts(fig)) >= 2, f"{name}: several series but no legend"


@pytest.mark.parametrize("name, plot, table, n_axes", FIGURES, ids=IDS)
def test_figure_fonts_are_print_sized(name, plot, table, n_axes):
    fig = plot(table())
    texts = [t for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]
    assert texts
    small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < SMALL_FONT_PT]
    assert not small, f"{name}: text below {SMALL_FONT_PT} pt: {small[:3]}"


@pytest.mark.parametrize("name, plot, table, n_axes", FIGURES, ids=IDS)
def test_missing_column_and_empty_table_are_usage_errors(name, plot, table, n_axes):
    df = table()
    with pytest.raises(UsageError, match="lacks column"):
        plot(df.drop(columns=[df.columns[1]]))
    with pytest.raises(UsageError, match="no rows"):
        plot(df.iloc[:0])


@pytest.mark.parametrize("name, plot, table, n_axes", FIGURES, ids=IDS)
def test_cli_writes_png_and_pdf(name, plot, table, n_axes, tmp_path):
    module = importlib.import_module(f"figures.{name}")
    source = tmp_path / "table.csv"
    table().to_csv(source, index=False)
    out = tmp_path / "figs"
    assert module.main(["--input", str(source), "--out", str(out)]) == 0
    png, pdf = out / f"{name}.png", out / f"{name}.pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pdf.read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in out.iterdir()) == sorted([png.name, pdf.name])  # no temporary files left


@pytest.mark.parametrize("name, plot, table, n_axes", FIGURES, ids=IDS)
def test_cli_bad_input_exits_2_without_files(name, plot, table, n_axes, tmp_path, capsys):
    module = importlib.import_module(f"figures.{name}")
    out = tmp_path / "figs"
    missing = table().drop(columns=[table().columns[1]])
    empty = table().iloc[:0]
    for i, bad in enumerate((missing, empty)):
        source = tmp_path / f"bad{i}.csv"
        bad.to_csv(source, index=False)
        assert module.main(["--input", str(source), "--out", str(out)]) == 2
    assert module.main(["--input", str(tmp_path / "nope.csv"), "--out", str(out)]) == 2
    assert not out.exists()
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all("error:" in line for line in errors)


@pytest.mark.parametrize("problem", ["out is a file", "out under a file", "unknown flag"])
def test_cli_bad_out_and_flags_exit_2_with_one_line(problem, tmp_path, capsys):
    from figures.layer_rho import main

    source = tmp_path / "table.csv"
    layer_table().to_csv(source, index=False)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    argv = {"out is a file": ["--out", str(blocker)],
            "out under a file": ["--out", str(blocker / "figs")],
            "unknown flag": ["--out", str(tmp_path / "figs"), "--colour", "red"]}[problem]
    assert main(["--input", str(source), *argv]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and ": error: " in errors[0], errors
    assert blocker.read_text() == "x" and not (tmp_path / "figs").exists()


def test_figures_import_no_model_code():
    """figures draws tables: importing every figure module loads neither torch nor any model-side package."""
    code = ("import importlib, pkgutil, sys, figures\n"
            "for m in pkgutil.iter_modules(figures.__path__): importlib.import_module('figures.' + m.name)\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
                 .stdout.split())
    assert not loaded & {"torch", "transformers", "models", "tasks", "probes", "geometry", "labeling", "evictor"}


# ---------------------------------------------------------------- the tables the stages write draw as written

def test_layer_rho_and_raw_vs_z_draw_the_table_validation_layers_writes(tmp_path):
    from figures.layer_rho import main as layer_rho_main
    from figures.raw_vs_z import main as raw_vs_z_main
    from validation.correlation import signal_table
    from validation.report import write_csv
    from validation.signals import Aligned, AlignedTrace

    rng = np.random.default_rng(0)
    names = [f"g.l{layer}.{transform}" for transform in ("mean8", "z8") for layer in range(3)]
    traces = []
    for i in range(6):
        labels = rng.integers(0, 2, 30).astype(float)
        labels[:2] = [0, 1]
        traces.append(AlignedTrace(f"t{i}", np.arange(30), labels, labels[:, None] + rng.normal(size=(30, 6))))
    table = tmp_path / "layers.csv"
    write_csv(table, signal_table(Aligned(names, traces), n_boot=50))
    converted = from_validation_table(read_table(table))
    assert sorted(set(converted["signal"])) == ["g.mean8", "g.z8"] and len(converted) == 6
    assert layer_rho_main(["--input", str(table), "--out", str(tmp_path / "a"), "--band-signal", "g.z8"]) == 0
    assert raw_vs_z_main(["--input", str(table), "--out", str(tmp_path / "b"), "--raw", "g.mean8", "--z", "g.z8"]) == 0


def test_accuracy_budget_draws_evictor_cells(tmp_path):
    from figures.accuracy_budget import main

    cells = [Cell(id="full", policy="full", budget=None, problems=4, correct=3, accuracy=0.75, ci_lo=0.3, ci_hi=0.95)]
    cells += [Cell(id=f"random-K{k}", policy="random", budget=k, problems=4, correct=c, accuracy=c / 4,
                   ci_lo=0.0, ci_hi=0.9) for k, c in ((2, 1), (4, 2))]
    source = tmp_path / "summary.csv"
    pd.DataFrame([cell.to_json() for cell in cells]).to_csv(source, index=False)
    assert main(["--input", str(source), "--out", str(tmp_path / "figs")]) == 0
    for largest in (0.5, 1.0):  # the whole reference length is a fraction too
        fractions = pd.DataFrame([c.to_json() for c in cells]).assign(budget=[None, 0.25, largest])
        xlabel = plot_accuracy_vs_budget(fractions).axes[0].get_xlabel()
        assert xlabel == "KV cache budget (fraction of the reference length)"


def test_head_sets_draw_probe_rows_and_leave_out_the_dense_run():
    def row(condition, n_heads, retrieval):
        return ProbeRow(id=condition, probe="planted_fact", condition=condition, n=8, retrieval=retrieval,
                        retrieval_lo=max(0.0, retrieval - 0.2), retrieval_hi=min(1.0, retrieval + 0.2),
                        extra={"heads": condition, "n_heads": n_heads}).to_json()

    rows = [row("full", None, 1.0), row("kept", 3, 0.9), row("deleted", 0, 0.0), row("2", 1, 0.1)]
    fig = plot_head_set_retrieval(rows)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["deleted", "2", "kept"]


def test_sink_and_bos_figures_draw_a_survey_model_table():
    from geometry.summary import MODEL_COLUMNS

    def survey_row(model, scope, sink_rate, sigma_k, sigma_v):
        row = dict.fromkeys(MODEL_COLUMNS, 1.0)
        row.update(model=model, scope=scope, sink_rate=sink_rate, sigma_k=sigma_k, sigma_v=sigma_v,
                   sigma_ratio=sigma_v / sigma_k, bos_cos=-0.3)
        return row

    table = pd.DataFrame([survey_row("smollm2-135m", "all", 0.6, 2.0, 1.0),
                          survey_row("gemma3-270m", "all", 0.3, 8.0, 6.0),
                          survey_row("gemma3-270m", "sliding_attention", 0.2, 8.0, 4.0),
                          survey_row("gemma3-270m", "full_attention", 0.5, 8.0, 8.0)])
    ours = [c.get_offsets() for c in plot_sink_vs_ratio(table, reference=False).axes[0].collections]
    np.testing.assert_allclose(ours[0], [[0.5, 0.6], [0.75, 0.3]])
    plot_bos_vs_ratio(table.assign(gap=[1.0, -1.0, 0.0, 0.0]))
    with pytest.raises(UsageError, match="scope 'all'"):
        plot_sink_vs_ratio(table[table["scope"] != "all"])


# ---------------------------------------------------------------- figure-specific behaviour

def test_significant_runs_by_hand():
    layers = [0, 1, 2, 3, 4, 6, 7]
    low = [0.1, 0.2, -0.1, -0.5, np.nan, 0.1, 0.2]
    high = [0.3, 0.4, 0.1, -0.1, np.nan, 0.3, 0.4]
    # 0-1 positive; 2 spans zero; 3 negative; 4 undefined; 6-7 positive (5 missing: not adjacent to 4)
    assert significant_runs(layers, low, high) == [(1, 0, 1), (-1, 3, 3), (1, 6, 7)]
    assert significant_runs([5, 3, 4], [0.1, 0.1, 0.1], [0.2, 0.2, 0.2]) == [(1, 3, 5)]


def test_layer_rho_shades_the_band_signal_runs():
    fig = plot_layer_rho(layer_table())
    ax = fig.axes[0]
    spans = sorted((round(p.get_x(), 2), round(p.get_x() + p.get_width(), 2)) for p in ax.patches)
    assert spans == [(2.5, 5.5), (7.5, 9.5)]
    labels = [t.get_text() for t in ax.texts]
    assert "+ L3–5" in labels and "− L8–9" in labels
    # hollow markers where p_adj >= alpha: each signal has 12 - 3 - 2 = 7 layers with |rho| <= 0.1
    hollow = [line for line in ax.lines if line.get_markerfacecolor() == "white" and len(line.get_xdata())]
    assert sum(len(line.get_xdata()) for line in hollow) == 7 + 7


def test_layer_rho_rejects_unknown_band_signal_and_duplicates():
    with pytest.raises(UsageError, match="unknown band signal 'c'"):
        plot_layer_rho(layer_table(), band_signal="c")
    with pytest.raises(UsageError, match="several rows"):
        plot_layer_rho(pd.concat([layer_table(), layer_table().iloc[:1]]))
    bad = layer_table()
    bad.loc[0, "rho_hi"] = bad.loc[0, "rho"] - 0.01
    with pytest.raises(UsageError, match="does not contain"):
        plot_layer_rho(bad)


def test_from_validation_table_maps_columns():
    rows = pd.DataFrame([
        {"signal": "hidden_diff.l3.mean64", "family": "hidden_diff", "layer": 3, "transform": "mean64",
         "within_rho": 0.2, "within_lo": 0.1, "within_hi": 0.3, "within_p_adj": 0.01, "pooled_rho": 0.5,
         "pooled_lo": 0.4, "pooled_hi": 0.6},
        {"signal": "h2o", "family": "h2o", "layer": None, "transform": "raw", "within_rho": 0.05,
         "within_lo": 0.0, "within_hi": 0.1, "within_p_adj": 0.2, "pooled_rho": 0.1, "pooled_lo": 0.0,
         "pooled_hi": 0.2},
    ])
    out = from_validation_table(rows, "within")
    assert out.to_dict("records") == [{"layer": 3, "signal": "hidden_diff.mean64", "rho": 0.2, "rho_lo": 0.1,
                                       "rho_hi": 0.3, "p_adj": 0.01}]
    assert from_validation_table(rows, "pooled")["rho"].tolist() == [0.5]
    with pytest.raises(UsageError, match="unknown statistic"):
        from_validation_table(rows, "median")


def test_layer_rho_cli_reads_a_validation_table(tmp_path):
    from figures.layer_rho import main
    rows = [{"signal": f"g.l{layer}.z64", "family": "g", "layer": layer, "transform": "z64",
             "within_rho": 0.2, "within_lo": 0.1, "within_hi": 0.3} for layer in range(4)]
    source = tmp_path / "layers.csv"
    pd.DataFrame(rows).to_csv(source, index=False)
    assert main(["--input", str(source), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "layer_rho.png").exists()


def test_raw_vs_z_bar_heights_are_the_rhos():
    df = raw_z_table()
    fig = plot_raw_vs_z(df)
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches)
    assert heights == sorted(round(v, 6) for v in df["rho"])
    with pytest.raises(UsageError, match="unknown signal 'zz'"):
        plot_raw_vs_z(df, z="zz")


def test_sink_ratio_reference_points_and_computed_ratio():
    df = model_table().drop(columns=["sigma_ratio"])
    fig = plot_sink_vs_ratio(df)
    ax = fig.axes[0]
    offsets = [c.get_offsets() for c in ax.collections]
    assert sorted(len(o) for o in offsets) == [2, 11]
    ours = next(o for o in offsets if len(o) == 2)
    np.testing.assert_allclose(ours[:, 0], [0.5, 0.75])  # sigma_v / sigma_k
    assert VALUEDIFF_TABLE4_LABEL in _legend_texts(fig)
    texts = {t.get_text() for t in ax.texts}
    assert {"SmolLM2-135M", "Llama 3.1-8B", "GPT-OSS-20B"} <= texts
    assert any(line.get_xdata()[0] == 1.0 for line in ax.lines)  # the sigma_V = sigma_K line
    no_ref = plot_sink_vs_ratio(df, reference=False)
    assert [len(c.get_offsets()) for c in no_ref.axes[0].collections] == [2]
    with pytest.raises(UsageError, match="must lie in"):
        plot_sink_vs_ratio(df.assign(sink_rate=[0.5, 1.5]))


def test_reference_values_are_consistent():
    ref = valuediff_reference()
    assert len(ref) == 11
    np.testing.assert_allclose(ref["sigma_v"] / ref["sigma_k"], ref["sigma_ratio"], atol=0.006)


def test_bos_ratio_colour_scale_is_centred_on_zero():
    fig = plot_bos_vs_ratio(bos_table())
    ax = fig.axes[0]
    coloured = next(c for c in ax.collections if c.get_array() is not None)
    assert coloured.norm.vcenter == 0.0 and coloured.norm.vmin == -4.0 and coloured.norm.vmax == 4.0
    assert isinstance(coloured.colorbar, Colorbar)
    assert coloured.colorbar.ax.get_ylabel().startswith("ValueDiff − KeyDiff")
    with pytest.raises(UsageError, match="must lie in"):
        plot_bos_vs_ratio(bos_table().assign(bos_cos=[-1.5, 0.0]))


def test_layer_geometry_marks_full_layers_only_when_mixed():
    fig = plot_layer_geometry(geometry_table())
    assert [len(ax.patches) for ax in fig.axes] == [2, 2]
    uniform = plot_layer_geometry(geometry_table().drop(columns=["layer_type"]))
    assert [len(ax.patches) for ax in uniform.axes] == [0, 0]
    hf_names = geometry_table().assign(layer_type=lambda d: d["layer_type"] + "_attention")
    assert [len(ax.patches) for ax in plot_layer_geometry(hf_names).axes] == [2, 2]
    with pytest.raises(UsageError, match="unknown layer_type 'local'"):
        plot_layer_geometry(geometry_table().assign(layer_type="local"))


def test_accuracy_dense_line_and_validation():
    fig = plot_accuracy_vs_budget(accuracy_table())
    ax = fig.axes[0]
    horizontal = [line for line in ax.lines if line.get_linestyle() == "--" and len(set(line.get_ydata())) == 1]
    assert horizontal and horizontal[0].get_ydata()[0] == pytest.approx(75.0)
    df = accuracy_table()
    with pytest.raises(UsageError, match="different accuracies"):
        plot_accuracy_vs_budget(pd.concat([df, df.iloc[:1].assign(accuracy=0.7, ci_lo=0.6, ci_hi=0.8)]))
    with pytest.raises(UsageError, match="must lie in"):
        plot_accuracy_vs_budget(df.assign(accuracy=df["accuracy"] * 100, ci_lo=0, ci_hi=100))
    with pytest.raises(UsageError, match="no eviction policy"):
        plot_accuracy_vs_budget(df.iloc[:1])
    with pytest.raises(UsageError, match="budget"):
        plot_accuracy_vs_budget(df.assign(budget=df["budget"].where(df["policy"] != "h2o", -1)))


def test_cost_budget_draws_medians():
    fig = plot_cost_vs_budget(cost_table())
    left = fig.axes[0]
    series = [c for c in left.containers if c.get_label() == "epikv"]
    assert len(series) == 1
    np.testing.assert_allclose(series[0].lines[0].get_ydata(), [40 + 10 + 0.5, 40 + 10 + 1.0])
    with pytest.raises(UsageError, match="unknown time column"):
        plot_cost_vs_budget(cost_table(), time="seconds")
    throughput = cost_table().rename(columns={"wall_s": "tokens_per_s"})
    assert plot_cost_vs_budget(throughput).axes[0].get_ylabel().startswith("Decode throughput")


def test_prefill_memory_marks_oom_and_reads_csv_booleans(tmp_path):
    source = tmp_path / "mem.csv"
    prefill_table().to_csv(source, index=False)
    fig = plot_prefill_memory(read_table(source), capacity_mb=2048)
    ax = fig.axes[0]
    assert "OOM" in [t.get_text() for t in ax.texts]
    crosses = [line for line in ax.lines if line.get_marker() == "X"]
    assert len(crosses) == 1 and crosses[0].get_xdata().tolist() == [2048]
    assert "out of memory" in _legend_texts(fig)
    bad = prefill_table()
    bad.loc[bad["oom"], "oom"] = False
    with pytest.raises(UsageError, match="not marked oom"):
        plot_prefill_memory(bad)


def test_head_sets_orders_bars_by_set_size():
    fig = plot_head_set_retrieval(head_set_table())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "0", "1,2", "0,1,2"]
    assert [round(p.get_height(), 2) for p in ax.patches] == [0.05, 0.02, 0.4, 0.9]
    assert "graded recall R" in _legend_texts(fig)
    with pytest.raises(UsageError, match="n_heads"):
        plot_head_set_retrieval(head_set_table().assign(n_heads=[3, 1.5, 2, 1]))


def test_plot_functions_take_dicts_and_records():
    records = head_set_table().to_dict("records")
    columns = head_set_table().to_dict("list")
    for data in (records, columns):
        assert len(plot_head_set_retrieval(data).axes) == 1
    with pytest.raises(UsageError, match="must be a pandas DataFrame"):
        plot_head_set_retrieval("head_sets.csv")


# ---------------------------------------------------------------- saving and reading

def test_save_figure_is_reproducible_and_rejects_bad_stems(tmp_path):
    paths = [save_figure(plot_head_set_retrieval(head_set_table()), tmp_path / d, "f") for d in ("a", "b")]
    digests = [[hashlib.sha256(p.read_bytes()).hexdigest() for p in group] for group in paths]
    assert digests[0] == digests[1]
    assert [p.suffix for p in paths[0]] == [".png", ".pdf"]
    assert all(p.stat().st_mode & 0o044 for p in paths[0])  # readable by others, unlike a bare temp file
    with pytest.raises(UsageError, match="plain file name"):
        save_figure(plot_head_set_retrieval(head_set_table()), tmp_path, "../f")


def test_read_table_formats(tmp_path):
    df = model_table()
    (tmp_path / "t.json").write_text(json.dumps(df.to_dict("records")))
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in df.to_dict("records")))
    df.to_csv(tmp_path / "t.tsv", sep="\t", index=False)
    for suffix in ("json", "jsonl", "tsv"):
        assert read_table(tmp_path / f"t.{suffix}")["model"].tolist() == df["model"].tolist()
    (tmp_path / "t.xlsx").write_text("x")
    with pytest.raises(UsageError, match="unknown type"):
        read_table(tmp_path / "t.xlsx")
    with pytest.raises(UsageError, match="does not exist"):
        read_table(tmp_path / "missing.csv")


def test_non_numeric_value_is_a_usage_error():
    df = head_set_table().astype({"retrieval": object})
    df.loc[0, "retrieval"] = "high"
    with pytest.raises(UsageError, match="'retrieval' must be numeric, got 'high'"):
        plot_head_set_retrieval(df)
