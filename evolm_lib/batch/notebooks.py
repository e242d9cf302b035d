"""A batch's notebook: read (jupytext or .ipynb), its `parameters` cell inspected as papermill does,
and executed with papermill."""
from __future__ import annotations

import ast
import contextlib
import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import config_class, did_you_mean
from ..config_checks import RENAMED_SETTINGS
from ..parameters import SETTINGS, kind_of_tags
from ..paths import project_root

NOTEBOOK_FILE = "notebook.ipynb"
KERNEL_START_ATTEMPTS = 2  # a notebook's kernel that dies before answering is started once more
KERNEL_DIED_AT_START = "Kernel died before replying to kernel_info"  # jupyter_client's words for it


@dataclass(frozen=True)
class NotebookInfo:
    """What a batch knows of its notebook without running it: papermill's view of its parameters cell."""

    declared: dict[str, dict[str, Any]]
    """Declared parameters: name -> {name, inferred_type_name, default (source text), help}."""
    defaults: dict[str, Any]
    """Declared defaults that are literals (every one in the project's notebooks), as values."""
    kind: str | None
    """The run kind its parameters configure (its `settings:<kind>` tag), or None."""


def read_notebook(path: str | Path, kernel_name: str = "python3"):
    """A notebook (jupytext .py/.md or .ipynb) as an nbformat node, with a kernelspec."""
    import jupytext

    nb = jupytext.read(str(path))
    # a jupytext .py without a header has no kernelspec, which papermill needs
    if not nb.metadata.get("kernelspec", {}).get("name"):
        nb.metadata["kernelspec"] = {"name": kernel_name, "display_name": "Python 3",
                                     "language": "python"}
    nb.metadata.setdefault("language_info", {"name": "python"})
    return nb


def _parameters_cell(notebook):
    return next((c for c in notebook.cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)


def notebook_parameters(notebook) -> dict[str, dict[str, Any]]:
    """Parameters declared in the notebook's `parameters` cell: name -> {type, default, help}
    (papermill's own inspection, as `papermill --help-notebook` shows them)."""
    from papermill.translators import papermill_translators

    if isinstance(notebook, (str, Path)):
        notebook = read_notebook(notebook)
    cell = _parameters_cell(notebook)
    if cell is None:
        return {}
    kernel = notebook.metadata.get("kernelspec", {}).get("name", "python3")
    language = notebook.metadata.get("kernelspec", {}).get("language", "python")
    translator = papermill_translators.find_translator(kernel, language)
    return {p.name: p._asdict() for p in translator.inspect(cell)}


def notebook_info(notebook) -> NotebookInfo:
    """The declared parameters, their literal defaults and the settings kind of a notebook."""
    if isinstance(notebook, (str, Path)):
        notebook = read_notebook(notebook)
    declared = notebook_parameters(notebook)
    defaults = {}
    for name, info in declared.items():
        with contextlib.suppress(ValueError, SyntaxError, TypeError):  # not a literal: the check goes without it
            defaults[name] = ast.literal_eval(info["default"])
    cell = _parameters_cell(notebook)
    kind = kind_of_tags(cell.metadata.get("tags", [])) if cell is not None else None
    return NotebookInfo(declared, defaults, kind)


def check_parameters(parameters: dict[str, Any], declared: dict[str, Any], notebook: Path,
                     kind: str | None = None) -> None:
    """Fail with the declared names (and the nearest one) when a parameter is not declared by the notebook."""
    undeclared = [k for k in parameters if k not in declared]
    if not undeclared:
        return
    listing = ", ".join(declared) or "(none: no cell tagged `parameters`)"
    hints = "".join(f"; {k} is now called {RENAMED_SETTINGS[k]}" if RENAMED_SETTINGS.get(k) in declared
                    else did_you_mean(k, list(declared)) for k in undeclared)
    fields = config_class(kind).model_fields if kind else {}
    settings = [k for k in undeclared if k in fields]
    if settings and SETTINGS in declared:
        example = ", ".join(f"{k}: {parameters[k]!r}" for k in settings)
        hints += f"; {', '.join(settings)} {'is a setting' if len(settings) == 1 else 'are settings'} of " \
                 f"{config_class(kind).__name__}: give {'it' if len(settings) == 1 else 'them'} under " \
                 f"`{SETTINGS}` ({SETTINGS}: {{{example}}})"
    raise ValueError(f"parameter(s) {undeclared} not declared in the parameters cell of "
                     f"{notebook}{hints}; declared: {listing}")


def execute_notebook(notebook_path: str | Path, output_path: str | Path,
                     parameters: dict[str, Any] | None = None, cwd: str | Path | None = None,
                     kernel_name: str = "python3", log_output: bool = False,
                     execution_timeout: float | None = None) -> Path:
    """Run one notebook (jupytext .py or .ipynb) with papermill; returns the executed notebook path.

    Raises papermill's PapermillExecutionError when a cell fails (the output notebook is still
    written, with the failing cell marked).
    """
    import papermill

    from ..quiet import verbose

    nb = read_notebook(notebook_path, kernel_name)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, KERNEL_START_ATTEMPTS + 1):
        try:
            papermill.execute_notebook(
                copy.deepcopy(nb), str(output_path), parameters=dict(parameters or {}), kernel_name=kernel_name,
                progress_bar=False, log_output=log_output, cwd=str(cwd or project_root()),
                execution_timeout=execution_timeout,
                store_widget_state=False,  # the widgets (live plots, tables) are drawn from the run, not kept
                # the kernel's own start-up notices (e.g. "running over TCP without encryption") go to the
                # terminal of every batch point: errors only, unless EVOLM_VERBOSE
                extra_arguments=[] if verbose() else ["--IPKernelApp.log_level=ERROR"],
            )
            return output_path
        except RuntimeError as error:
            # A kernel that died before it answered ran no cell (e.g. its port was taken by another
            # process between jupyter_client choosing it and the kernel binding it): start another.
            if KERNEL_DIED_AT_START not in str(error) or attempt == KERNEL_START_ATTEMPTS:
                raise
            warnings.warn(f"{notebook_path}: the kernel died before it answered ({error}); starting another",
                          RuntimeWarning, stacklevel=2)
    return output_path


def error_text(err: BaseException) -> str:
    ename, evalue = getattr(err, "ename", None), getattr(err, "evalue", None)
    if ename:  # PapermillExecutionError: the notebook's own exception
        return f"{ename}: {evalue}"
    return f"{type(err).__name__}: {err}"
