"""Static figure export (PNG, PDF, SVG) with kaleido 1.x and a system chromium."""
from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

import plotly.graph_objects as go

FORMATS = ("png", "pdf", "svg")
_CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_MISSING_CHROMIUM = (
    "Static figure export needs a Chromium browser, and none was found. "
    "Install one with `sudo apt-get install -y chromium` (or run `make setup`), "
    "or point BROWSER_PATH at a Chrome/Chromium executable."
)

_sync_server_started = False  # one kaleido browser per process: later images take ~0.3 s, not 3-7 s


def find_chromium() -> str | None:
    """Path of the Chromium/Chrome that kaleido will use, or None."""
    env = os.environ.get("BROWSER_PATH")
    if env:
        return env if os.access(env, os.X_OK) else None
    try:  # kaleido's own search: its local download first, then PATH and the usual places
        from choreographer.browsers.chromium import Chromium

        found = Chromium.find_browser(skip_local=False)
        if found:
            return found
    except Exception:  # noqa: BLE001 - choreographer internals vary between versions
        pass
    for name in _CHROMIUM_NAMES:
        if path := shutil.which(name):
            return path
    return None


def chromium_available() -> bool:
    """True when a Chromium/Chrome executable for kaleido is installed."""
    return find_chromium() is not None


def _ensure_sync_server() -> None:
    global _sync_server_started
    if _sync_server_started:
        return
    try:
        import kaleido
    except ImportError as err:
        raise RuntimeError("Static figure export needs `pip install kaleido>=1.0`.") from err
    start = getattr(kaleido, "start_sync_server", None)  # kaleido >= 1.1; older: one browser per image
    if start is not None:
        start(silence_warnings=True)
    _sync_server_started = True


def sanitize_name(name: str) -> str:
    """A file stem without path separators or shell-unfriendly characters."""
    stem = re.sub(r"[^A-Za-z0-9._=+-]+", "_", str(name)).strip("._")
    if not stem:
        raise ValueError(f"figure name {name!r} has no usable characters")
    return stem


def export_figure(fig: go.Figure, name: str, out_dir: str | os.PathLike = "figures",
                  formats: Sequence[str] = FORMATS, width: int = 900, height: int = 500,
                  scale: float = 2) -> list[Path]:
    """Write `fig` as out_dir/name.{png,pdf,svg}; returns the written paths."""
    bad = [f for f in formats if f not in ("png", "pdf", "svg", "jpeg", "jpg", "webp")]
    if bad:
        raise ValueError(f"unsupported formats {bad}; use png, pdf, svg, jpeg or webp")
    if not chromium_available():
        raise RuntimeError(_MISSING_CHROMIUM)
    _ensure_sync_server()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = sanitize_name(name)
    paths = []
    for fmt in formats:
        path = out / f"{stem}.{fmt}"
        # scale only multiplies raster pixels; vector formats keep the layout size
        with warnings.catch_warnings():
            # plotly passes browser options that a running sync server ignores (harmless)
            warnings.filterwarnings("ignore", message="The kopts argument is ignored")
            fig.write_image(str(path), format=fmt, width=width, height=height,
                            scale=scale if fmt in ("png", "jpeg", "jpg", "webp") else 1)
        paths.append(path)
    return paths
