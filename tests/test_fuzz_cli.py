"""Every CLI, every flag, its invalid values: exit status 2, one line on stderr naming the value, no traceback, and
nothing left behind (CONTRIBUTING.md, the command-line contract).

The table is generated, not written: the CLIs are found by walking the packages (a module whose ``main`` is made by
`core.cli.main_guard` or `figures.cli.figure_main`), their options are read from their ``build_parser()``, and each
option's invalid values follow from its argparse type (`TYPE_VALUES`), its choices, or its name (`NAMED_VALUES`:
files, model names, lists, output directories). A flag or a CLI added later joins the table by construction;
`test_every_option_has_invalid_values` fails for an option the table cannot give an invalid value, and
`test_every_cli_has_a_valid_command` for a CLI without the valid command (`BASES`) its cases start from, so nobody
needs to remember.

Each case replaces one flag of a valid command with one invalid value and runs the CLI in this process on the tiny
model's saved directory; every value is refused before any model loads wherever the check needs no model, so the
whole table runs in about a minute.

Besides each flag's own values, the table holds the classes every CLI of their kind must refuse, each with its
completeness test: a request beyond the memory limit (``--max-memory``, which every CLI that loads a model has:
`test_every_cli_that_loads_a_model_checks_its_memory`), Ray workers this machine cannot schedule (every CLI with
``--backend``), a list naming an item twice (`test_every_list_option_refuses_duplicates`), paths too long for the
file system, a resume over a damaged output (every CLI that stores records: the damage is put where its first store
is, found by running it), and damaged files to restore (`core.pack --restore`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib
import json
import os
import re
from pathlib import Path

import pytest
from conftest import tiny_traces, write_arithmetic_problems  # tests/ is on sys.path under pytest
from test_validation_cli import _layer_data

from core.rundir import RunDir

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "models", "tasks", "scoring", "signals", "geometry", "labeling", "validation", "evictor", "probes",
            "figures", "study", "bench")
# Modules with a __main__ block that are no user CLI: processes kvscope itself starts, which take no flags, and the
# kvpress side of bench/kvpress_compare.py, which runs in kvpress's own environment without kvscope's CLI contract.
INTERNAL = {"tasks._verify_worker", "tasks.vllm_worker", "bench._kvpress_side"}
HUGE = "1" + "0" * 30
LONG_NAME = "n" * 300  # longer than any file system takes for one name (255 bytes on most)


# ---------------------------------------------------------------------------------------------------- the CLIs
def _guarded(tree: ast.Module) -> bool:
    """Whether a module's top-level ``main`` is ``main_guard(...)`` / ``figure_main(...)`` or a function decorated
    with ``@main_guard``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "main" for t in node.targets):
            call = node.value
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) in ("main_guard", "figure_main"):
                return True
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            if any(getattr(d, "id", None) == "main_guard" for d in node.decorator_list):
                return True
    return False


def _has_main_block(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def find_clis() -> tuple[list[str], list[str]]:
    """(guarded CLI modules, modules with a __main__ block that are not guarded), by walking the packages."""
    clis, unguarded = [], []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if _guarded(tree):
                clis.append(module)
            elif _has_main_block(tree):
                unguarded.append(module)
    return clis, unguarded


def cli_name(module: str) -> str:
    return module.removesuffix(".__main__")


def parsers() -> dict[str, tuple[str, list[str], argparse.ArgumentParser]]:
    """CLI name (``evictor.calibrate thinkv`` for a subcommand) -> (module, argv prefix, parser)."""
    found = {}
    for module in find_clis()[0]:
        parser = importlib.import_module(module).build_parser()
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            found[cli_name(module)] = (module, [], parser)
        for choice, subparser in (sub.choices.items() if sub is not None else []):
            found[f"{cli_name(module)} {choice}"] = (module, [choice], subparser)
    return found


PARSERS = parsers()


# ---------------------------------------------------------------------------------------------------- the table
# Invalid values by argparse type (the function's name).
TYPE_VALUES = {
    "positive_int": ["0", "-1", "abc", "2.5", "nan"],
    "non_negative_int": ["-1", "abc", "1.5"],
    "int": ["abc", "2.5", "nan"],
    "float": ["nan", "inf", "abc"],
    "non_negative_float": ["-1", "nan", "inf"],
    "unit_interval": ["0", "1.5", "nan"],
    "seed_int": ["-1", "abc", HUGE],
    "thread_count": ["0", "abc", "100000"],
    "device": ["tpu", "cuda:99"],
    "count_or_all": ["-1", "some"],
    "open_unit_interval": ["0", "1", "-1", "nan"],
    "gigabytes": ["-1", "nan", "1e308"],
    "prefill_contexts": ["0", "abc"],
    # the memory class: no unit, not an amount, more than the machine has, and less than any request needs
    "memory_size": ["0GiB", "-1GiB", "abc", "24", "nanGiB", "100TiB", "1MiB"],
}
FILES = ["file:missing", "file:dir", "file:binary", "file:latin1", "file:empty", "file:array_line", "file:corrupt",
         "file:long_name"]
TRACES = FILES + ["traces:prompt_ids_string", "traces:ids_not_int", "traces:out_of_vocab", "traces:no_id",
                  "traces:id_list", "traces:wrong_kind", "traces:duplicate_ids", "traces:too_long"]
# Invalid values by option name (dest), for the options whose type is text: files of every wrong kind, names,
# lists. ``file:``/``traces:``/``out:`` values are made by `resolve`; the rest are given as they are.
NAMED_VALUES = {
    "model": ["bogus-model", "model:empty_config", "model:no_config", "file:binary"],
    "dataset": ["gsm9k", "ruler_niah_single@10000000", "ruler_bogus@512"],
    "data_file": FILES + ["problems:question_list", "problems:no_question"],
    "traces": TRACES,
    "reference": TRACES + ["traces:evicted", "traces:other_model"],
    "filler": FILES,
    "labels": FILES + ["labels:positions_string", "labels:length_mismatch"],
    "signals": FILES + ["signals:values_strings", "signals:length_mismatch", "hidden_diff,hidden_diff"],
    "input": ["file:missing", "file:dir", "file:binary.csv", "table:wrong_columns.csv", "table:header_only.csv"],
    "policy_config": FILES + ["policy:unknown", "policy:unknown_param", "policy:float_for_int", "policy:array"],
    "runs": ["file:missing", "file:dir", "file:binary"],
    "ranking": ["file:missing", "file:dir", "file:binary", "file:latin1", "file:empty", "table:wrong_columns.csv",
                "table:ranking_header_only.csv"],
    "compare": ["file:missing", "file:dir", "file:binary", "file:empty", "table:wrong_columns.csv",
                "table:comparison_no_budget.csv"],
    "signal": ["epikv", "=x", "epikv=bogus.agg.raw"], "against": ["bogus"],
    "budget": ["0", "inf", "32,32", "1,,2", "abc", HUGE],
    "keep": ["0", "2.5", "nan", "abc"],
    "policy": ["bogus", "random,,h2o", "random,random"],
    "policies": ["bogus", "random,,h2o", "random,random"],
    "scorers": ["bogus", "full", "h2o,h2o"],
    "shard": ["2/2", "a/b", "-1/2"],
    "layers": ["99", "a", "1,,2", "1,1"],
    "bands": ["1", "a,b", "99,100", "1,1"],
    "heads": ["99", "a;b", "0,0", "0;0"],
    "methods": ["bogus", "snapkv,snapkv"],
    "settings": ["hf-0", "tpu-1", "hf-1,hf-1"],
    "models": ["bogus-model", "smollm2-135m,smollm2-135m"],
    "variants": ["bogus", "token,token"],
    "n_boot": ["10000000000000"],  # replicates beyond any machine's memory
    "json": ["file:dir", f"file:{LONG_NAME}"],
    "distance": ["0", "abc", "99999999t"],
    "replacement": ["bogus", "999999999"],
    "smoothing": ["bogus"], "band_smoothing": ["bogus"], "engine": ["bogus"], "kernels": ["bogus"],
    "family": ["bogus"], "raw_transform": ["bogus"], "detrended_transform": ["bogus"], "band_transform": ["bogus"],
    "correction": ["bogus"], "signal_names": ["bogus"], "name": ["bogus"], "ci": ["bogus"], "label": ["bogus"],
    "value": ["bogus"], "low": ["bogus"], "high": ["bogus"], "group": ["bogus"], "dense": ["bogus"],
    "band_signal": ["bogus"], "raw": ["bogus"], "z": ["bogus"], "band_order": ["R,R,E", "X,Y,Z"],
    "stem": ["../escape", "a/b", LONG_NAME],
    "title": ["$\\frac{$"],  # not mathtext matplotlib can draw
    "gzip": ["a/b.jsonl"],
    "study": ["file:missing", "file:dir", "file:binary", "file:long_name"], "trace": ["bogus"],
    "address": ["127.0.0.1:1"],
    "workers": ["100000"],
    "cpus_per_worker": ["0.00004"], "gpus_per_worker": ["0.00004"],
    "prefill_out": ["out:file"], "source": ["file:missing", "file:binary"],
    # token counts beyond the tiny model's context (4096 positions)
    "max_new_tokens": ["100000"], "window": ["100000"], "max_answer_tokens": ["100000"], "ctx": ["100000"],
    "teacher_block": ["100000"], "query_window": ["100000"], "recency": ["100000"], "buffer": ["100000"],
}
# Values of `NAMED_VALUES` for a CLI whose model is not the tiny one: the random 8B-shaped Llama of the prefill-memory
# bench takes 131072 positions.
CLI_VALUES = {("bench.prefill_memory", "ctx"): ["200000"]}
# Options that no value makes invalid: free text and switches (a switch given a value is still tested).
FREE = {"xlabel", "gap_label"}


def invalid_values(cli: str, action: argparse.Action) -> list[str]:
    """The invalid values of one option of `cli`: by its name, its type and its choices; a switch given a value."""
    named = CLI_VALUES.get((cli, action.dest), NAMED_VALUES.get(action.dest, []))
    values = list(named) if action.nargs != 0 else []  # a switch takes no value
    if action.dest == "out":
        kinds = FILE_OUTS if output_file(cli) else DIRECTORY_OUTS
        values = [kind for kind in kinds if kind not in SHARED_OUTS.get(cli, set())]
    type_name = getattr(action.type, "__name__", None)
    values += [v for v in TYPE_VALUES.get(type_name, []) if v not in values]
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        values.append("bogus")
    if action.nargs == 0:
        values.append("=given")
    if takes_many(action):
        values.append("=duplicate")
    return values


def takes_many(action: argparse.Action) -> bool:
    """Whether an option takes a list as several values (``nargs`` + or *, or repeated), not a fixed number."""
    return action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)


def takes_text_list(action: argparse.Action) -> bool:
    """Whether an option takes a list in one value (its help says comma- or ';'-separated)."""
    return re.search(r"comma[ -](list|separated)|';'-separated", (action.help or "").lower()) is not None


def repeats_an_item(value: str) -> bool:
    items = [item.strip() for item in re.split(r"[,;]", value) if item.strip()]
    return len(items) != len(set(items))


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def flag_of(action: argparse.Action) -> str:
    return max(action.option_strings, key=len) if action.option_strings else action.dest


# ---------------------------------------------------------------------------------------------------- fixtures
def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def fx(tmp_path_factory, tiny_dir):
    """Valid inputs for every CLI (made by hand, no model run) and the malformed files of the table."""
    root = tmp_path_factory.mktemp("fuzz-inputs")
    traces = tiny_traces(str(tiny_dir))
    f = {"tiny": str(tiny_dir), "root": root, "traces_rows": traces}
    f["traces"] = _jsonl(root / "traces.jsonl", traces)
    solution = " ".join(f"Step {k}: we add {k} and {k} to get {2 * k}, then carry on." for k in range(60))
    problems = [{"id": f"p{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i), "solution": solution}
                for i in range(1, 5)]
    f["data"] = _jsonl(root / "problems.jsonl", problems)
    f["arithmetic"] = write_arithmetic_problems(root / "arithmetic.jsonl", 2)
    dense, evicted = root / "dense", root / "evicted"
    dense.mkdir()
    evicted.mkdir()
    _jsonl(dense / "generations.jsonl", [{**t, "policy": "full"} for t in traces])
    _jsonl(evicted / "generations.jsonl", [{**t, "policy": "random", "budget": 32, "budget_tokens": 32,
                                            "eviction": {"rounds": 1, "peak_slots": 32}} for t in traces])
    f["dense"], f["evicted"] = str(dense), str(evicted)
    labels_dir = root / "labels"
    labels_dir.mkdir()
    f["labels"], (f["signals_mean"], f["signals_z"]) = _layer_data(labels_dir, n_traces=6, tokens=40)
    shards = root / "shards"
    shards.mkdir()
    label = {"kind": "label", "id": "t0", "dataset": "gsm8k", "model": str(tiny_dir), "status": "labelled"}
    (shards / "config.shard-0-of-1.json").write_text(json.dumps({"identity": {"window": 8}, "trace_ids": ["t0"]}))
    _jsonl(shards / "labels.shard-0-of-1.jsonl", [label])
    f["shards"] = str(shards)
    tables = root / "tables"
    tables.mkdir()
    from test_figures import FIGURES

    for name, _, table, _ in FIGURES:
        table().to_csv(tables / f"{name}.csv", index=False)
    (tables / "forest.csv").write_text("label,estimate,estimate_lo,estimate_hi\na,0.1,0.0,0.2\nb,-0.2,-0.3,-0.1\n")
    f["ranking"] = str(tables / "ranking.csv")
    (tables / "ranking.csv").write_text("signal,within_rho,within_t_lo,within_t_hi,config\n"
                                        "h2o.agg.raw,-0.2,-0.3,-0.1,\nrecency.agg.raw,0.5,0.4,0.6,recency\n")
    f["comparison"] = str(tables / "comparison.csv")
    (tables / "comparison.csv").write_text("policy_a,policy_b,budget_a,difference,ci_lo,ci_hi,n_problems\n"
                                           "h2o,random,0.5,-0.3,-0.5,-0.1,8\nrecency,random,0.5,0.0,-0.1,0.1,8\n"
                                           "full,random,,0.1,0.0,0.2,8\n")
    f["tables"] = str(tables)
    f["forced_labels"] = _jsonl(root / "forced-labels.jsonl", [_forced_label(t) for t in traces])
    from test_trace_viewer import make_study

    f["study"] = str(make_study(root / "study", traces=1))
    _bad_files(root / "bad", f)
    return f


def _forced_label(trace: dict) -> dict:
    """A hand-made labelled record of `trace` as the teacher-forced evictor reads it: its tokens, reasoning span,
    forced answer cue (the trace's last 4 tokens) and the reference answer's ids and log-probability."""
    ids = trace["prompt_ids"] + trace["generated_ids"]
    start, answer = len(trace["prompt_ids"]), len(ids) - 4
    return {"kind": "label", "id": trace["id"], "dataset": "gsm8k", "model": trace["model"], "status": "labelled",
            "token_ids": ids, "reasoning_start": start, "answer_start": answer, "positions": list(range(answer)),
            "labels": [0] * answer, "intervention": "token",
            "forced_cue": {"start": answer, "end": answer + 2, "text": "", "kind": "boxed", "box": True},
            "graded": {"answer_ids": ids[answer + 2:], "reference_logp": -1.0}}


def _bad_files(bad: Path, f: dict) -> None:
    bad.mkdir()
    traces = f["traces_rows"]
    plain = {
        "binary": bytes(range(256)) * 4, "latin1": "caf\xe9\n".encode("latin-1"), "empty": b"",
        "array_line": b"[1, 2, 3]\n", "corrupt": (json.dumps(traces[0]) + "\n{not json\n").encode(),
        "binary.csv": bytes(range(256)) * 4,
    }
    for name, data in plain.items():
        (bad / name).write_bytes(data)
    (bad / "dir").mkdir()

    def variant(kind: str, name: str, rows) -> None:
        _jsonl(bad / f"{kind}-{name}.jsonl", rows)

    for name, change in {"prompt_ids_string": {"prompt_ids": "hello"}, "ids_not_int": {"prompt_ids": [1.5, "a"]},
                         "out_of_vocab": {"generated_ids": [10**9]}, "id_list": {"id": ["t"]},
                         "wrong_kind": {"kind": "label"}, "duplicate_ids": {"id": "same"},
                         "too_long": {"generated_ids": [5] * 5000},
                         "evicted": {"policy": "random", "budget": 32, "eviction": {"rounds": 0}},
                         "other_model": {"model": "tiny-qwen3"}}.items():
        variant("traces", name, [{**t, **change} for t in traces])
    variant("traces", "no_id", [{k: v for k, v in t.items() if k != "id"} for t in traces])
    variant("problems", "question_list", [{"id": "a", "question": ["x"], "answer": "1"}])
    variant("problems", "no_question", [{"id": "a", "answer": "1"}])
    labels = [json.loads(line) for line in Path(f["labels"]).read_text().splitlines()]
    variant("labels", "positions_string", [{**r, "positions": "abc"} for r in labels])
    variant("labels", "length_mismatch", [{**r, "labels": [1]} for r in labels])
    signals = [json.loads(line) for line in Path(f["signals_mean"]).read_text().splitlines()]
    variant("signals", "values_strings", [{**r, "signals": {"hidden_diff": {"0": ["a"]}}} for r in signals])
    variant("signals", "length_mismatch", [{**r, "positions": [0]} for r in signals])
    for name, config in {"unknown": {"policy": "bogus", "params": {}},
                         "unknown_param": {"policy": "random", "params": {"bogus": 1}},
                         "float_for_int": {"policy": "snapkv", "params": {"window": 2.5}}, "array": [1]}.items():
        (bad / f"policy-{name}.json").write_text(json.dumps(config))
    (bad / "table-wrong_columns.csv").write_text("x,y\n1,2\n")
    (bad / "table-ranking_header_only.csv").write_text("signal,within_rho,within_t_lo,within_t_hi\n")
    (bad / "table-comparison_no_budget.csv").write_text("policy_a,policy_b,budget_a,difference,ci_lo,ci_hi,n_problems\n"
                                                        "full,random,,0.1,0.0,0.2,8\n")
    (bad / "table-header_only.csv").write_text("policy,budget,accuracy,ci_lo,ci_hi\n")
    for name, config in {"empty_config": "{}", "no_config": None}.items():
        (bad / f"model-{name}").mkdir()
        if config is not None:
            (bad / f"model-{name}" / "config.json").write_text(config)


# A valid command per CLI, each of which would run to completion on the tiny model: OUT is the case's output path,
# {name} an input of `fx`.
_FIGURE = ["--input", "{tables}/{figure}.csv", "--out", "OUT"]
_PROBE = ["--model", "{tiny}", "--n", "2", "--batch-size", "2", "--n-boot", "10", "--box", "32", "--dataset", "math500",
          "--data-file", "{data}", "--out", "OUT"]
BASES = {
    "tasks.run": ["--model", "{tiny}", "--dataset", "gsm8k", "--data-file", "{arithmetic}", "--max-new-tokens", "4",
                  "--quiet", "--out", "OUT"],
    "evictor.run": ["--model", "{tiny}", "--dataset", "gsm8k", "--data-file", "{arithmetic}", "--max-new-tokens", "4",
                    "--policy", "random", "--budget", "128", "--quiet", "--out", "OUT"],
    "labeling.occlusion": ["--traces", "{traces}", "--window", "8", "--stride", "4", "--max-answer-tokens", "4",
                           "--include-incorrect", "--out", "OUT"],
    "labeling.merge": ["{shards}"],
    "signals": ["--traces", "{traces}", "--out", "OUT/signals.jsonl"],
    "probes.passcode": [*_PROBE, "--budget", "96", "--rounds", "2"],
    "probes.planted_fact": [*_PROBE, "--budget", "128", "--heads", "none;all"],
    "geometry.survey": ["--model", "{tiny}", "--prompts", "2", "--ctx", "64", "--queries", "16", "--topk", "16",
                        "--chunk", "32", "--out", "OUT"],
    "models.memory": ["--model", "{tiny}", "--ctx", "64", "--out", "OUT"],
    "validation.parity": ["--traces", "{traces}", "--out", "OUT", "--quiet"],
    "validation.compare": ["--runs", "{dense}", "{evicted}", "--n-boot", "100", "--out", "OUT"],
    "validation.predictive": ["--ranking", "{ranking}", "--compare", "{comparison}", "--n-boot", "50", "--out", "OUT"],
    "validation.layers": ["--labels", "{labels}", "--signals", "{signals_mean}", "{signals_z}", "--n-boot", "50",
                          "--out", "OUT"],
    "validation.select": ["--labels", "{labels}", "--signals", "{signals_mean}", "{signals_z}", "--n-boot", "50",
                          "--out", "OUT"],
    "evictor.replay": ["--traces", "{traces}", "--policies", "random,h2o", "--out", "OUT/replay.jsonl"],
    "evictor.calibrate triattention": ["--traces", "{traces}", "--out", "OUT/calibration.json"],
    "evictor.calibrate thinkv": ["--traces", "{traces}", "--out", "OUT/calibration.json", "--tau", "8"],
    "evictor.policies": ["--name", "random"],
    "core.pack": ["--source", "{dense}", "--out", "OUT"],
    "study": ["--model", "{tiny}", "--dataset", "gsm8k", "--data-file", "{arithmetic}", "--max-new-tokens", "8",
              "--budget", "0.5", "--window", "8", "--stride", "4", "--max-answer-tokens", "4", "--no-force-answer",
              "--scorers", "random,h2o", "--n-boot", "50", "--compare-n-boot", "50", "--quiet", "--out", "OUT"],
    "figures.projection": ["--out", "OUT"],
    "bench.decode_throughput": ["--model", "{tiny}", "--policies", "random", "--budget", "256", "--buffer", "8",
                                "--new-tokens", "4", "--repeats", "1"],
    "bench.attention_kernels": ["--model", "{tiny}", "--policies", "h2o", "--budget", "256", "--buffer", "8",
                                "--new-tokens", "4", "--repeats", "1"],
    "bench.gpu_check": ["--small", "--context", "128", "--new-tokens", "8", "--budget", "32", "--buffer", "8",
                        "--block", "32", "--policies", "random", "--skip-check", "--prefill-ctx", "64",
                        "--prefill-out", "OUT"],
    "bench.equal_memory": ["--model", "{tiny}", "--policies", "random", "--memory-gb", "0.001", "--context", "64",
                           "--budget", "16", "--buffer", "4", "--block", "16", "--new-tokens", "8", "--max-batch",
                           "2", "--out", "OUT"],
    "bench.prefill_memory": ["--ctx", "64", "--layers", "1", "--target-layers", "2", "--device", "cpu", "--dtype",
                             "float32", "--out", "OUT"],
    "bench.generation_throughput": ["--models", "{tiny}", "--settings", "hf-1", "--problems", "2",
                                    "--max-new-tokens", "4", "--data-file", "{arithmetic}", "--out", "OUT"],
    "bench.occlusion_speed": ["--traces", "{traces}", "--model", "{tiny}", "--window", "8", "--stride", "4",
                              "--max-answer-tokens", "4", "--batch-size", "4", "--json", "OUT/speed.json"],
    "bench.labelling_engines": ["--traces", "{traces}", "--include-incorrect", "--max-answer-tokens", "4",
                                "--out", "OUT"],
    "evictor.teacher_forced": ["--labels", "{forced_labels}", "--policy", "random,h2o", "--budget", "0.5",
                               "--out", "OUT"],
    "validation.label_kinds": ["--labels", "token={forced_labels}", "--out", "OUT"],
    "figures.trace": ["--study", "{study}", "--out", "OUT/viewer.html"],
    "bench.label_kinds": ["--traces", "{traces}", "--model", "{tiny}", "--limit", "2", "--repeats", "1",
                          "--variants", "token", "--max-answer-tokens", "4"],
    "bench.kvpress_compare kept": ["--model", "tiny-llama", "--ctx", "128", "--ratio", "0.5", "--methods",
                                   "snapkv", "--out", "OUT/jaccard.csv"],
    "bench.kvpress_compare speed": ["--target", "64", "--interval", "8", "--new-tokens", "8", "--repeats", "1"],
    **{f"figures.{name}": [a.replace("{figure}", name) for a in _FIGURE]
       for name in ("layer_rho", "raw_vs_z", "sink_ratio", "bos_ratio", "layer_geometry", "accuracy_budget",
                    "cost_budget", "prefill_memory", "head_sets", "forest")},
}
# What an --out can be that is wrong: for a directory output, and for a file output (OUT/<name>).
DIRECTORY_OUTS = ["out:file", "out:below_file", "out:unwritable", "out:other_run", "out:in_use", "out:long_name"]
FILE_OUTS = ["out:dir", "out:below_file", "out:unwritable", "out:other_run", "out:in_use", "out:long_name"]
# Outputs another run's may share: a calibration file is one file written atomically, replacing what was there, with
# no lock to share, and a committed folder (core.pack) is brought up to date, keeping what the source lacks. (A
# figure directory holds many figures, but never another run's results.)
SHARED_OUTS = {"evictor.calibrate triattention": {"out:other_run", "out:in_use"},
               "bench.kvpress_compare kept": {"out:other_run", "out:in_use"},
               "core.pack": {"out:other_run", "out:in_use"},
               "evictor.calibrate thinkv": {"out:other_run", "out:in_use"},
               # the viewer is one page written atomically over the last one, as a figure is
               "figures.trace": {"out:other_run", "out:in_use"}}


def output_file(cli: str) -> str | None:
    """The file name a CLI writes as --out (OUT/<name> in its command), or None for a directory output."""
    base = BASES.get(cli, [])
    out = next((a for a in base if a.startswith("OUT/")), None)
    return out.removeprefix("OUT/") if out else None


def resolve(value: str, f: dict, work: Path, cli: str) -> tuple[str, contextlib.AbstractContextManager]:
    """A table value as the text given to the flag, and what must stay held while the command runs (a lock)."""
    held = contextlib.nullcontext()
    bad = f["root"] / "bad"
    kind, _, name = value.partition(":")
    if kind == "file":
        if name == "missing":
            return str(work / "missing.jsonl"), held
        return (str(work / LONG_NAME) if name in ("long_name", LONG_NAME) else str(bad / name)), held
    if kind in ("traces", "problems", "labels", "signals"):
        return str(bad / f"{kind}-{name}.jsonl"), held
    if kind == "policy":
        return str(bad / f"policy-{name}.json"), held
    if kind in ("table", "model"):
        return str(bad / f"{kind}-{name}"), held
    if kind == "out":
        return _out(name, work, output_file(cli))
    return value, held


def _out(kind: str, work: Path, name: str | None) -> tuple[str, contextlib.AbstractContextManager]:
    """The --out of an ``out:`` case: a directory output's directory, or the file `name` in it."""
    out = work / "out"
    held = contextlib.nullcontext()
    if kind == "long_name":
        return (str(out / f"{LONG_NAME}{Path(name).suffix}") if name else str(work / LONG_NAME)), held
    if kind in ("file", "dir"):
        out.mkdir() if kind == "dir" else out.write_text("not a run\n")
        return str(out), held
    if kind == "below_file":
        out.write_text("x")
    elif kind == "unwritable":
        if os.geteuid() == 0:  # root writes wherever a directory can be made; /proc takes no new entries
            out = Path("/proc/kvscope-fuzz")
        else:
            work.chmod(0o500)
            held = _restore_mode(work)
    elif kind == "other_run":
        out.mkdir()
        stem = Path(name).stem if name else None
        config = f"{stem}.config.json" if stem else "config.json"
        (out / config).write_text(json.dumps({"identity": {"made_by": "another stage"}}))
    elif kind == "in_use":
        out.mkdir()
        held = _locks(out, Path(name).stem if name else None)
    return str(out / name) if name else str(out / "below") if kind == "below_file" else str(out), held


@contextlib.contextmanager
def _restore_mode(path: Path):
    try:
        yield
    finally:
        path.chmod(0o700)


@contextlib.contextmanager
def _locks(out: Path, stem: str | None):
    """Another run holding `out` (for a file output, the lock kept beside the file `stem`)."""
    run = RunDir(out, {"holder": "another run"}, config_name="held.json",
                 **({"lock_name": f".{stem}.lock"} if stem else {}))
    run.claim()
    try:
        yield
    finally:
        run.release()


def substitute(argv: list[str], flag: str, value: str, action: argparse.Action) -> list[str]:
    """`argv` with `flag` set to `value` (added when absent; every value of a multi-valued flag replaced);
    ``=duplicate`` gives a list option one item twice (its first value in `argv`, else one its type takes)."""
    if value == "=given":
        return [*argv, f"{flag}=x"]
    if value == "=duplicate":
        item = argv[argv.index(flag) + 1] if flag in argv else "1" if action.type is not None else "x"
        argv = substitute(argv, flag, item, action)
        return [*argv, flag, item] if isinstance(action, argparse._AppendAction) else [*argv, item]
    if not action.option_strings:  # a positional
        return [value]
    argv = list(argv)
    if flag in argv:
        start = argv.index(flag)
        end = start + 1
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1
        del argv[start:end]
    count = action.nargs if isinstance(action.nargs, int) else 1
    return [*argv, *([f"{flag}={value}"] if value.startswith("-") and count == 1 else [flag] + [value] * count)]


def snapshot(root: Path) -> dict[str, str]:
    state = {}
    for path in sorted(root.rglob("*")):
        with contextlib.suppress(OSError):
            state[str(path.relative_to(root))] = "dir" if path.is_dir() else hashlib.sha1(path.read_bytes()).hexdigest()
    return state


def names(line: str, value: str) -> bool:
    """Whether an error line names the bad value: the whole text, a path's file name, or the bad part of a compound
    value (a list item, a dataset name before its @length)."""
    parts = [part for part in re.split(r"[,;@:=]", value) if part.strip()]
    return value in line or Path(value).name in line or any(part in line for part in parts)


# ---------------------------------------------------------------------------------------------------- the tests
CASES = [pytest.param(cli, flag_of(action), value, id=f"{cli}|{flag_of(action)}={value}")
         for cli, (_, _, parser) in PARSERS.items() for action in options(parser)
         for value in invalid_values(cli, action)]


def test_every_cli_is_found():
    clis, unguarded = find_clis()
    assert {"tasks.run", "evictor.run", "labeling.occlusion", "study.__main__", "figures.forest"} <= set(clis)
    assert set(unguarded) == INTERNAL, "a module with a __main__ block whose main is not core.cli.main_guard's"


def test_every_cli_has_a_valid_command():
    missing = sorted(set(PARSERS) - set(BASES))
    assert not missing, f"add a valid command for {missing} to BASES in this file"


def test_every_option_has_invalid_values():
    untested = [f"{cli} {flag_of(action)}" for cli, (_, _, parser) in PARSERS.items() for action in options(parser)
                if not invalid_values(cli, action) and action.dest not in FREE]
    assert not untested, f"give these options invalid values in TYPE_VALUES or NAMED_VALUES: {untested}"


def test_every_list_option_refuses_duplicates():
    """A list naming an item twice (a budget, a layer, a policy, a file) is refused: a list option given as several
    values gets ``=duplicate``; one given in one comma- or ';'-separated value needs a value repeating an item."""
    missing = [f"{cli} {flag_of(action)}" for cli, (_, _, parser) in PARSERS.items() for action in options(parser)
               if takes_text_list(action) and not any(repeats_an_item(v) for v in invalid_values(cli, action))]
    assert not missing, f"give these list options a value naming an item twice in NAMED_VALUES: {missing}"


def loads_a_model(parser: argparse.ArgumentParser) -> bool:
    return any(action.dest in ("model", "models", "traces", "device") for action in options(parser))


def test_every_cli_that_loads_a_model_checks_its_memory():
    """A CLI that loads a model has ``--max-memory`` (`core.cli.add_device_arguments` adds it beside --device), so the
    memory class (`TYPE_VALUES["memory_size"]`: a limit below any request) reaches it."""
    missing = [cli for cli, (_, _, parser) in PARSERS.items()
               if loads_a_model(parser) and not any(action.dest == "max_memory" for action in options(parser))]
    assert not missing, f"check the memory of these CLIs before they start and give them --max-memory: {missing}"


def command(cli: str, work: Path, fx: dict) -> list[str]:
    """`cli`'s valid command (`BASES`) with its output under `work` and its inputs from `fx`."""
    return [str(work / "out") + a.removeprefix("OUT") if a.startswith("OUT") else a.format(**fx) for a in BASES[cli]]


def assert_refused(module: str, argv: list[str], work: Path, fx: dict, capsys,
                   held: contextlib.AbstractContextManager | None = None) -> str:
    """Run `module`'s main on `argv` (while `held` is held) and check the contract: exit status 2, one line on stderr
    and no traceback, nothing written or changed under `work` nor among the inputs; returns the line."""
    inputs_before = snapshot(fx["root"])
    with held or contextlib.nullcontext():
        before = snapshot(work)
        status = importlib.import_module(module).main(argv)
        after = snapshot(work)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert status == 2, f"exit {status}: {err[-2000:]}"
    assert len(lines) == 1, err
    assert after == before, "files were left or changed"
    assert snapshot(fx["root"]) == inputs_before, "an input was changed"
    return lines[0]


@pytest.mark.parametrize("cli, flag, value", CASES)
def test_an_invalid_value_is_refused_in_one_line(cli, flag, value, fx, tmp_path, monkeypatch, capsys):
    module, prefix, parser = PARSERS[cli]
    action = next(a for a in options(parser) if flag_of(a) == flag)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    given, held = resolve(value, fx, work, cli)
    base = command(cli, work, fx)
    if action.dest == "dataset" and "--data-file" in base:  # a data file stands in for the dataset: read its name
        del base[base.index("--data-file"):base.index("--data-file") + 2]
    argv = [*prefix, *substitute(base, flag, given, action)]
    line = assert_refused(module, argv, work, fx, capsys, held)
    named = flag if value in ("=given", "=duplicate") else given
    assert names(line, named), f"the error does not name {named!r}: {line}"


# ---------------------------------------------------------------------------------------------------- Ray workers
BACKEND_CLIS = [cli for cli, (_, _, parser) in PARSERS.items() if any(a.dest == "backend" for a in options(parser))]
# What Ray cannot schedule on this machine: more workers than its cores take, and a reservation below Ray's step.
UNSCHEDULABLE = {"too_many_workers": ["--workers", "4096", "--cpus-per-worker", "0.0004"],
                 "below_ray_step": ["--cpus-per-worker", "0.00004"]}


@pytest.mark.parametrize("cli", BACKEND_CLIS)
@pytest.mark.parametrize("kind", UNSCHEDULABLE)
def test_ray_workers_the_machine_cannot_schedule_are_refused_before_ray_starts(cli, kind, fx, tmp_path, monkeypatch,
                                                                               capsys):
    pytest.importorskip("ray")
    import ray

    module, prefix, _ = PARSERS[cli]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    line = assert_refused(module, [*prefix, *command(cli, work, fx), "--backend", "ray", *UNSCHEDULABLE[kind]],
                          work, fx, capsys)
    assert ("--workers" if kind == "too_many_workers" else "--cpus-per-worker") in line, line
    assert not ray.is_initialized()


# ---------------------------------------------------------------------------------------------------- damaged resume
class _FirstStore(Exception):
    """Raised by `RunDir.store` while a CLI's first store is being found: the run stops there."""


def imports(module: str, seen: set[str] | None = None) -> set[str]:
    """`module` and every kvscope module it imports, at module level or inside functions, transitively."""
    seen = set() if seen is None else seen
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    if module in seen or not path.is_file():
        package = ROOT / Path(*module.split(".")) / "__init__.py"
        if module in seen or not package.is_file():
            return seen
        path = package
    seen.add(module)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names_ = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:  # a module, or names of one
            names_ = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            names_ = []
        for name in names_:
            if name.split(".")[0] in PACKAGES:
                imports(name, seen)
    return seen


def stores_records(module: str) -> bool:
    """Whether `module` or a module it imports calls ``.store(...)`` (`core.rundir.RunDir.store`): a CLI that may
    resume. Which file it stores first is found by running it (`first_store`)."""
    for name in imports(module):
        path = ROOT / Path(*name.split(".")).with_suffix(".py")
        path = path if path.is_file() else ROOT / Path(*name.split(".")) / "__init__.py"
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "store"
               for node in ast.walk(tree)):
            return True
    return False


RESUMABLE = [cli for cli, (module, _, _) in PARSERS.items() if stores_records(module)]
# The damage a resume refuses: a record without its key, a line that is a JSON array, a corrupt line that is not the
# last (a torn last line is what a crash leaves and is repaired; one followed by another record is not).
DAMAGES = {"record_without_id": b'{"kind": "record"}\n', "array_line": b"[1, 2, 3]\n",
           "corrupt_middle_line": b'{"id": "a", "ki\n{"id": "b"}\n'}


@pytest.fixture(scope="module")
def first_stores(fx, tmp_path_factory):
    """CLI -> the file its valid command stores records in first, relative to its work directory (None: it stored
    none), found by running the command until `core.rundir.RunDir.store` is called."""
    found: dict[str, str | None] = {}

    def first_store(cli: str) -> str | None:
        if cli in found:
            return found[cli]
        from core.rundir import RunDir

        work = tmp_path_factory.mktemp("first-store")
        module, prefix, _ = PARSERS[cli]
        opened = []

        def store(self, name, key="id"):
            opened.append(str((self.path / name).relative_to(work)))
            raise _FirstStore

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RunDir, "store", store)
            patch.chdir(work)
            with contextlib.suppress(_FirstStore):
                importlib.import_module(module).main([*prefix, *command(cli, work, fx)])
        found[cli] = opened[0] if opened else None
        return found[cli]

    return first_store


def test_every_cli_that_stores_records_is_resumable_here():
    assert {"tasks.run", "evictor.run", "labeling.occlusion", "signals", "probes.passcode", "probes.planted_fact",
            "geometry.survey", "validation.parity", "evictor.replay", "study"} <= set(RESUMABLE)


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("cli", RESUMABLE)
def test_a_resume_over_a_damaged_output_is_refused_and_touches_nothing(cli, damage, first_stores, fx, tmp_path,
                                                                       monkeypatch, capsys):
    stored = first_stores(cli)
    capsys.readouterr()  # what finding the first store printed
    if stored is None:
        pytest.skip(f"{cli}'s valid command stores no record")
    module, prefix, _ = PARSERS[cli]
    work = tmp_path / "work"
    (work / stored).parent.mkdir(parents=True)
    (work / stored).write_bytes(DAMAGES[damage])
    monkeypatch.chdir(work)
    line = assert_refused(module, [*prefix, *command(cli, work, fx)], work, fx, capsys)
    assert Path(stored).name in line and "resume" in line, line


# ---------------------------------------------------------------------------------------------------- restore
@pytest.mark.parametrize("damage", ["not_gzip", "torn_gzip"])
def test_a_restore_of_a_damaged_gzip_is_refused_and_writes_nothing(damage, fx, tmp_path, monkeypatch, capsys):
    """`core.pack --restore` checks every .gz whole before writing the first file (files of the wrong kind)."""
    import gzip

    source, work = tmp_path / "committed", tmp_path / "work"
    source.mkdir()
    work.mkdir()
    (source / "config.json").write_text("{}\n")  # written first, were the damage found late
    whole = gzip.compress(b'{"id": "a"}\n' * 100)
    (source / "generations.jsonl.gz").write_bytes(whole[: len(whole) // 2] if damage == "torn_gzip" else b"text\n")
    monkeypatch.chdir(work)
    line = assert_refused("core.pack", ["--restore", "--source", str(source), "--out", str(work / "out")], work, fx,
                          capsys)
    assert "generations.jsonl.gz" in line, line
