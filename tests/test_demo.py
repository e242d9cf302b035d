"""`evolm demo`: its run, figures included, stays under its output folder; the README's tracked figure
(figures/demo_fitness.png) is written only when asked (``--figure``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from evolm_lib.cli import demo
from evolm_lib.viz.labels import TINY_MODEL_NOTE

os.environ.setdefault("OMP_NUM_THREADS", "1")  # kernels inherit it (tests/test_notebooks.py says why)

REPO = Path(__file__).resolve().parents[1]
README_FIGURE = REPO / demo.README_FIGURE
CI_SPEC = "papermill_runs/ci_tiny.yaml"  # the stepper on tiny-random, 2 generations


def _state(path: Path) -> tuple[bytes, int] | None:
    return (path.read_bytes(), path.stat().st_mtime_ns) if path.exists() else None


def test_the_figure_is_copied_only_to_a_target_given(tmp_path):
    figures = tmp_path / "figures"
    figures.mkdir()
    png = figures / f"{demo.FITNESS_FIGURE}.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n a fitness plot")
    before = _state(README_FIGURE)
    assert demo.copy_figure(figures, None) is None
    target = tmp_path / "elsewhere" / "fitness.png"
    assert demo.copy_figure(figures, target) == target and target.read_bytes() == png.read_bytes()
    assert demo.copy_figure(tmp_path / "no-figures", tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
    assert _state(README_FIGURE) == before
    assert demo.build_parser().parse_args([]).figure is None  # the default copies nothing


@pytest.mark.slow
def test_the_demo_writes_under_its_output_folder_and_leaves_the_readme_figure(tmp_path, capsys):
    """`evolm demo` on the CI settings (tiny-random): the run and its figures under --out, the README's
    figure untouched (bytes and time), and the tiny model named as a plumbing check."""
    before = _state(README_FIGURE)
    assert demo.main(["--spec", CI_SPEC, "--out", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out
    assert _state(README_FIGURE) == before
    [out] = (tmp_path / "demo").iterdir()
    assert sorted(p.name for p in (out / "figures").iterdir()) == [
        f"{demo.FITNESS_FIGURE}.{fmt}" for fmt in ("pdf", "png", "svg")]
    assert "copied to" not in printed and TINY_MODEL_NOTE in printed
    assert f"figure:            {out / 'figures' / demo.FITNESS_FIGURE}.png" in printed
