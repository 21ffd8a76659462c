"""The notebooks: each a percent-format script paired with a notebook committed without outputs, both in step, and
runnable end to end on a tiny model.

``notebooks/<name>.py`` is the source (jupytext percent format); ``notebooks/<name>.ipynb`` is what Jupyter opens and
must say the same (`jupytext --sync notebooks/*.py` rewrites it). Each notebook is executed with papermill on
`tiny-llama` (random init, built in-process) with tiny limits injected after its `parameters` cell, into a temporary
out_dir; the test checks it ran without error and wrote each expected figure as a non-empty PNG and PDF. A
random-init model never states an answer, so occlusion labelling would skip every trace: layer_anatomy is given
hand-made traces and labels instead (labelling has its own tests). The findings notebook loads no model: it redraws
the committed tables under results/.
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import nbformat
import pytest

from core.schemas import Label, Trace

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
SCRIPTS = sorted(NOTEBOOK_DIR.glob("*.py"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CELL_TIMEOUT_S = 240

# Figures (file stems under out_dir/figures) each notebook must produce.
EXPECTED_FIGURES = {
    "layer_anatomy": ["layer_rho", "raw_vs_z", "positional_confound"],
    "geometry_survey": ["sink_vs_ratio", "bos_vs_ratio", "layer_geometry_tiny-llama"],
    "eviction_budgets": ["accuracy_vs_budget"],
    "planted_fact_passcode": ["head_set_retrieval"],
    "speed_memory": ["cost_vs_budget", "prefill_memory", "projection_epikv", "projection_model"],
    "findings": ["layer_rho", "scorer_ranking", "accuracy_budget", "difference_vs_random", "sink_vs_ratio",
                 "head_set_retrieval", "accuracy_budget_ruler-smollm2"],
    "quickstart": [],  # it draws no figure: its output is the trace viewer's page
}

# "solution" is the filler text of the planted-fact probe.
TINY_PROBLEMS = [
    {"id": "tiny-0", "question": "What is 2 + 3?", "answer": "5",
     "solution": "We add the two numbers. Two plus three is five, because counting up three from two gives three, "
                 "four, five. So the sum is 5 and we are done with this small problem."},
    {"id": "tiny-1", "question": "What is 4 times 2?", "answer": "8",
     "solution": "Four times two means four added twice: four plus four. That is eight. We can check by doubling "
                 "four, which again gives eight, so the answer is 8."},
]


def tiny_parameters(name: str, tmp: Path) -> dict:
    if name == "findings":  # redraws the committed results: no model
        return {"results_dir": str(ROOT / "results"), "out_dir": str(tmp / "out")}
    data_file = tmp / "problems.jsonl"
    data_file.write_text("".join(json.dumps(p) + "\n" for p in TINY_PROBLEMS))
    common = {"model": "tiny-llama", "out_dir": str(tmp / "out"), "torch_threads": 1}
    evict = {"dataset": "gsm8k", "data_file": str(data_file), "buffer": 2, "protect": "prompt"}
    if name == "layer_anatomy":
        traces, labels = synthetic_labelled_traces(tmp)
        return {**common, "traces_file": str(traces), "labels_file": str(labels), "smoothing_window": 8}
    if name == "geometry_survey":
        return {**common, **evict, "prompts": 1, "ctx": 64, "topk": 16, "queries": 4, "limit": 1,
                "max_new_tokens": 8, "gap_budget": 4}
    if name == "eviction_budgets":
        return {**common, **evict, "limit": 2, "max_new_tokens": 10, "policies": ["random", "valuediff"],
                "budgets": [2, 4], "batch_size": 2, "compare_policies": ["valuediff", "random"], "n_boot": 200}
    if name == "planted_fact_passcode":
        return {**common, "head_sets": "0;1", "n": 2, "budget": 96, "buffer": 4, "distance": "1", "lead": 8,
                "box": 24, "dataset": "gsm8k", "data_file": str(data_file), "batch_size": 2, "n_boot": 100,
                "passcode_policies": ["random"], "passcode_rounds": 1, "passcode_n": 1}
    if name == "quickstart":  # a random-init model states no answer: labelling records the trace as skipped
        return {**common, "window": 32, "budget": 64}
    if name == "speed_memory":
        return {**common, **evict, "limit": 1, "max_new_tokens": 8, "policies": ["recency"], "budgets": [2, 4],
                "ctx_lengths": [16, 32], "projection_ctx": [1024, 4096, 32768]}
    raise AssertionError(f"no tiny parameters for notebook {name!r}; add them here")


def synthetic_labelled_traces(tmp: Path, n_traces: int = 6, prompt_len: int = 6, gen_len: int = 40):
    """Trace and Label records of random byte tokens: prompt labelled 1, reasoning a mix of 0 and 1."""
    rng = random.Random(0)
    traces, labels = tmp / "traces.jsonl", tmp / "labels.jsonl"
    with traces.open("w") as t, labels.open("w") as lab:
        for i in range(n_traces):
            ids = [rng.randrange(0, 256) for _ in range(prompt_len + gen_len)]
            trace = Trace(id=f"t{i}", dataset="gsm8k", model="tiny-llama", correct=True,
                          prompt_ids=ids[:prompt_len], generated_ids=ids[prompt_len:])
            answer_start = prompt_len + gen_len - 8
            reasoning = [rng.randrange(2) for _ in range(answer_start - prompt_len)]
            reasoning[:2] = [0, 1]  # both values in every trace: each one counts towards n_eff
            label = Label(id=f"t{i}", dataset="gsm8k", model="tiny-llama", status="labelled", correct=True,
                          reasoning_start=prompt_len, answer_start=answer_start, positions=list(range(answer_start)),
                          labels=[1] * prompt_len + reasoning)
            t.write(json.dumps(trace.to_json()) + "\n")
            lab.write(json.dumps(label.to_json()) + "\n")
    return traces, labels


def test_every_notebook_is_a_pair_with_a_tiny_configuration():
    assert NOTEBOOKS, "no notebooks found"
    assert {p.stem for p in NOTEBOOKS} == {p.stem for p in SCRIPTS} == set(EXPECTED_FIGURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_has_no_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code and "parameters" in code[0].metadata.get("tags", []), "first code cell must be tagged 'parameters'"
    from papermill.translators import PythonTranslator

    assigned = [t.id for node in ast.parse(code[0].source).body for t in node.targets]
    assert [p.name for p in PythonTranslator.inspect(code[0])] == assigned, "papermill cannot parse every parameter"
    for cell in code:
        assert cell.outputs == [], f"cell {cell.id} has outputs"
        assert cell.execution_count is None, f"cell {cell.id} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_in_step_with_its_script(path):
    jupytext = pytest.importorskip("jupytext")
    script = path.with_suffix(".py")
    assert jupytext.writes(jupytext.read(path), fmt="py:percent") == script.read_text(), (
        f"{path.name} differs from {script.name}; run `jupytext --sync notebooks/{script.name}`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_tiny_model(path, tmp_path, monkeypatch):
    papermill = pytest.importorskip("papermill")
    parameters = tiny_parameters(path.stem, tmp_path)
    # The kernel inherits this process's environment.
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    # The notebook's own folder is the working directory, as when Jupyter opens it.
    papermill.execute_notebook(str(path), str(tmp_path / path.name), parameters=parameters, kernel_name="python3",
                               cwd=str(NOTEBOOK_DIR), execution_timeout=CELL_TIMEOUT_S, progress_bar=False)
    figures = Path(parameters["out_dir"]) / "figures"
    for stem in EXPECTED_FIGURES[path.stem]:
        png, pdf = figures / f"{stem}.png", figures / f"{stem}.pdf"
        assert png.is_file() and png.read_bytes()[:8] == PNG_SIGNATURE, f"{png} missing or not a PNG"
        assert png.stat().st_size > 1000, f"{png} is suspiciously small"
        assert pdf.is_file() and pdf.read_bytes()[:5] == b"%PDF-", f"{pdf} missing or not a PDF"
