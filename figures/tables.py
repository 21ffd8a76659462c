"""Reading and checking the tables the figures are drawn from.

Every plotting function validates its input before drawing anything, so bad input is one clear `UsageError`
(exit status 2 in the CLIs) and never an empty or half-drawn panel.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from core.errors import UsageError
from core.records import read_jsonl

TABLE_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl")


def read_table(path: str | os.PathLike) -> pd.DataFrame:
    """A table from CSV, TSV, JSON (a list of records or a dict of columns) or JSONL (one record per line)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"input table {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise UsageError(f"input table {str(path)!r} has unknown type {suffix!r}; valid: {', '.join(TABLE_SUFFIXES)}")
    try:
        if suffix in (".csv", ".tsv"):
            return pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",")
        if suffix == ".jsonl":
            return pd.DataFrame(list(read_jsonl(path)))
        return pd.DataFrame(json.loads(path.read_text()))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, json.JSONDecodeError, ValueError) as err:
        if isinstance(err, UsageError):
            raise
        raise UsageError(f"cannot read input table {str(path)!r}: {str(err).splitlines()[0]}") from None


def as_frame(data, figure: str) -> pd.DataFrame:
    """A copy of `data` (DataFrame, dict of columns or list of records) as a DataFrame."""
    if isinstance(data, pd.DataFrame):
        return data.copy()
    if isinstance(data, (Mapping, list, tuple)):
        try:
            return pd.DataFrame(data)
        except ValueError as err:
            raise UsageError(f"{figure}: input is not a table ({err})") from None
    raise UsageError(f"{figure}: input must be a pandas DataFrame, a dict of columns or a list of records, "
                     f"got {type(data).__name__}")


def checked(
    data,
    figure: str,
    *,
    required: Sequence[str],
    numeric: Iterable[str] = (),
    finite: Iterable[str] = (),
) -> pd.DataFrame:
    """`data` as a DataFrame with the `required` columns, `numeric` columns converted, rows lacking `finite` dropped.

    Missing columns, a non-numeric value in a numeric column, and a table that is empty (before or after dropping
    rows whose `finite` columns are NaN or infinite) are `UsageError`s naming the figure.
    """
    df = as_frame(data, figure)
    missing = [c for c in required if c not in df.columns]
    if missing:
        have = ", ".join(map(str, df.columns)) or "none"
        raise UsageError(f"{figure}: input lacks column(s) {', '.join(missing)}; needs {', '.join(required)} "
                         f"(has: {have})")
    if df.empty:
        raise UsageError(f"{figure}: input table has no rows")
    for column in numeric:
        if column not in df.columns:
            continue
        converted = pd.to_numeric(df[column], errors="coerce")
        bad = df[column][converted.isna() & df[column].notna()]
        if not bad.empty:
            raise UsageError(f"{figure}: column {column!r} must be numeric, got {bad.iloc[0]!r}")
        df[column] = converted.astype(float)
    finite = [c for c in finite if c in df.columns]
    if finite:
        df = df[np.isfinite(df[finite].to_numpy(dtype=float)).all(axis=1)]
        if df.empty:
            raise UsageError(f"{figure}: no row has finite values in {', '.join(finite)}")
    return df.reset_index(drop=True)


def require_unique(df: pd.DataFrame, keys: Sequence[str], figure: str) -> None:
    """One row per `keys` combination; a duplicate would draw two values at one point."""
    dup = df[df.duplicated(list(keys), keep=False)]
    if not dup.empty:
        first = ", ".join(f"{k}={dup.iloc[0][k]!r}" for k in keys)
        raise UsageError(f"{figure}: several rows for {first}; expected one row per ({', '.join(keys)})")


def require_range(df: pd.DataFrame, column: str, low: float, high: float, figure: str) -> None:
    values = df[column].dropna()
    outside = values[(values < low) | (values > high)]
    if not outside.empty:
        raise UsageError(f"{figure}: column {column!r} must lie in [{low}, {high}], got {outside.iloc[0]!r}")


def require_ci(df: pd.DataFrame, value: str, figure: str, low: str | None = None, high: str | None = None) -> None:
    """Each interval must contain its estimate; NaN bounds (an undefined interval) are allowed.

    The bounds are the columns `low` and `high`, by default ``<value>_lo`` and ``<value>_hi`` (`core.schemas`).
    """
    low, high = low or f"{value}_lo", high or f"{value}_hi"
    both = df[[value, low, high]].dropna()
    bad = both[(both[low] > both[value] + 1e-12) | (both[high] < both[value] - 1e-12)]
    if not bad.empty:
        row = bad.iloc[0]
        raise UsageError(f"{figure}: interval [{row[low]}, {row[high]}] does not contain {value}={row[value]}")


def as_bool(series: pd.Series, column: str, figure: str) -> pd.Series:
    """Booleans from bool / 0-1 / "true"-"false" values (CSV round-trips turn bools into strings)."""
    mapping = {"true": True, "false": False, "1": True, "0": False, "1.0": True, "0.0": False, "yes": True, "no": False}
    out = []
    for value in series:
        if isinstance(value, (bool, np.bool_)):
            out.append(bool(value))
        elif str(value).strip().lower() in mapping:
            out.append(mapping[str(value).strip().lower()])
        else:
            raise UsageError(f"{figure}: column {column!r} must be true/false, got {value!r}")
    return pd.Series(out, index=series.index, dtype=bool)


def in_order(values: Iterable) -> list:
    """Distinct values in order of first appearance (series keep the order the caller wrote them in)."""
    return list(dict.fromkeys(values))
