"""Notebook parameters as run settings: the one translation from a notebook's papermill parameters to
its validated config. A notebook's config cell and `evolm batch --dry-run` both call it, so a grid
point is checked exactly as its kernel will build it, without running any notebook code.

A notebook declares typed parameters (papermill's `parameters` cell) named after the settings they
set, plus one mapping parameter, ``settings``, that reaches every other setting of its config class,
and tags its parameters cell with the kind of run they configure (``settings:es`` or ``settings:grpo``,
the kinds of `evolm_lib.config.config_class`):

    # %% tags=["parameters", "settings:es"]
    sigma: float = 0.05  # noise std on LoRA weights
    settings: dict = {}  # any other ESConfig setting, e.g. {optimizer: adam, dtype: bfloat16}

    # %%
    config = notebook_config(ESConfig, globals())

:func:`notebook_config` reads, field by field of the config class:
- a parameter named after a setting sets it; the notebook's other parameters (run_dir, figures_dir,
  verbose, ...) are its own and are not read here;
- text given for a mapping setting (``task_options: "{num_train: 8}"``) is read as YAML (an error names
  the setting and the line); text given for a tuple setting (``target_modules: "q_proj,v_proj"``) is
  split at commas;
- the empty value of a typed parameter ("" or 0) given for a setting whose default is None means None
  (``estimator: ""``, ``prompts_per_step: 0``): a papermill parameter has one type, and None is not one;
- ``settings`` goes over all of that, key by key, as written; an error in it is named by its path
  (``settings.optimizr: unknown setting (did you mean optimizer?)``).

:func:`open_notebook_run` opens the notebook's run so that it can be iterated on: Run All again in one
kernel closes the run the kernel opened before (letting go of its folder and engine) and resumes it,
and the default folder carries a hash of the settings (`evolm_lib.runs.notebook_run_dir`).
"""
from __future__ import annotations

import typing
from typing import Any, Mapping

import yaml

from .config import ConfigError, config_class

SETTINGS = "settings"
"""The mapping parameter that reaches every setting of the notebook's config class."""
KIND_TAG = "settings:"
"""Prefix of the parameters cell's tag naming the run kind its parameters configure (settings:es)."""


def kind_of_tags(tags: list[str] | tuple[str, ...]) -> str | None:
    """The run kind a parameters cell's tags declare ("es" for ``settings:es``), or None."""
    kinds = [tag[len(KIND_TAG):] for tag in tags if tag.startswith(KIND_TAG)]
    if len(kinds) > 1:
        raise ValueError(f"the parameters cell has several {KIND_TAG}<kind> tags: {kinds}")
    if kinds:
        config_class(kinds[0])  # an unknown kind fails here, listing the known ones
    return kinds[0] if kinds else None


def read_yaml_setting(name: str, text: str) -> Any:
    """A setting given as YAML (or JSON) text; ConfigError naming the setting and the line otherwise."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        message = f"not valid YAML{where}: {problem} (in {text!r})"
        raise ConfigError(f"{name}: {message}", [(name, message)]) from None


def _shape(annotation: Any) -> type | None:
    """dict or tuple when a field holds a mapping or a tuple (Optional unwrapped), else None."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        shapes = {_shape(a) for a in typing.get_args(annotation) if a is not type(None)}
        return shapes.pop() if len(shapes) == 1 else None
    return origin if origin in (dict, tuple) else (annotation if annotation in (dict, tuple) else None)


def _from_parameter(name: str, value: Any, field) -> Any:
    """A papermill parameter's value as the setting it names (see the module's doc string)."""
    shape = _shape(field.annotation)
    if isinstance(value, str) and shape is dict:
        parsed = read_yaml_setting(name, value)
        return {} if parsed is None else parsed
    if isinstance(value, str) and shape is tuple:
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if field.default is None and not isinstance(value, bool) and value in ("", 0):
        return None
    return value


def notebook_config(config_cls: type, namespace: Mapping[str, Any]):
    """The validated settings a notebook's parameters describe: every parameter in ``namespace`` named
    after a field of ``config_cls``, then the ``settings`` mapping over them (the module's rules).
    Raises ConfigError naming every bad field, by its path where it came from ``settings``."""
    fields = config_cls.model_fields
    data: dict[str, Any] = {}
    errors: list[tuple[str, str]] = []
    for name, field in fields.items():
        if name in namespace:
            try:
                data[name] = _from_parameter(name, namespace[name], field)
            except ConfigError as error:
                errors += error.errors
    overrides = namespace.get(SETTINGS) or {}
    if isinstance(overrides, str):
        try:
            overrides = read_yaml_setting(SETTINGS, overrides) or {}
        except ConfigError as error:
            errors, overrides = errors + error.errors, {}
    if not isinstance(overrides, Mapping):
        errors.append((SETTINGS, f"expected a mapping of {config_cls.__name__} settings, got {overrides!r}"))
        overrides = {}
    located = {str(key): f"{SETTINGS}.{key}" for key in overrides}
    try:
        config = config_cls.from_dict({**data, **overrides})
    except ConfigError as error:
        if not error.errors:
            raise
        errors += error.errors
    if errors:
        raise ConfigError.from_errors(config_cls.__name__, errors).located(located) from None
    return config


_OPEN_RUNS: dict[str, Any] = {}
"""The run each notebook opened in this kernel, by notebook name (closed when it opens another)."""


def open_notebook_run(run_class: type, config, name: str, run_dir: str = "", **options):
    """A notebook's run, opened with ``run_class.open`` (ESRun, GRPORun) in ``run_dir`` or, when empty,
    the folder of these settings (`evolm_lib.runs.notebook_run_dir(name, config)`: changed settings start
    a new run, the same settings resume it). The run this kernel opened before for ``name`` is closed
    first, so Run All twice in one kernel resumes instead of finding the folder busy; a run that
    another process holds is still refused (RunFolderBusy). Each opening appends where it runs to the
    run's placement.jsonl (``env.record_placement``), as sweep and tune runs do: the times in the rows
    that follow are read with it."""
    from .env import record_placement
    from .runs import notebook_run_dir

    previous = _OPEN_RUNS.pop(name, None)
    if previous is not None:
        previous.close()
    run = run_class.open(config, run_dir or notebook_run_dir(name, config), **options)
    _OPEN_RUNS[name] = run
    record_placement(run.run_dir, config, run.placement())
    return run
