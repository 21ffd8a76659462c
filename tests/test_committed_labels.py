"""The committed label kinds recompute from what their records store, by other code than the labeller's.

The joint labels' datamodel is refitted with statsmodels (OLS with HC3 errors) from the stored draws; the graded
token and cache labels' effects are the stored log-probabilities minus the reference's, and their outcomes agree with
the greedy reading of the same teacher-forced forward. Every committed `label-kinds/` folder is checked.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted((ROOT / "results").glob("*/label-kinds"))


def records(kind_dir: Path) -> list[dict]:
    with gzip.open(kind_dir / "labels.jsonl.gz", "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def kind_dirs(prefix: str) -> list[Path]:
    return [d for folder in FOLDERS for d in sorted(folder.iterdir()) if d.is_dir() and d.name.startswith(prefix)]


def test_there_are_committed_label_kinds_to_check():
    assert kind_dirs("token") and kind_dirs("cache") and kind_dirs("joint")


@pytest.mark.parametrize("kind_dir", kind_dirs("token") + kind_dirs("cache"), ids=lambda d: f"{d.parent.parent.name}"
                         f"/{d.name}")
def test_graded_window_effects_are_logp_minus_the_reference_and_agree_with_the_outcome(kind_dir):
    checked = 0
    for record in records(kind_dir):
        if record["status"] != "labelled":
            continue
        reference = record["graded"]["reference_logp"]
        assert record["graded"]["reference_greedy"]  # a labelled trace's reference is the model's own answer
        for window in record["windows"]:
            if window.get("logp") is None:
                continue
            assert window["effect"] == pytest.approx(window["logp"] - reference, abs=2e-6)
            if window["greedy"]:  # every reference token the argmax: greedy decoding reproduces the reference
                assert window["outcome"] == "same" and not window["flipped"]
            if window["flipped"]:
                assert window["outcome"] == "different" and not window["greedy"]
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("kind_dir", kind_dirs("joint"), ids=lambda d: f"{d.parent.parent.name}/{d.name}")
def test_joint_datamodels_refit_with_statsmodels_from_the_stored_draws(kind_dir):
    sm = pytest.importorskip("statsmodels.api")
    fitted = 0
    for record in records(kind_dir):
        if record["status"] != "labelled":
            continue
        joint, windows = record["joint"], record["windows"]
        units = len(windows)
        # z[m, u]: the share of draw m's keep sets (one per KV head, or one shared) holding unit u
        z = np.array([[np.mean([u in kept for kept in draw["kept"]]) for u in range(units)]
                      for draw in joint["records"]])
        y = np.array([draw["logp"] for draw in joint["records"]])
        assert len(y) == joint["draws"] and units == joint["units"]
        fit = sm.OLS(y, sm.add_constant(z, has_constant="add")).fit(cov_type="HC3")
        t = stats.t.ppf(0.975, len(y) - units - 1)
        coef, se = np.asarray(fit.params)[1:], np.asarray(fit.bse)[1:]
        assert [w["coef"] for w in windows] == pytest.approx(coef, abs=1e-4)
        assert [w["se"] for w in windows] == pytest.approx(se, abs=1e-4)
        assert [w["coef_lo"] for w in windows] == pytest.approx(coef - t * se, abs=2e-4)
        assert joint["intercept"] == pytest.approx(float(fit.params[0]), abs=1e-4)
        assert joint["r2"] == pytest.approx(fit.rsquared, abs=1e-5)
        assert joint["greedy_share"] == pytest.approx(np.mean([draw["greedy"] for draw in joint["records"]]))
        for window in windows:
            assert window["effect"] == -window["coef"] and window["flipped"] == (window["coef_lo"] > 0)
        fitted += 1
    assert fitted >= 10
