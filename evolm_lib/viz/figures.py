"""Static figure export (PNG, PDF, SVG) with kaleido 1.x and a system chromium, in a `paper` style by
default: no title (the caption says it), fonts sized for a figure shrunk to one column of a
two-column paper, axis lines and ticks outside."""
from __future__ import annotations

import os
import re
import shutil
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path

import plotly.graph_objects as go

FORMATS = ("png", "pdf", "svg")
STYLES = ("paper", None)
COLUMN_WIDTH_PT = 240  # one column of a two-column paper (3.33 in)
FONT_PT = 8  # tick labels at that width; titles 9 pt
PAPER_FONT = "Arial, Helvetica, Liberation Sans, DejaVu Sans, sans-serif"
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


def _paper_sizes(width: int) -> tuple[float, int, int]:
    """Pixels per point once a ``width``-pixel figure is shrunk to the column, and the tick and title
    font sizes in pixels."""
    pixel = width / COLUMN_WIDTH_PT
    return pixel, round(FONT_PT * pixel), round((FONT_PT + 1) * pixel)


def _legend_entries(fig: go.Figure, width: int) -> list[tuple[object, str]] | None:
    """The paper style's legend entries, in order: (each trace shown, its name broken into lines
    ("<br>") where it is wider than the plot); None where no legend is shown (a character is about
    0.5 em, the line sample before it 1.5 em; the legend starts where the plot does, after the y
    axis's title and ticks, about 7 title sizes in)."""
    _, tick, title = _paper_sizes(width)
    shown = [t for t in fig.data if t.showlegend is not False and t.name]
    # plotly shows a one-entry legend only when asked to (layout or trace showlegend set true)
    asked = fig.layout.showlegend is True or any(t.showlegend is True for t in shown)
    if fig.layout.showlegend is False or not shown or (len(shown) == 1 and not asked):
        return None
    fits = max(8, int((width - 7 * title - 1.5 * tick) / (0.5 * tick)))
    return [(t, "<br>".join(textwrap.wrap(t.name, fits, break_on_hyphens=False)) if len(t.name) > fits else t.name)
            for t in shown]


def _legend_layout(entries: list[tuple[object, str]] | None, width: int) -> tuple[int, int]:
    """(lines, entries a row) of the paper style's legend of ``entries`` (``_legend_entries``) above
    the plot; (0, 0) where none is shown. As many entries a row (up to 3) as the longest line of a
    name leaves room for; a row is as many lines tall as its tallest entry."""
    _, tick, title = _paper_sizes(width)
    if entries is None:
        return 0, 0
    lines = [name.split("<br>") for _, name in entries]
    entry = 0.5 * tick * max(len(line) for entry_lines in lines for line in entry_lines) + 1.5 * tick
    per_row = max(1, min(3, len(entries), int((width - 4.5 * title) // entry)))
    rows = [lines[i:i + per_row] for i in range(0, len(lines), per_row)]
    return sum(max(len(entry_lines) for entry_lines in row) for row in rows), per_row


def paper_height(fig: go.Figure, width: int) -> int:
    """The paper style's height: 0.7 x ``width`` for the plot (a column figure), and the rows of the
    legend above it on top, so that a long legend does not squeeze the plot."""
    _, tick, _ = _paper_sizes(width)
    return round(0.7 * width + 1.5 * tick * _legend_layout(_legend_entries(fig, width), width)[0])


def paper_style(fig: go.Figure, width: int = 900) -> go.Figure:
    """A copy of `fig` for a paper: no title, fonts that read 8-9 pt once a `width`-pixel figure is
    shrunk to one column (240 pt), thicker lines, axis lines with ticks outside, a light grid, and a
    legend above the plot in rows of at most three entries."""
    styled = go.Figure(fig)  # a copy: the notebook's figure keeps its look
    pixel, tick, title = _paper_sizes(width)
    entries = _legend_entries(styled, width)
    legend_rows, per_row = _legend_layout(entries, width)
    for trace, name in entries or []:
        trace.name = name
    if legend_rows:
        styled.update_layout(legend=dict(orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom",
                                         entrywidth=1 / per_row, entrywidthmode="fraction",
                                         font_size=tick, bgcolor="rgba(0,0,0,0)"))
    styled.update_layout(
        title_text="", template="simple_white",
        font=dict(family=PAPER_FONT, size=tick, color="black"),
        margin=dict(l=round(3 * title), r=round(1.5 * tick), b=round(3 * title),
                    t=round(legend_rows * 1.5 * tick + tick)),
    )
    axes = dict(title_font_size=title, tickfont_size=tick, showline=True, linewidth=max(1, round(pixel / 2)),
                ticks="outside", ticklen=round(tick / 3), showgrid=True, gridcolor="#e6e6e6", automargin=True)
    styled.update_xaxes(**axes)
    styled.update_yaxes(**axes)
    styled.update_xaxes(nticks=7)  # labels such as 0.0005 need room (axes with a fixed dtick keep it)
    for trace in styled.data:
        trace.legendgroup = None  # a horizontal legend puts each group on a row of its own
        line = getattr(trace, "line", None)
        if trace.type == "scatter" and line is not None and line.width != 0:
            trace.line.width = max(line.width or 2, 2) * pixel / 2.5
        marker = getattr(trace, "marker", None)
        if trace.type in ("scatter", "box") and marker is not None and marker.size:
            marker.size = marker.size * pixel / 2.5
    return styled


def export_figure(fig: go.Figure, name: str, out_dir: str | os.PathLike = "figures",
                  formats: Sequence[str] = FORMATS, width: int = 900, height: int | None = None,
                  scale: float = 2, style: str | None = "paper") -> list[Path]:
    """Write `fig` as out_dir/name.{png,pdf,svg} in `style` ("paper" or None: as shown); returns the
    paths. The default height is the paper style's (``paper_height``: 0.7 x width and the legend's
    rows), 500 otherwise."""
    bad = [f for f in formats if f not in ("png", "pdf", "svg", "jpeg", "jpg", "webp")]
    if bad:
        raise ValueError(f"unsupported formats {bad}; use png, pdf, svg, jpeg or webp")
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; use one of {STYLES}")
    if height is None:
        height = paper_height(fig, width) if style == "paper" else 500
    if style == "paper":
        fig = paper_style(fig, width)
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
