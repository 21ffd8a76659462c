"""Which policies a run uses: a CLI value (one name, a comma list or ``all``) and policy configuration files.

``all`` is every registered policy (`evictor.policies`) but the calibrated ones no configuration file configures,
since they cannot run without their per-model calibration (`evictor.calibration`); `evictor.run`, `evictor.replay`
and the study choose their policies through here, so they refuse the same values in the same words.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core.cli import distinct
from core.errors import UsageError, unknown_choice
from core.schemas import check_field_types
from evictor.calibration import CalibratedPolicy, calibrate_command
from evictor.policies import POLICIES, get_policy, policy_names
from scoring.policy import Policy


def choose_policies(text: str, flag: str = "--policy") -> list[str]:
    """Registered policy names from a CLI value: one name, a comma list or 'all'; an unknown name is a `UsageError`
    with a did-you-mean hint, a name given twice one too."""
    names = policy_names()
    if text.strip() == "all":
        return names
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    if not chosen:
        raise UsageError(f"no policy in {text!r}; give a name, a comma list or 'all'")
    if len(chosen) != len(text.split(",")):
        raise UsageError(f"policy list {text!r} has an empty name; separate the names by single commas")
    for name in chosen:
        if name not in names:
            raise unknown_choice("policy", name, names)
    distinct(flag, text, chosen)
    return chosen


def read_policy_config(path: str | os.PathLike, flag: str = "--policy-config") -> tuple[str, dict[str, Any]]:
    """``(policy name, params)`` of a policy configuration file ``{"policy": name, "params": {...}}`` (what
    validation writes and `evictor.run` / `evictor.replay` read), refusing in one line a missing or malformed file
    and an unknown policy name."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{flag} {str(path)!r} does not exist")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise UsageError(f"{flag} {str(path)!r} is not valid JSON ({err})") from None
    if not isinstance(config, dict) or "policy" not in config or not isinstance(config.get("params", {}), dict):
        raise UsageError(f'{flag} {str(path)!r} must be {{"policy": name, "params": {{...}}}}')
    names = policy_names()
    if config["policy"] not in names:
        raise UsageError(f"{flag} {str(path)!r}: {unknown_choice('policy', str(config['policy']), names)}")
    configured_policy(config["policy"], config.get("params", {}), f"{flag} {str(path)!r}")  # refused here, named
    return config["policy"], dict(config.get("params", {}))


def read_policy_configs(paths: Sequence[str], flag: str = "--policy-config") -> dict[str, dict[str, Any]]:
    """Policy name -> parameters, from policy configuration files (`read_policy_config`), one file per policy."""
    params: dict[str, dict[str, Any]] = {}
    for path in paths:
        name, values = read_policy_config(path, flag)
        if name in params:
            raise UsageError(f"{flag} {str(path)!r} configures {name!r} a second time; give one file per policy")
        params[name] = values
    return params


def calibrated_policies(names: Sequence[str]) -> list[str]:
    """The registered policies among `names` that need a per-model calibration file (`evictor.calibration`)."""
    return [name for name in names if issubclass(POLICIES[name], CalibratedPolicy)]


def select_policies(text: str | None, configured: Mapping[str, Any],
                    flag: str = "--policy") -> tuple[list[str], list[str]]:
    """(the policies `text` names, those ``all`` left out): ``all`` is every registered policy but the calibrated
    ones no policy configuration file configures (`configured`), since they cannot run without their calibration.
    A configured policy that `text` does not name is added: a configuration file given is a policy to run."""
    if not text:
        raise UsageError(f"give {flag} (a name, a comma list or 'all') or --policy-config")
    names = choose_policies(text, flag)
    names += [name for name in configured if name not in names]
    if text.strip() != "all":
        return names, []
    left_out = [name for name in calibrated_policies(names) if name not in configured]
    return [name for name in names if name not in left_out], left_out


def left_out_line(left_out: Sequence[str], flag: str = "--policy") -> str:
    """One line naming the calibrated policies ``all`` left out and how to include them."""
    calls = []
    for name in left_out:
        policy = POLICIES[name]
        assert issubclass(policy, CalibratedPolicy)  # `all` leaves out calibrated policies only
        calls.append(f"`{calibrate_command(policy.method)}`")
    commands = "; ".join(calls)
    return (f"{flag} all leaves out {', '.join(left_out)}: each needs a per-model calibration file ({commands}); "
            'include one with --policy-config FILE holding {"policy": NAME, "params": {"calibration": "CALIBRATION '
            'FILE"}}')


def configured_policy(name: str, params: dict[str, Any], flag: str = "--policy-config") -> Policy:
    """`get_policy` with parameters from a file: an unknown parameter name, or a value of another type than the
    parameter's (2.5 for an integer), is a one-line `UsageError`."""
    if name in POLICIES:
        check_field_types(POLICIES[name], params, f"{flag}: {name}", finite=True)
    try:
        return get_policy(name, **params)
    except TypeError as err:
        raise UsageError(f"{flag}: {name}: {err}") from None
