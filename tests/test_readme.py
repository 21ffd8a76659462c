"""The README's stage-by-stage pipeline runs as written: every command, every flag, each reading the files the one
before it wrote. Only sizes change (a saved tiny model for smollm2-135m, a small data file, fewer tokens, windows and
bootstrap replicates), so a renamed flag or output file in any stage fails here.

A random-init model never states an answer, so grading takes the first two characters of a text as its answer (as
tests/test_study.py does): every trace has a reference answer and occlusion windows can flip it.
"""

from __future__ import annotations

import csv
import importlib
import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import write_arithmetic_problems  # tests/ is on sys.path under pytest

import tasks.grading

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- readme-pipeline -->"
# Smaller sizes for the tiny model; every other argument is the README's.
SIZES = {"--limit": "6", "--max-new-tokens": "96"}
EXTRA = {
    # A random-init model writes no answer cue: its traces are labelled by free regeneration, read as EpiKV reads it
    # (cue + continuation), so the pipeline's later stages get labels to work on.
    "labeling.occlusion": ["--window", "8", "--stride", "4", "--max-answer-tokens", "4", "--no-force-answer",
                           "--no-stop-at-answer"],
    "validation.select": ["--n-boot", "100"],
    "validation.compare": ["--n-boot", "200"],
    "evictor.run": ["--quiet"],
}


def pipeline_commands() -> list[list[str]]:
    text = README.read_text()
    assert MARKER in text, f"{README.name} lost its {MARKER} block"
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARKER):], re.S).group(1)
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def adapted(argv: list[str], tiny_dir: str, data_file: str) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        previous = argv[i - 1] if i else None
        if previous == "--model":
            out.append(tiny_dir)
        elif previous in SIZES:
            out.append(SIZES[previous])
        else:
            out.append(arg)
    if "--dataset" in argv:
        out += ["--data-file", data_file]
    return out


def command_main(module: str):
    loaded = importlib.import_module(module)
    if not hasattr(loaded, "main"):
        loaded = importlib.import_module(f"{module}.__main__")
    return loaded.main


def test_the_readme_pipeline_runs_as_written(tiny_dir, tmp_path, monkeypatch):
    data_file = write_arithmetic_problems(tmp_path / "problems.jsonl", 6)
    monkeypatch.setattr(tasks.grading, "extract_answer", lambda text, dataset=None: text[:2] or "-")
    monkeypatch.setattr(tasks.grading, "is_equivalent", lambda a, b, **kw: a == b)
    monkeypatch.chdir(tmp_path)

    commands = pipeline_commands()
    assert [c[:3] for c in commands][0] == ["python", "-m", "tasks.run"] and len(commands) >= 6
    for command in commands:
        assert command[:2] == ["python", "-m"], command
        module, argv = command[2], adapted(command[3:], str(tiny_dir), str(data_file))
        assert command_main(module)([*argv, *EXTRA.get(module, [])]) == 0, shlex.join(command)

    best = json.loads(Path("runs/select/best.json").read_text())
    cells = {row["policy"] for row in json.loads(Path("runs/evict/summary.json").read_text())}
    assert {"full", "random", "recency", best["policy"]} <= cells
    assert list(Path("runs/figures").glob("*.png"))
    chosen = {row["config"]: row["signal"] for row in csv.DictReader(Path("runs/select/ranking.csv").open())
              if row["config"]}
    predicts = list(csv.DictReader(Path("runs/predictive/predictive.csv").open()))
    assert best["policy"] in {row["scorer"] for row in predicts} and "random" not in {row["scorer"] for row in predicts}
    # the selected configuration is validated by the signal it was chosen on, not by its policy's aggregate score
    assert {row["signal"] for row in predicts if row["scorer"] == best["policy"]} == {chosen[best["policy"]]}
