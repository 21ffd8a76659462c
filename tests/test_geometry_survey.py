"""`python -m geometry.survey`: tables, printed summary, resume, the run-directory contract (--out a file, a second
concurrent run, other settings) and one-line exit-2 errors that create no files."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from geometry.survey import main
from models.tiny import save_tiny_model

SMALL = ["--prompts", "3", "--ctx", "90", "--topk", "4", "--queries", "8"]


@pytest.fixture(autouse=True)
def _offline_data(data_dir, monkeypatch):
    monkeypatch.setenv("KVSCOPE_DATA_DIR", data_dir)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_dir(request, tmp_path_factory):
    """A tiny model saved as a HuggingFace directory, so the CLI loads it like any local model."""
    return save_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


def _records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_survey_writes_every_table_and_prints_the_model_row(tiny_dir, tmp_path, capsys):
    out = tmp_path / "survey"
    assert main(["--model", str(tiny_dir), *SMALL, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sink_rate" in printed and "sigma_ratio" in printed and "gqa_ratio" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["ctx"] == 90 and config["topk"] == 4 and config["key_space"] == "post_rope"
    assert len(config["calibration"]) == 3 and config["leading_token_is_bos"] is False
    n_layers, n_q, n_kv = 4, 4, 2
    expected_rows = {"heads_kv": n_layers * n_kv, "heads_q": n_layers * n_q, "layers": n_layers}
    for name, count in expected_rows.items():
        rows = json.loads((out / f"{name}.json").read_text())
        with (out / f"{name}.csv").open() as handle:
            assert len(list(csv.DictReader(handle))) == len(rows) == count
    model_rows = json.loads((out / "model.json").read_text())
    kinds = config["layer_types"]
    assert [row["scope"] for row in model_rows] == ["all"] + (list(dict.fromkeys(kinds)) if len(set(kinds)) > 1 else [])
    everything = model_rows[0]
    assert everything["gqa_ratio"] == 2.0 and everything["layers"] == 4
    # the printed/tabled sink rate is the fraction of (sequence, layer, head) alphas above tau in the raw records
    alphas = np.array([r["alpha_bos"] for r in _records(out)])
    assert everything["sink_rate"] == pytest.approx((alphas > 0.3).mean())
    sigma_k = np.array([r["sigma_k"] for r in _records(out)]).mean()
    sigma_v = np.array([r["sigma_v"] for r in _records(out)]).mean()
    assert everything["sigma_ratio"] == pytest.approx(sigma_v / sigma_k)


def test_rerun_resumes_reaggregates_and_refuses_changed_settings(tiny_dir, tmp_path, capsys):
    out = tmp_path / "survey"
    args = ["--model", str(tiny_dir), *SMALL, "--out", str(out)]
    assert main(args) == 0
    first = _records(out)
    assert main(args) == 0
    assert _records(out) == first  # nothing measured twice
    assert main([*args, "--tau", "0.01"]) == 0  # tau only enters the aggregation
    assert _records(out) == first
    alphas = np.array([r["alpha_bos"] for r in first])
    assert json.loads((out / "model.json").read_text())[0]["sink_rate"] == pytest.approx((alphas > 0.01).mean())
    assert main([*args, "--prompts", "4"]) == 0
    assert [r["prompt"] for r in _records(out)] == [r["prompt"] for r in first] + ["math-0"]
    capsys.readouterr()
    assert main([*args, "--topk", "5"]) == 2
    err = capsys.readouterr().err
    assert "topk 4 (now 5)" in err and "another --out" in err and err.count("\n") == 1
    assert _records(out)[:3] == first


def test_out_that_is_a_file_or_below_one_exits_2_and_writes_nothing(tiny_dir, tmp_path, capsys):
    file = tmp_path / "taken"
    file.write_text("keep me\n")
    for out, message in ((file, "is a file, not a directory"), (file / "below", "cannot create it")):
        assert main(["--model", str(tiny_dir), *SMALL, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and file.read_text() == "keep me\n"


def test_a_second_concurrent_run_on_the_same_out_exits_2_at_once(tiny_dir, tmp_path, capsys, monkeypatch):
    import geometry.survey

    argv = ["--model", str(tiny_dir), *SMALL, "--out", str(tmp_path / "survey")]
    real_load = geometry.survey.load_model
    second = []

    def load_while_a_second_run_starts(*args, **kwargs):
        second.append(main(argv))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(geometry.survey, "load_model", load_while_a_second_run_starts)
    assert main(argv) == 0
    assert second == [2]
    assert "is in use by another run (pid" in capsys.readouterr().err
    assert len(_records(tmp_path / "survey")) == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "smollm-135m"], "unknown model 'smollm-135m'"),
        (["--prompts", "0"], "--prompts"),
        (["--ctx", "200"], "--ctx must be at least 290"),
        (["--ctx", "40", "--topk", "8"], "--ctx must be at least 42"),
        (["--tau", "1.5"], "--tau must be in (0, 1)"),
        (["--queries", "1"], "--queries must be at least 2"),
        (["--key-space", "both"], "invalid choice: 'both'"),
        (["--device", "bogus"], "'bogus' is not a device"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_files(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_smollm2_survey_end_to_end(smollm2, tmp_path, capsys):
    out = tmp_path / "smollm2"
    argv = ["--model", "smollm2-135m", "--prompts", "1", "--ctx", "64", "--topk", "8", "--queries", "6"]
    assert main([*argv, "--out", str(out)]) == 0
    row = json.loads((out / "model.json").read_text())[0]
    assert row["q_heads"] == 9 and row["kv_heads"] == 3 and row["layers"] == 30
    assert 0 <= row["sink_rate"] <= 1 and row["sigma_k"] > 0 and 0 < row["jaccard"] <= 1
    assert "smollm2-135m" in capsys.readouterr().out
