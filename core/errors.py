"""User-facing errors shared by every kvscope CLI.

A `UsageError` is bad input the user can fix (an unknown name, a value out of range). CLIs catch it in
`core.cli.main_guard`, print its single line and exit with status 2, so no stack trace reaches the user.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UsageError(ValueError):
    """Bad input: one clear line naming the bad value and the valid choices."""


def unknown_choice(kind: str, value: str, choices: Iterable[str]) -> UsageError:
    """An error for `value` not among `choices`, with a did-you-mean hint when one is close."""
    choices = sorted(choices)
    close = difflib.get_close_matches(value, choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UsageError(f"unknown {kind} {value!r}{hint}; valid choices: {', '.join(choices)}")
