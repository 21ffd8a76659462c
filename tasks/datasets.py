"""Benchmark problems as `Problem` records: MATH-500, AIME-2024, GSM8K (from a file, a data directory or the hub)
and the RULER-style long-context tasks (generated, `tasks.ruler`).

Where the problems come from, first match wins:

1. ``data_file``: any JSONL file whose records carry a question field (``problem`` / ``question`` / ``Problem``)
   and an answer field (``answer`` / ``Answer``); ids come from ``unique_id`` / ``id`` / ``ID`` or the line order.
2. ``$KVSCOPE_DATA_DIR/<file>`` (``math500.jsonl``, ``aime24.jsonl``, ``gsm8k_test.jsonl``), the offline copies.
3. The HuggingFace hub through the ``datasets`` library (the hub ids in `SOURCES`); offline, that is a `UsageError`.

RULER datasets (``ruler_niah_single``, ``ruler_vt@4k``, ...; `tasks.ruler`) are generated from a seed instead of
read (``data_file`` still overrides); their length is counted with the tokenizer passed to `load_problems` (default:
the default model's), and without a `limit` there are `tasks.ruler.DEFAULT_COUNT` of them. Known-answer datasets
(``known_facts``, ``known_facts@3``, ``known_facts@2+first+twohop+7500``; `tasks.known_answer.parse_name` reads the
name) are generated too, independently of any tokenizer, with `tasks.known_answer.DEFAULT_COUNT` problems without a
`limit`. A file with no problems is a `UsageError` naming it.

GSM8K answers are full solutions ending in ``#### <number>``; the gold is the number after the marker.

Each dataset also supplies how its answers are graded (`grader`, `grade`): a benchmark by mathematical equivalence
of the extracted answer (`tasks.grading`), a RULER task by exact match of its answer items (`tasks.ruler.grade`),
a known-answer task on its answer statement only (`tasks.known_answer.grade`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import UsageError, unknown_choice
from core.paths import DATA_DIR_ENV
from core.records import read_jsonl
from tasks import grading, known_answer, ruler
from tasks.problem import Problem


@dataclass(frozen=True)
class HubSource:
    path: str
    config: str | None
    split: str


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    filename: str  # the file looked up in $KVSCOPE_DATA_DIR
    hub: tuple[HubSource, ...]  # tried in order


SOURCES: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("math500", "math500.jsonl", (HubSource("HuggingFaceH4/MATH-500", None, "test"),)),
        DatasetSpec(
            "aime24",
            "aime24.jsonl",
            (HubSource("HuggingFaceH4/aime_2024", None, "train"), HubSource("Maxwell-Jia/AIME_2024", None, "train")),
        ),
        DatasetSpec("gsm8k", "gsm8k_test.jsonl", (HubSource("openai/gsm8k", "main", "test"),)),
    )
}
DATASETS: tuple[str, ...] = tuple(SOURCES) + ruler.NAMES + known_answer.NAMES

QUESTION_FIELDS = ("problem", "question", "Problem", "Question")
ANSWER_FIELDS = ("answer", "Answer")
ID_FIELDS = ("unique_id", "id", "ID")


def gsm8k_gold(solution: str) -> str:
    """The final answer of a GSM8K reference solution: the text after its last ``####``, thousands commas removed."""
    if "####" not in solution:
        raise ValueError("GSM8K solution has no '#### <answer>' line")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_problems(
    name: str,
    *,
    data_file: str | os.PathLike | None = None,
    limit: int | None = None,
    tokenizer: Any = None,
) -> list[Problem]:
    """The first `limit` problems of dataset `name` (all when `limit` is None), in the dataset's own order.

    `tokenizer` (a tokenizer, a model name or None for the default model's) only matters for RULER datasets, whose
    context length it measures.
    """
    generated = _ruler_config(name)
    known = known_answer.parse_name(name)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise UsageError(f"limit must be a positive integer, got {limit!r}")
    if data_file is not None:
        path = Path(data_file).expanduser()
        if not path.is_file():
            raise UsageError(f"data file {str(data_file)!r} does not exist")
        rows, origin = _numbered(read_jsonl(path), limit), str(path)
    elif generated is not None:
        records = ruler.generate(generated, limit or ruler.DEFAULT_COUNT, tokenizer)
        rows, origin = list(enumerate(records, start=1)), ruler.source(generated, tokenizer)
        name = generated.name
    elif known is not None:
        records = known_answer.generate(known, limit or known_answer.DEFAULT_COUNT)
        rows, origin = list(enumerate(records, start=1)), known_answer.source(known)
        name = known.name
    elif (local := _data_dir_file(SOURCES[name])) is not None:
        rows, origin = _numbered(read_jsonl(local), limit), str(local)
    else:
        rows, origin = _from_hub(SOURCES[name], limit)
    if not rows:
        where = f"data file {str(data_file)!r}" if data_file is not None else origin
        raise UsageError(f"{where} holds no problems")
    problems = [_to_problem(row, number, name, origin) for number, row in rows]
    _check_unique_ids(problems, origin)
    return problems


def resolve_source(name: str, data_file: str | os.PathLike | None = None, tokenizer: Any = None) -> str:
    """Where `load_problems(name, data_file=...)` reads from: a file path, ``hub:<id>`` or, for a generated dataset,
    its generator, seed and tokenizer (for run configs)."""
    generated = _ruler_config(name)
    if data_file is not None:
        return str(Path(data_file).expanduser().resolve())
    if generated is not None:
        return ruler.source(generated, tokenizer)
    if (known := known_answer.parse_name(name)) is not None:
        return known_answer.source(known)
    local = _data_dir_file(SOURCES[name])
    return str(local) if local is not None else "hub:" + " or ".join(h.path for h in SOURCES[name].hub)


def check_dataset(name: str) -> None:
    """Refuse an unknown dataset name (a benchmark, a RULER task with an optional ``@<tokens>`` length, or a
    known-answer task with an optional ``@<decoys>`` and ``+<trait>`` each)."""
    _ruler_config(name)


def grader(dataset: str) -> Callable[[str, Problem], dict[str, Any]]:
    """The grading rule `dataset` supplies: a RULER task's exact match of its answer items (`tasks.ruler.grade`), a
    known-answer task's answer statement (`tasks.known_answer.grade`), else a benchmark's extracted final answer by
    mathematical equivalence (`tasks.grading.grade`)."""
    if ruler.parse_name(dataset) is not None:
        return ruler.grade
    if known_answer.parse_name(dataset) is not None:
        return known_answer.grade
    return grading.grade


def grade(text: str, problem: Problem) -> dict[str, Any]:
    """Grade a model output against `problem` by its dataset's rule (`grader`): answer (extracted or None), correct,
    no_answer, extracted_by, and what else the rule reports (a RULER task's ``score``)."""
    return grader(problem.dataset)(text, problem)


def _ruler_config(name: str) -> ruler.RulerConfig | None:
    """The generator settings of a RULER dataset name, None for a benchmark read from files or a known-answer task
    (`tasks.known_answer`); unknown names fail."""
    generated = ruler.parse_name(name)
    if generated is None and name not in SOURCES and known_answer.parse_name(name) is None:
        raise unknown_choice("dataset", name, DATASETS)
    return generated


def _data_dir_file(spec: DatasetSpec) -> Path | None:
    directory = os.environ.get(DATA_DIR_ENV)
    if not directory:
        return None
    path = Path(directory).expanduser() / spec.filename
    return path if path.is_file() else None


def _numbered(records, limit: int | None) -> list[tuple[int, dict[str, Any]]]:
    """(1-based record number, record) pairs, reading no further than `limit` records (errors beyond it never fire)."""
    rows: list[tuple[int, dict[str, Any]]] = []
    for number, record in enumerate(records, start=1):
        if limit is not None and len(rows) >= limit:
            break
        rows.append((number, record))
    return rows


def _from_hub(spec: DatasetSpec, limit: int | None) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    try:
        import datasets
    except ImportError:
        raise UsageError(
            f"dataset {spec.name!r}: no local copy (set {DATA_DIR_ENV} or pass --data-file) and the 'datasets' "
            "package is not installed"
        ) from None
    failures = []
    for source in spec.hub:
        split = source.split if limit is None else f"{source.split}[:{limit}]"
        try:
            table = datasets.load_dataset(source.path, source.config, split=split)
        except Exception as err:  # offline, missing repo, auth: the hub client raises many types
            failures.append(f"{source.path}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            continue
        return list(enumerate((dict(row) for row in table), start=1)), f"hub:{source.path}"
    offline = " (HF_HUB_OFFLINE=1 is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
    raise UsageError(
        f"dataset {spec.name!r}: no local copy (set {DATA_DIR_ENV} to a directory holding {spec.filename} or pass "
        f"--data-file) and the hub could not be read{offline}: {'; '.join(failures)}"
    )


def _first(record: dict[str, Any], fields: tuple[str, ...]) -> Any:
    return next((record[f] for f in fields if record.get(f) is not None), None)


def _to_problem(record: dict[str, Any], number: int, dataset: str, origin: str) -> Problem:
    question, answer = _first(record, QUESTION_FIELDS), _first(record, ANSWER_FIELDS)
    if question is None or answer is None:
        kind, fields = ("question", QUESTION_FIELDS) if question is None else ("answer", ANSWER_FIELDS)
        raise UsageError(f"{origin}: record {number} has no {kind} field (expected one of: {', '.join(fields)})")
    for kind, value in (("question", question), ("answer", answer), ("id", _first(record, ID_FIELDS))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
            raise UsageError(f"{origin}: record {number}: its {kind} is a JSON {type(value).__name__}, not text")
    if not str(question).strip():
        raise UsageError(f"{origin}: record {number}: its question is empty")
    answer = str(answer)
    meta = {k: v for k, v in record.items() if k not in QUESTION_FIELDS + ANSWER_FIELDS}
    if dataset == "gsm8k" and "####" in answer:
        meta["solution"] = answer
        answer = gsm8k_gold(answer)
    raw_id = _first(record, ID_FIELDS)
    problem_id = str(raw_id) if raw_id is not None else f"{dataset}-{number - 1}"
    meta["source"] = origin
    return Problem(id=problem_id, question=str(question), answer=answer.strip(), dataset=dataset, meta=meta)


def _check_unique_ids(problems: list[Problem], origin: str) -> None:
    seen: set[str] = set()
    for problem in problems:
        if problem.id in seen:
            raise UsageError(f"{origin}: problem id {problem.id!r} appears more than once; ids must be unique")
        seen.add(problem.id)
