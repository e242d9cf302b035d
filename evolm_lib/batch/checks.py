"""The checks of a grid point before any kernel starts, running no notebook code: parameter types,
the settings the notebook's config cell would build, and the engine limits of those settings."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

from ..config import config_class
from ..parameters import notebook_config
from ..paths import project_root
from .notebooks import NotebookInfo, error_text

# papermill's inferred type names -> the Python types a value given for them may have
TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "dict": (dict,), "list": (list,)}


def check_types(parameters: dict[str, Any], declared: dict[str, dict[str, Any]]) -> list[str]:
    """Parameters whose values do not have their declared type (None is always allowed: YAML's null)."""
    wrong = []
    for name, value in parameters.items():
        type_name = declared.get(name, {}).get("inferred_type_name")
        allowed = TYPES.get(type_name)
        if allowed is None or value is None:
            continue
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            wrong.append(f"{name}: expected {type_name} (declared `{name}: {type_name}`), got {value!r}")
    return wrong


def check_point(info: NotebookInfo, parameters: dict[str, Any], cwd: Path | None = None) -> tuple[Any, str, list[str]]:
    """Check one grid point as its kernel will see it, running no notebook code: its parameters against
    their declared types, then (a notebook tagged `settings:<kind>`) the settings its config cell builds
    from them (`evolm_lib.parameters.notebook_config` over the declared defaults and the point's values),
    then the engine limits of those settings (`evolm_lib.preflight`, when the model folder exists
    without a build). Returns (settings or None, error text or "", warnings)."""
    wrong = check_types(parameters, info.declared)
    if wrong:
        return None, "TypeError: " + "; ".join(wrong), []
    if info.kind is None:
        return None, "", []
    from ..preflight import EngineWarning

    values = {**info.defaults, **parameters}
    # relative paths (a JSONL task's file) are read from the kernel's working directory
    with contextlib.chdir(cwd or project_root()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = notebook_config(config_class(info.kind), values)
            _check_engine(config)
        except Exception as err:  # noqa: BLE001 - reported as the point's error, as the kernel would raise it
            return None, error_text(err), []
    return config, "", [str(w.message) for w in caught if issubclass(w.category, EngineWarning)]


def _check_engine(config) -> None:
    """Sizes this machine can hold (``preflight.check_run_sizes``, with or without the model's folder), then
    the engine limits of a run's settings, when its model is already a local folder (no build or download here)."""
    from ..models import cached_model_dir
    from ..preflight import check_engine_settings, check_run_sizes

    model_dir = cached_model_dir(config.model)
    check_run_sizes(config, model_dir)
    if model_dir is not None:
        check_engine_settings(config, model_dir)
