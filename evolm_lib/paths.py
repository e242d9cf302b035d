"""Where the project's files are: notebooks/, papermill_runs/ and figures/ live in the project
folder (a checkout), not inside the installed package."""
from __future__ import annotations

from pathlib import Path

_MARKERS = ("notebooks", "papermill_runs")


def project_root(start: str | Path | None = None) -> Path:
    """The project folder: the current directory (or ``start``) or one above it holding notebooks/
    and papermill_runs/, else the checkout the package was installed from."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents, Path(__file__).resolve().parents[1]):
        if all((folder / marker).is_dir() for marker in _MARKERS):
            return folder
    raise FileNotFoundError(
        f"no EvoLM project folder (one holding {' and '.join(_MARKERS)}/) at or above {here}: "
        "run the command from the repository's folder"
    )


def resolve_in_project(path: str | Path, start: str | Path | None = None) -> Path:
    """A path as given if it exists or is absolute, else relative to the project folder."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    return project_root(start) / path
