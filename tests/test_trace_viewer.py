"""The trace viewer's data (`figures.trace`): what each layer holds, read from a hand-made study directory whose
answers are derived here by hand, and the command line.

`make_study` writes a study directory as `python -m study` lays it out (stage directories with their ``stage.json``,
the records of each stage, an evictor sweep with keep-logs) for the tiny model's tokenizer;
`tests/test_trace_browser.py` opens its page in a real browser.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.errors import UsageError
from figures.trace import LABEL_KINDS, LabelKind, TokenField, main, study_viewer, trace_viewer, write_study_viewer
from figures.viewer.layers import KNOWN_CLASSES, known_layer, label_layers
from figures.viewer.study import study_stages
from figures.viewer.views import diverges_at, kept

MODEL = "tiny-llama"
N_LAYERS, N_HEADS = 4, 2  # the tiny Llama's cache


def _jsonl(path: Path, rows: list[dict], packed: bool = False) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if packed:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return str(path)


def _stage(root: Path, name: str, key: str, inputs: dict[str, str], outputs: dict) -> Path:
    directory = root / "stages" / f"{name}-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stage.json").write_text(json.dumps({"name": name, "key": key, "inputs": inputs,
                                                      "outputs": outputs, "path": f"stages/{name}-{key}"}))
    return directory


def _keep_log(rng: np.random.Generator, n_tokens: int, reasoning: tuple[int, int], rounds: int = 3) -> dict:
    """A keep-log (`evictor.instrument.KeepLog.for_sequence`) evicting six reasoning positions per layer and round
    from head 0, and the first three of them from every other head."""
    entries = {"round": [], "layer": [], "head": [], "position": []}
    for round_index in range(rounds):
        for layer in range(N_LAYERS):
            chosen = rng.choice(np.arange(*reasoning), size=6, replace=False)
            for head in range(N_HEADS):
                for position in chosen if head == 0 else chosen[:3]:
                    for name, value in zip(entries, (round_index, layer, head, position)):
                        entries[name].append(value)
    step = (n_tokens - reasoning[0]) // rounds
    return {**{name: np.asarray(values, dtype=np.int32) for name, values in entries.items()},
            "round_step": np.arange(rounds, dtype=np.int32) * step,
            "round_next_pos": np.asarray([reasoning[0] + (r + 1) * step for r in range(rounds)], dtype=np.int32)}


def make_study(root: Path, *, n_prompt: int = 12, n_generated: int = 88, scorers: int = 3, layers: int = N_LAYERS,
               traces: int = 2, packed: bool = False, seed: int = 0) -> Path:
    """A study directory with `traces` known-answer traces of ``n_prompt + n_generated`` tokens, occlusion labels
    (windows of 8, stride 4, flipped where they overlap the needed value, an `effect` per window), a replay of
    `scorers` scorers at `layers` layers and two raw signals, and an evictor sweep (full, random with keep-logs,
    recency without) at budget 0.5. The second trace's random run answers differently from its last two tokens on."""
    rng = np.random.default_rng(seed)
    n = n_prompt + n_generated
    answer_start = n - 8
    ids = [f"p{i}" for i in range(traces)]
    dense = []
    for problem in ids:
        tokens = rng.integers(40, 120, size=n).tolist()  # printable bytes of the tiny tokenizer
        dense.append({"kind": "trace", "id": problem, "dataset": "known_facts@1", "model": MODEL,
                      "prompt_ids": tokens[:n_prompt], "generated_ids": tokens[n_prompt:], "answer": "7",
                      "gold": "7", "correct": True, "policy": "full",
                      "known_answer": {"needed": [{"note": [n_prompt + 28, n_prompt + 38],
                                                   "key": [n_prompt + 30, n_prompt + 32],
                                                   "value": [n_prompt + 34, n_prompt + 38]}],
                                       "decoys": [{"note": [n_prompt + 8, n_prompt + 18],
                                                   "key": [n_prompt + 10, n_prompt + 12],
                                                   "value": [n_prompt + 14, n_prompt + 18]}],
                                       "answer_start": answer_start}})
    _jsonl(_stage(root, "traces", "t1", {}, {"traces": "stages/traces-t1/generations.jsonl"}) / "generations.jsonl",
           dense, packed)

    windows = [(start, start + 8) for start in range(n_prompt, answer_start - 7, 4)]
    labels = []
    for problem in ids:
        outcomes = ["different" if start < n_prompt + 38 and end > n_prompt + 34 else "same" for start, end in windows]
        positions = list(range(answer_start))
        flips = [1 if p < n_prompt or any(s <= p < e and o == "different" for (s, e), o in zip(windows, outcomes))
                 else 0 for p in positions]
        labels.append({"kind": "label", "id": problem, "dataset": "known_facts@1", "model": MODEL,
                       "status": "labelled", "reasoning_start": n_prompt, "answer_start": answer_start,
                       "replacement": {"spec": "auto", "chosen": "space"}, "positions": positions, "labels": flips,
                       "windows": [{"start": s, "end": e, "outcome": o, "flipped": o == "different",
                                    "answer_after": "3" if o == "different" else "7", "effect": -(s % 5) / 2}
                                   for (s, e), o in zip(windows, outcomes)]})
    labels_dir = _stage(root, "labels", "l1", {"traces": "t1"}, {"labels": "stages/labels-l1/labels.jsonl"})
    _jsonl(labels_dir / "labels.jsonl", labels)

    names = [f"scorer{k}" for k in range(scorers)]
    replay, raw = [], []
    for problem in ids:
        def column() -> list[float | None]:
            return [None] * n_prompt + rng.normal(size=answer_start - n_prompt).round(6).tolist() + [None] * (
                n - answer_start)

        signals = {name: {"agg": column(), **{str(layer): column() for layer in range(layers)}} for name in names}
        replay.append({"kind": "signal", "id": problem, "model": MODEL, "n_tokens": n, "n_prompt": n_prompt,
                       "positions": list(range(n)), "signals": signals, "answer_start": answer_start,
                       "policies": {name: {"policy": name, "params": {}} for name in names}})
        raw.append({"kind": "signal", "id": problem, "model": MODEL, "n_tokens": n, "n_prompt": n_prompt,
                    "positions": list(range(n)), "smoothing": "raw",
                    "signals": {name: {str(layer): column() for layer in range(layers)}
                                for name in ("hidden_diff", "key_norm")}})
    signals_dir = _stage(root, "signals", "s1", {"traces": "t1", "labels": "l1"},
                         {"files": ["stages/signals-s1/replay.jsonl", "stages/signals-s1/signals-raw.jsonl"]})
    _jsonl(signals_dir / "replay.jsonl", replay, packed)
    _jsonl(signals_dir / "signals-raw.jsonl", raw, packed)

    sweep = _stage(root, "evictor", "e1", {"traces": "t1"},
                   {"sweeps": {"baselines": {"path": "stages/evictor-e1/baselines",
                                             "configs": {name: {"policy": name} for name in
                                                         ("full", "random", "recency")}}}}) / "baselines"
    for policy in ("full", "random", "recency"):
        cell = sweep / (policy if policy == "full" else f"{policy}-K0.5")
        runs = []
        for number, trace in enumerate(dense):
            run = {**trace, "policy": policy}
            if policy != "full":
                run.update(budget=0.5, budget_tokens=n // 2, eviction={"rounds": 3, "peak_slots": n // 2})
            if policy == "random":
                log = cell / "keeplogs" / f"{trace['id']}.npz"
                log.parent.mkdir(parents=True, exist_ok=True)
                np.savez_compressed(log, **_keep_log(rng, n, (n_prompt, answer_start)))
                run["keep_log"] = f"keeplogs/{trace['id']}.npz"
                if number == 1:
                    run.update(generated_ids=trace["generated_ids"][:-2] + [50, 51], answer="3", correct=False)
            runs.append(run)
        _jsonl(cell / "generations.jsonl", runs, packed)
    return root


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    return make_study(tmp_path_factory.mktemp("study"))


def layer(view, group: str, name: str, model_layer: str | None = None):
    return next(x for x in view.layers if x.group == group and x.name == name and x.layer == model_layer)


# --------------------------------------------------------------------------------------------------- layers
def test_position_labels_cover_only_the_tested_span():
    record = {"reasoning_start": 2, "answer_start": 5, "positions": [0, 1, 2, 3, 4], "labels": [1, 1, 0, 1, 0]}
    (flipped,) = [x for x in label_layers(LABEL_KINDS[0], "occ", record, 7) if x.name == "flipped"]
    # the prompt's 1s are a convention, not tested; the answer span has no label
    np.testing.assert_array_equal(flipped.values, [np.nan, np.nan, 0, 1, 0, np.nan, np.nan])


def test_window_numbers_average_over_covering_windows_and_categories_keep_the_most_telling():
    record = {"reasoning_start": 0, "answer_start": 6,
              "windows": [{"start": 0, "end": 4, "effect": -1.0, "outcome": "different"},
                          {"start": 2, "end": 6, "effect": -3.0, "outcome": "same"}]}
    found = {x.name: x for x in label_layers(LABEL_KINDS[0], "occ", record, 6)}
    assert "flipped" not in found  # the record has no per-position labels
    np.testing.assert_array_equal(found["effect"].values, [-1, -1, -2, -2, -3, -3])
    outcome = found["window outcome"]
    assert outcome.categories[:4] == ("same", "no_answer", "degenerate", "different")
    # "different" is listed after "same": a token under both windows shows "different"
    assert [outcome.categories[int(v)] for v in outcome.values] == ["different"] * 4 + ["same"] * 2


def test_a_declared_label_kind_is_read_from_its_own_stage(study, tmp_path, monkeypatch):
    """A new label kind is one declaration: its stage's records become layers; a study without it is unchanged."""
    root = tmp_path / "study"
    shutil.copytree(study, root)
    probe = LabelKind("probe labels", "probe_labels", "labels.jsonl",
                      (TokenField("kept effect", "effect", "position", "signed", "hand-made"),), tested=None)
    monkeypatch.setattr("figures.viewer.study.LABEL_KINDS", (*LABEL_KINDS, probe))
    before = study_viewer(root).traces[0]
    assert not [x for x in before.layers if x.group.startswith("probe labels")]
    directory = _stage(root, "probe_labels", "c1", {"traces": "t1"}, {})
    _jsonl(directory / "labels.jsonl", [{"id": "p0", "positions": [3, 5], "effect": [0.5, -2]}])
    views = {v.id: v for v in study_viewer(root).traces}
    values = layer(views["p0"], "probe labels", "kept effect").values
    assert values[3] == 0.5 and values[5] == -2 and np.isnan(values[4])
    assert not [x for x in views["p1"].layers if x.group.startswith("probe labels")]


def test_known_answer_classes():
    from core.schemas import Trace

    trace = Trace(id="k", dataset="known_facts@1", model=MODEL, prompt_ids=[1] * 4, generated_ids=[2] * 16,
                  extra={"known_answer": {"needed": [{"note": [10, 14], "key": [10, 11], "value": [12, 14]}],
                                          "decoys": [{"note": [5, 8], "key": [5, 6], "value": [7, 8]}],
                                          "answer_start": 16}})
    found = known_layer(trace, 20)
    assert found is not None
    names = [None if np.isnan(v) else KNOWN_CLASSES[int(v)] for v in found.values]
    assert names == [None] * 4 + ["filler"] + ["decoy note"] * 2 + ["decoy value"] + ["filler"] * 2 + ["key"] * 2 + [
        "planted"] * 2 + ["filler"] * 2 + [None] * 4
    assert known_layer(Trace(id="x", dataset="gsm8k", model=MODEL, prompt_ids=[1], generated_ids=[2]), 2) is None


# --------------------------------------------------------------------------------------------------- runs
def test_kept_positions_after_the_last_round():
    log = {"round": np.array([0, 0, 1], dtype=np.int32), "layer": np.array([0, 1, 1], dtype=np.int32),
           "head": np.array([0, 1, 0], dtype=np.int32), "position": np.array([2, 3, 6], dtype=np.int32),
           "round_step": np.array([0, 2], dtype=np.int32), "round_next_pos": np.array([5, 8], dtype=np.int32)}
    flags = kept(log, n_run=10, n_positions=12, shape=(3, 2))
    assert flags.shape == (3, 2, 12)  # the model's third layer never evicted: the log does not name it
    expected = np.zeros((3, 2, 12), dtype=bool)
    expected[:, :, :10] = True  # the run had 10 tokens; the dense trace 12
    expected[0, 0, 2] = expected[1, 1, 3] = expected[1, 0, 6] = False
    np.testing.assert_array_equal(flags, expected)
    assert kept({**log, "round_next_pos": np.zeros(0, dtype=np.int32)}, 4, 4, (1, 1)).all()  # never evicted


def test_diverges_at():
    assert diverges_at([1, 2, 3], [1, 2, 3]) is None
    assert diverges_at([1, 2, 4], [1, 2, 3]) == 2
    assert diverges_at([1, 2], [1, 2, 3]) == 2


def test_study_views_hold_every_source(study):
    views = {v.id: v for v in study_viewer(study).traces}
    view = views["p1"]
    assert len(view.tokens) == 100 and view.regions == [("prompt", 0, 12), ("reasoning", 12, 92), ("answer", 92, 100)]
    groups = {(x.group, x.name) for x in view.layers}
    assert {("token occlusion (space)", "flipped"), ("token occlusion (space)", "effect"),
            ("token occlusion (space)", "window outcome"), ("known answer", "fact class"), ("scores", "scorer0"),
            ("signals (raw)", "key_norm")} <= groups
    assert {x.layer for x in view.layers if x.name == "scorer1"} == {"agg", "0", "1", "2", "3"}
    runs = {run.name: run for run in view.runs}
    assert list(runs) == ["full", "random", "recency"]
    assert runs["full"].diverges_at is None and runs["full"].keep is None and not runs["full"].note
    assert runs["recency"].keep is None and "keep-log" in runs["recency"].note
    random = runs["random"]
    assert random.diverges_at == 98 and random.answer == "3" and random.correct is False
    assert random.keep is not None and random.keep.shape == (N_LAYERS, N_HEADS, 100)
    assert not random.keep[:, :, 98:].any()  # another token stood there in this run
    assert random.keep[:, :, :12].all() and not random.keep.all()


def test_gzipped_records_read_as_they_are(tmp_path, study):
    packed = make_study(tmp_path / "packed", packed=True)
    assert [v.to_json() for v in study_viewer(packed).traces] == [v.to_json() for v in study_viewer(study).traces]


def test_the_current_stages_are_read_when_a_study_holds_several_keys(study, tmp_path):
    root = tmp_path / "study"
    shutil.copytree(study, root)
    # an older labels stage, of other traces: not the one the signals stage read
    old = _stage(root, "labels", "l0", {"traces": "t0"}, {})
    (old / "stage.json").touch()
    assert study_stages(root)["labels"] == root / "stages" / "labels-l1"


def test_in_memory_records_give_the_same_layers(study):
    from core.schemas import Label, Signal, Trace
    from figures.viewer.study import records
    from models.loading import load_tokenizer

    def read(pattern: str, cls):
        (file,) = study.glob(pattern)
        return [cls.from_json(r) for r in records(file)]

    page = trace_viewer(read("stages/traces-*/generations.jsonl", Trace), tokenizer=load_tokenizer(MODEL),
                        labels=read("stages/labels-*/labels.jsonl", Label),
                        signals=read("stages/signals-*/replay.jsonl", Signal),
                        runs=read("stages/evictor-*/baselines/recency-K0.5/generations.jsonl", Trace))
    from_study = {(x.group, x.name, x.layer) for x in study_viewer(study).traces[0].layers}
    from_memory = {(x.group, x.name, x.layer) for x in page.traces[0].layers}
    assert from_memory == {key for key in from_study if not key[0].startswith("signals")}
    assert [run.name for run in page.traces[0].runs] == ["recency"]


# --------------------------------------------------------------------------------------------------- the page
def test_page_is_self_contained_and_within_budget(tmp_path):
    """1,000 tokens, 12 scorers at every one of 30 layers: one file, nothing fetched, under 5 MB."""
    root = make_study(tmp_path / "big", n_prompt=100, n_generated=900, scorers=12, layers=30, traces=1)
    path = write_study_viewer(root)
    assert path == root / "trace-viewer.html"
    text = path.read_text()
    assert path.stat().st_size < 5_000_000
    assert "http://" not in text and "https://" not in text and "src=" not in text
    assert text.count('type="application/json" id="kv-trace-') == 1


def test_cli_writes_the_page_and_refuses_bad_input(study, tmp_path, capsys):
    out = tmp_path / "one.html"
    assert main(["--study", str(study), "--trace", "p1", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    index = out.read_text().split('id="kv-index">')[1].split("</script>")[0]
    assert [t["id"] for t in json.loads(index)["traces"]] == ["p1"]
    assert main(["--study", str(study), "--trace", "p9", "--out", str(tmp_path / "bad.html")]) == 2
    err = capsys.readouterr().err
    assert "p9" in err and "p0" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad.html").exists()
    assert main(["--study", str(tmp_path), "--out", str(tmp_path / "x.html")]) == 2
    assert "no finished stage" in capsys.readouterr().err
    with pytest.raises(UsageError, match="not a directory"):
        study_viewer(tmp_path / "missing")
