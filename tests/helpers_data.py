"""The scripts in tests/data that wrote the committed run folders, loaded as modules: a test reads
the settings those folders were written with from the one place that wrote them."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

DATA = Path(__file__).with_name("data")


def data_script(name: str) -> ModuleType:
    """tests/data/NAME.py as a module (not run as a script: its main guard stays shut)."""
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
