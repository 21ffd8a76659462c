"""The policy and signal registries: they find every registration of their package's modules, list them in a stable
order, and take a scorer from anywhere. A policy and a signal defined in this file alone are listed, run in the
evictor and computed by signal extraction on the tiny model like the built-in ones, then unregistered."""

from __future__ import annotations

import ast
import json
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import evictor.policies
import signals
from core.errors import UsageError
from evictor.engine import EvictionEngine
from evictor.policies import POLICIES, get_policy, policy_names, register_policy
from evictor.policies.__main__ import main as list_policies
from evictor.policy import choose_policies
from evictor.protocol import EvictionConfig
from models.hooks import capture
from scoring.policy import Policy, ScoreInputs
from scoring.registry import Registry
from scoring.signal import READS, KVSignal
from signals import SIGNALS, check_signals, default_signals, register_signal
from signals.extract import stream_signals, teacher_forced_signals

pytestmark = pytest.mark.usefixtures("one_thread")

POLICY, SIGNAL = "kvscope_test_newest", "kvscope_test_key_sum"


def _registered_in(package, decorator: str) -> dict[str, str]:
    """Name -> module of every ``@<decorator>("name")`` in the package's files, read from the source."""
    found = {}
    for path in sorted(Path(package.__path__[0]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == decorator:
                found[node.args[0].value] = f"{package.__name__}.{path.stem}"
    return found


@pytest.mark.parametrize("registry, package, decorator", [(POLICIES, evictor.policies, "register_policy"),
                                                          (SIGNALS, signals, "register_signal")],
                         ids=["policies", "signals"])
def test_a_registry_holds_every_registration_its_package_makes(registry, package, decorator):
    written = _registered_in(package, decorator)
    assert written and {name: registry[name].__module__ for name in registry} == written


def test_policies_are_listed_by_module_name_then_definition_order():
    modules = [POLICIES[name].__module__ for name in policy_names()]
    assert modules == sorted(modules)
    public = {f"evictor.policies.{m.name}" for m in pkgutil.iter_modules(evictor.policies.__path__)
              if not m.name.startswith("_")}
    assert set(modules) == public  # every public module defines a policy
    source = Path(evictor.policies.__path__[0], "baselines.py").read_text()
    baselines = [name for name in policy_names() if POLICIES[name].__module__ == "evictor.policies.baselines"]
    assert baselines == sorted(baselines, key=lambda name: source.index(f'@register_policy("{name}")'))


def test_signals_are_listed_by_what_they_read_then_module():
    places = [(READS.index(SIGNALS[name].reads), SIGNALS[name].__module__) for name in SIGNALS]
    assert places == sorted(places)
    assert list(SIGNALS)[0] == "hidden_diff" and default_signals() == tuple(
        name for name in SIGNALS if SIGNALS[name].reads != "attention")


def test_an_unknown_name_is_one_line_naming_the_nearest():
    for make, typo, nearest in ((get_policy, "valudiff", "valuediff"), (SIGNALS.create, "key_nrom", "key_norm")):
        with pytest.raises(UsageError, match=f"did you mean '{nearest}'") as err:
            make(typo)
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="did you mean 'key_norm'"):
        check_signals(["key_nrom"])


def test_a_registry_refuses_a_name_twice():
    registry = Registry("thing", "scoring")

    @registry.register("one")
    class One:
        pass

    with pytest.raises(ValueError, match="thing 'one' registered twice"):
        registry.register("one")(type("Other", (), {}))
    assert list(registry) == ["one"] and registry["one"] is One and One.name == "one"


@pytest.fixture
def newest_policy():
    """A policy defined here alone: it keeps the newest candidates, as `recency` does, but per head."""

    @register_policy(POLICY)
    @dataclass
    class KeepNewest(Policy):
        citation = "kvscope's registry test: s_i = i"
        default_protection = "prompt"

        def score(self, inputs: ScoreInputs) -> torch.Tensor:
            return inputs.positions.float()

    yield KeepNewest
    POLICIES.unregister(POLICY)


def test_a_policy_from_outside_the_package_is_listed_and_runs_in_the_evictor(newest_policy, tiny_llama, capsys):
    assert policy_names()[-1] == POLICY and POLICY in choose_policies("all")
    assert list_policies(["--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert listed[POLICY]["citation"] == newest_policy.citation and listed[POLICY]["fa_compatible"]
    prompt = list(range(40, 60))
    config = EvictionConfig(budget=28, buffer=4)
    ours = EvictionEngine(tiny_llama, POLICY, config).generate([prompt], 24)
    recency = EvictionEngine(tiny_llama, "recency", config).generate([prompt], 24)
    assert ours.stats["decode_rounds"] > 0
    assert ours.sequences[0].generated_ids == recency.sequences[0].generated_ids


def test_the_policy_is_gone_once_unregistered():
    assert POLICY not in POLICIES and POLICY not in policy_names()
    with pytest.raises(UsageError, match="unknown policy"):
        get_policy(POLICY)


@pytest.fixture
def key_sum_signal():
    """A signal defined here alone: the sum of each cached key's entries, averaged over the KV heads."""

    @register_signal(SIGNAL)
    class KeySum(KVSignal):
        def per_head(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            return keys.float().sum(-1)

    yield KeySum
    SIGNALS.unregister(SIGNAL)


def test_a_signal_from_outside_the_package_is_extracted_like_the_built_in_ones(key_sum_signal, tiny_llama):
    assert SIGNAL in default_signals() and check_signals([SIGNAL]) == [SIGNAL]
    ids = list(range(30, 50))
    got = teacher_forced_signals(tiny_llama, ids, [1, 3], [SIGNAL, "hidden_diff"])
    assert list(got) == ["hidden_diff", SIGNAL]  # the residual stream's signals before the cache's
    model = tiny_llama.model
    from transformers import DynamicCache

    with torch.no_grad(), capture(model, ["blocks.3.attn.hook_cache_k"]) as cap:
        model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=model.config), use_cache=True)
    assert torch.allclose(got[SIGNAL][3], cap["blocks.3.attn.hook_cache_k"].sum(-1).mean(1), atol=1e-5)
    result, streamed = stream_signals(tiny_llama, ids, 8, [1], [SIGNAL])
    forwarded = ids + result.generated_ids[:-1]
    forced = teacher_forced_signals(tiny_llama, forwarded, [1], [SIGNAL])
    assert torch.allclose(streamed[SIGNAL][1], forced[SIGNAL][1], atol=1e-5)


def test_the_signal_is_gone_once_unregistered():
    assert SIGNAL not in SIGNALS and SIGNAL not in default_signals()
    with pytest.raises(UsageError, match="unknown signal"):
        check_signals([SIGNAL])
