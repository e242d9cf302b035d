"""The scripts in tests/data that wrote the committed run folders, loaded as modules: a test reads
the settings those folders were written with from the one place that wrote them."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

DATA = Path(__file__).with_name("data")


def data_script(name: str) -> ModuleType:
    """tests/data/NAME.py as a module (not run as a script: its main guard stays shut)."""
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def close_to(value, expected) -> bool:
    """Equal, floats to float32 rounding (another CPU's vector sums round differently), through lists:
    how a folder resumed by today's code is compared with a run made today."""
    if isinstance(value, float) or isinstance(expected, float):
        return value == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if isinstance(value, list) and isinstance(expected, list):
        return len(value) == len(expected) and all(map(close_to, value, expected))
    return value == expected


def assert_rows_close(rows: list[dict], expected: list[dict], count: str) -> None:
    """The rows of a resumed folder against an uninterrupted run's, ``count`` (generation or step)
    by ``count``: the same keys, values ``close_to``."""
    assert [r[count] for r in rows] == [r[count] for r in expected]
    for row, want in zip(rows, expected):
        assert row.keys() == want.keys(), row[count]
        assert all(close_to(row[k], want[k]) for k in row), [k for k in row if not close_to(row[k], want[k])]
