"""The notebooks in a real JupyterLab, driven by headless Chromium: the ES stepper (run all cells,
click Step, see the live fitness plot gain a point), and notebook 04 run to the end without an
error or an engine notice in its outputs (stdout, where vLLM logs by default, and stderr). The other
notebooks run under papermill (tests/test_notebooks.py) and nbval, as committed."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from evolm_lib.env import child_environment

REPO = Path(__file__).resolve().parents[1]
STEPPER = REPO / "notebooks" / "03_es_stepper.ipynb"
FIXTURE_RUNS = REPO / "tests" / "data" / "es_vs_grpo"
CHROMIUM = "/usr/bin/chromium"
NEWS_QUESTION = "Would you like to get notified about official Jupyter news?"  # JupyterLab 4's pop-up
# the lab settings `evolm lab` gives JupyterLab (no autosave, no news pop-up): the screenshots show the notebook
LAB_SETTINGS = REPO / ".jupyter" / "lab" / "settings"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
]

# The live plot's points, read from plotly.js's own graph div in the stepper's cell.
MEAN_POINTS_JS = """cell => {
    const plot = cell.querySelector('.js-plotly-plot');
    if (!plot || !plot.data) return -1;
    const mean = plot.data.find(t => t.name === 'mean');
    return mean && mean.x ? mean.x.length : 0;
}"""

# The markers plotly.js drew for the live plot's mean trace (a line of one point shows nothing else).
MEAN_MARKERS_JS = """cell => {
    const plot = cell.querySelector('.js-plotly-plot');
    if (!plot) return -1;
    const group = [...plot.querySelectorAll('.scatterlayer .trace')]
        .find(g => g.__data__ && g.__data__[0] && g.__data__[0].trace && g.__data__[0].trace.name === 'mean');
    return group ? group.querySelectorAll('.points path.point').length : 0;
}"""

# Run before any of the page's scripts: a JavaScript module made from a string of over 1 MB (how
# anywidget loads a widget's code, plotly's FigureWidget 5 MB of it) waits 3 s before it runs, as on
# a busy machine. anywidget 0.11 drops every later message to a widget not loaded within 2 s, which
# left the live plot of a FigureWidget empty in CI: the stepper's plot must not depend on that.
SLOW_WIDGET_CODE_JS = """(() => {
    const Original = window.Blob;
    window.Blob = class extends Original {
        constructor(parts, options) {
            const code = options && options.type === 'text/javascript' && parts.length === 1
                && typeof parts[0] === 'string' && parts[0].length > 1000000;
            super(code ? ['await new Promise(resolve => setTimeout(resolve, 3000));\\n', ...parts] : parts, options);
        }
    };
})();"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ci_parameters() -> dict:
    from evolm_lib.batch import load_batch_spec

    return dict(load_batch_spec(REPO / "papermill_runs" / "ci_tiny.yaml").parameters)


def _parameterized_copy(source: Path, folder: Path, parameters: dict) -> Path:
    """A notebook with parameters injected after its parameters cell, as papermill does."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    notebook = parameterize_notebook(load_notebook_node(str(source)), parameters, kernel_name="python3")
    notebook.metadata.pop("jupytext", None)  # no paired .py for the copy
    path = folder / source.name
    nbformat.write(notebook, path)
    return path


def _wait_for_server(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                json.load(response)
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout} s")


@contextlib.contextmanager
def _lab(tmp_path: Path, root: Path, notebook: Path):
    """A JupyterLab server on 127.0.0.1 serving ``root``, with the lab settings `evolm lab` gives it;
    yields the URL that opens ``notebook`` (and, with ``/workspaces/<name>`` after ``/lab``, opens it in
    a workspace of its own: ``_in_workspace``)."""
    port, token = _free_port(), secrets.token_hex(16)
    env = child_environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # see tests/test_notebooks.py
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")})
    log = open(tmp_path / "jupyterlab.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", f"--LabApp.app_settings_dir={LAB_SETTINGS}"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base}/api/status?token={token}", process)
        yield f"{base}/lab/tree/{notebook.name}?token={token}"
    finally:
        try:  # shut kernels down cleanly first, then the process
            request = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(request, timeout=5).close()
            process.wait(20)
        except Exception:  # noqa: BLE001
            pass
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        log.close()


def _run_all_cells(page, timeout_ms: int = 150_000, after: int = 0) -> None:
    """Open the notebook's kernel, Run All, and wait until every code cell ran (its execution count
    above ``after``: a second Run All in the same kernel) or one failed."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=60_000)
    # the kernel must be up before Run All, or the cells go to a kernel that is being replaced
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
    select_kernel = page.locator(".jp-Dialog button.jp-mod-accept", has_text="Select")
    try:  # JupyterLab may still ask which kernel to use
        select_kernel.wait_for(timeout=5_000)
        select_kernel.click()
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
    except PlaywrightTimeout:
        pass
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    # every code cell done (its prompt shows an execution count, not [*] or blank), or one failed
    page.wait_for_function(
        """after => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];
            const failed = [...document.querySelectorAll('.jp-OutputArea-output')]
                .some(o => o.textContent.includes('Traceback (most recent call last)'));
            const ran = p => { const m = /\\[(\\d+)\\]/.exec(p.textContent); return m && Number(m[1]) > after; };
            return failed || (prompts.length > 0 && prompts.every(ran));
        }""",
        arg=after, timeout=timeout_ms, polling=1000,
    )


def _engine_lines(page) -> dict[str, list[str]]:
    """Engine notices left in the notebook's outputs: per stream, and progress bars in any output
    (vLLM's checkpoint bar is a widget in a notebook). Also checks the user's own prints are there.
    textContent, not innerText: it does not depend on the cell being laid out (JupyterLab skips the
    rendering of cells out of view)."""
    from evolm_lib.quiet import notice_lines

    found = {}
    for name in ("stdout", "stderr"):
        outputs = page.locator(f".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.{name}']")
        text = "\n".join(outputs.nth(i).text_content() for i in range(outputs.count()))
        if name == "stdout":
            assert text.strip(), "no stdout output found: the notebook's own prints should be there"
        found[name] = notice_lines(text)
    outputs = page.locator(".jp-OutputArea-output")
    found["bars"] = [t for t in (outputs.nth(i).text_content() for i in range(outputs.count())) if "checkpoint shards" in t]
    return {name: lines for name, lines in found.items() if lines}


def _execution_count(page) -> int:
    """The largest execution count among the notebook's code cells (0 before any ran)."""
    return page.evaluate("""() => Math.max(0, ...[...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
        .map(p => Number((/\\[(\\d+)\\]/.exec(p.textContent) || [0, 0])[1])))""")


def _opened_runs(page) -> list[tuple[str, int]]:
    """(run folder, generation) as the stepper's open cell printed them, in the notebook's outputs."""
    import re

    outputs = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']")
    text = "\n".join(outputs.nth(i).text_content() for i in range(outputs.count()))
    return [(folder, int(generation)) for folder, generation in re.findall(r"(\S*03_es_stepper-[0-9a-f]{8}): generation (\d+)", text)]


def _click_step_and_see_a_new_point(page, tmp_path: Path) -> None:
    """Click the stepper's Step button: the live fitness plot gains a point (generation 2)."""
    cell = page.locator(".jp-CodeCell", has=page.locator("button", has_text="Step")).first
    cell.scroll_into_view_if_needed()  # JupyterLab 4 renders the outputs of cells in view only
    step = cell.locator("button", has_text="Step").first
    step.wait_for(timeout=30_000)
    # generation 0 is scored before the plot has a point: on a busy 2-core machine that took over 30 s
    page.wait_for_function(f"cell => ({MEAN_POINTS_JS})(cell) >= 1", arg=cell.element_handle(), timeout=120_000)
    before = cell.evaluate(MEAN_POINTS_JS)
    assert before == 1, before  # generation 1 ran in the notebook's loop
    assert cell.evaluate(MEAN_MARKERS_JS) == 1  # the one point is drawn: a line of one point shows nothing

    step.click()
    page.wait_for_function(f"cell => ({MEAN_POINTS_JS})(cell) === {before + 1}",
                           arg=cell.element_handle(), timeout=60_000, polling=500)
    assert cell.evaluate(MEAN_POINTS_JS) == before + 1
    page.wait_for_function(f"cell => ({MEAN_MARKERS_JS})(cell) === {before + 1}",
                           arg=cell.element_handle(), timeout=10_000, polling=500)
    assert "generation 2" in cell.inner_text()
    assert page.get_by_text(NEWS_QUESTION).count() == 0  # nothing over the notebook
    cell.screenshot(path=str(tmp_path / "stepper.png"))  # for a look when debugging


def _in_workspace(url: str, notebook: Path, workspace: str) -> str:
    """The lab's URL that opens ``notebook`` in a fresh workspace of its own (none of the notebooks
    opened before in the default workspace come back in that page)."""
    base, query = url.split("/lab/tree/", 1)
    return f"{base}/lab/workspaces/{workspace}/tree/{notebook.name}?{query.split('?', 1)[1]}"


def test_the_stepper_runs_all_steps_and_runs_all_again_in_one_kernel_and_with_a_changed_setting_then_04_runs(
        tmp_path, monkeypatch):
    """Run All (no traceback, no engine notice in the outputs), click Step and see the live fitness
    plot gain a point, Run All again in the same kernel (the run opened before is closed and resumed
    where the Step left it), then a changed sigma typed into the parameters and Run All once more (a
    new run in a folder of its own): no traceback at any point. One server, kernel and first Run All
    for what were two tests (the Step button's, and Run All twice), which each paid for them. Then, on
    the same server and browser (what a third test paid for again), notebook 04 in a page of its own
    runs to the end without an error or an engine notice in its outputs."""
    from playwright.sync_api import sync_playwright

    runs = tmp_path / "runs"
    monkeypatch.setenv("EVOLM_NOTEBOOK_RUNS", str(runs))  # the notebook's default run folders go here
    root = tmp_path / "lab"
    root.mkdir()
    parameters = {**_ci_parameters(), "num_generations": 1, "run_dir": "", "figures_dir": str(tmp_path / "figures")}
    parameters["sigma"] = 0.05  # last: the line the test retypes
    notebook = _parameterized_copy(STEPPER, root, parameters)
    comparison = _parameterized_copy(REPO / "notebooks" / "04_es_vs_grpo.ipynb", root, {
        "es_runs": str(FIXTURE_RUNS / "es_*"), "grpo_runs": str(FIXTURE_RUNS / "grpo_*"),
        "figures_dir": str(tmp_path / "figures_04")})
    with _lab(tmp_path, root, notebook) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.add_init_script(SLOW_WIDGET_CODE_JS)  # a front end as slow as a busy CI runner's
            failed = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
            try:
                page.goto(url)
                _run_all_cells(page, timeout_ms=240_000)
                assert failed.count() == 0, failed.first.inner_text()
                assert not _engine_lines(page), _engine_lines(page)  # the engine started in this notebook
                [(first, generation)] = _opened_runs(page)
                assert generation == 0 and sorted(p.name for p in runs.iterdir()) == [Path(first).name]

                _click_step_and_see_a_new_point(page, tmp_path)
                assert failed.count() == 0, failed.first.inner_text()

                _run_all_cells(page, timeout_ms=240_000, after=_execution_count(page))
                assert failed.count() == 0, failed.first.inner_text()
                assert _opened_runs(page) == [(first, 2)]  # the same run, resumed where the Step left it

                injected = page.locator(".jp-CodeCell", has=page.locator(".cm-content", has_text="sigma = 0.05")).first
                injected.locator(".cm-content").click()
                page.keyboard.press("Control+End")
                page.keyboard.press("Shift+Home")
                page.keyboard.type("sigma = 0.1")
                page.keyboard.press("Escape")
                _run_all_cells(page, timeout_ms=240_000, after=_execution_count(page))
                assert failed.count() == 0, failed.first.inner_text()
                [(second, generation)] = _opened_runs(page)
                assert second != first and generation == 0  # changed settings: a new run beside the first
                assert sorted(p.name for p in runs.iterdir()) == sorted([Path(first).name, Path(second).name])
            except Exception:
                page.screenshot(path=str(tmp_path / "failure.png"))
                raise
            try:  # the comparison notebook, in a page and workspace of its own: only its cells in that page
                page.close()
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(_in_workspace(url, comparison, "comparison"))
                _run_all_cells(page, timeout_ms=240_000)
                outputs = page.locator(".jp-OutputArea-output")
                texts = [outputs.nth(i).inner_text() for i in range(outputs.count())]
                assert not [t for t in texts if "Traceback (most recent call last)" in t], texts
                assert not _engine_lines(page), _engine_lines(page)  # no engine notices either, on either stream
                assert page.locator(".jp-CodeCell").count() >= 8 and outputs.count() >= 5
                page.screenshot(path=str(tmp_path / "04_es_vs_grpo.png"), full_page=True)  # for a look when debugging
            except Exception:
                page.screenshot(path=str(tmp_path / "failure_04.png"))
                raise
        finally:
            browser.close()


# --------------------------------------------------------------------------- `evolm lab`'s own settings

AUTOSAVE_SECONDS = 2  # the test's autosave interval (the user's setting); the lab's default is minutes


def _project_copy(tmp_path: Path) -> Path:
    """What `evolm lab` serves of the project (notebooks, batch files, its jupyter settings), in a git
    repository of its own with everything committed."""
    import shutil

    project = tmp_path / "project"
    for folder in ("notebooks", "papermill_runs", ".jupyter"):
        shutil.copytree(REPO / folder, project / folder)
    for name in ("jupytext.toml", ".gitignore"):
        shutil.copy(REPO / name, project / name)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "tracked"]):
        subprocess.run(git + command, cwd=project, check=True, capture_output=True)
    return project


def _notebook_files(project: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in sorted((project / "notebooks").iterdir())
            if path.suffix in (".py", ".ipynb")}


def _git_status(project: Path) -> str:
    return subprocess.run(["git", "status", "--porcelain", "notebooks/"], cwd=project, check=True,
                          capture_output=True, text=True).stdout


@contextlib.contextmanager
def _evolm_lab(tmp_path: Path, project: Path):
    """`evolm lab --no-browser` on ``project``, with a user setting of a short autosave interval; yields
    the lab's base URL and token."""
    port, token = _free_port(), secrets.token_hex(16)
    settings = tmp_path / "settings" / "@jupyterlab" / "docmanager-extension"
    settings.mkdir(parents=True)
    (settings / "plugin.jupyterlab-settings").write_text(json.dumps({"autosaveInterval": AUTOSAVE_SECONDS}))
    env = child_environment({"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")})
    log = open(tmp_path / "evolm-lab.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "evolm_lib.cli", "lab", "--no-browser", "--ip", "127.0.0.1", "--port", str(port),
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base}/api/status?token={token}", process)
        yield base, token
    finally:
        process.terminate()  # `evolm lab` stops the server and its kernels
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


def test_the_lab_opens_a_py_notebook_as_a_notebook_and_writes_it_only_when_saved(tmp_path):
    """In `evolm lab`: a double click on notebooks/03_es_stepper.py opens it as a notebook; an edit of its
    parameters cell stays in the browser through several autosave intervals (the tracked .py and .ipynb
    keep every byte, git sees nothing); Ctrl-S then writes the edit to the .py and the paired .ipynb."""
    from playwright.sync_api import sync_playwright

    project = _project_copy(tmp_path)
    source, paired = project / "notebooks" / "03_es_stepper.py", project / "notebooks" / "03_es_stepper.ipynb"
    tracked = _notebook_files(project)
    with _evolm_lab(tmp_path, project) as (base, token), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{base}/lab/tree/notebooks?token={token}")  # where the lab opens
            item = page.locator(".jp-DirListing-item", has_text="03_es_stepper.py")
            item.wait_for(timeout=60_000)
            item.dblclick()
            panel = page.locator(".jp-NotebookPanel", has=page.locator(".jp-Cell"))
            panel.first.wait_for(timeout=60_000)
            assert page.locator(".jp-FileEditor").count() == 0  # not the text editor
            tab = page.locator(".lm-TabBar-tab.lm-mod-current", has_text="03_es_stepper.py")
            assert tab.count() >= 1
            accept = page.locator(".jp-Dialog button.jp-mod-accept")
            if accept.count():  # a kernel chooser, where the lab asks
                accept.first.click()

            parameters = panel.first.locator(".jp-CodeCell", has_text="population_size: int = 4").first
            parameters.locator(".cm-content").click()
            page.keyboard.press("Control+End")
            page.keyboard.type("\nnum_generations = 5  # edited in the lab")
            page.locator(".lm-TabBar-tab.jp-mod-dirty", has_text="03_es_stepper.py").wait_for(timeout=10_000)

            time.sleep(4 * AUTOSAVE_SECONDS + 2)  # several autosave intervals
            # the lab asks whether to fetch its news (a pop-up over the notebook) right after it loads,
            # unless its settings answer: the project's say no
            assert page.get_by_text(NEWS_QUESTION).count() == 0
            assert _notebook_files(project) == tracked
            assert _git_status(project) == ""
            assert page.locator(".lm-TabBar-tab.jp-mod-dirty", has_text="03_es_stepper.py").count() == 1

            page.keyboard.press("Control+s")  # a save on purpose writes both files of the pair
            deadline = time.monotonic() + 30
            while b"# edited in the lab" not in source.read_bytes() or paired.read_bytes() == tracked[paired]:
                assert time.monotonic() < deadline, "Ctrl-S did not write the notebook"
                time.sleep(0.5)
            assert "# edited in the lab" in "".join(json.loads(paired.read_text())["cells"][1]["source"])
            assert sorted(_git_status(project).split()) == ["M", "M", "notebooks/03_es_stepper.ipynb",
                                                            "notebooks/03_es_stepper.py"]
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"))
            raise
        finally:
            browser.close()


def test_the_shipped_lab_settings_turn_autosave_off_open_py_as_notebooks_and_ask_no_news():
    """The settings `evolm lab` gives JupyterLab (.jupyter/lab/settings/overrides.json), which its
    server config points the lab at."""
    overrides = json.loads((REPO / ".jupyter" / "lab" / "settings" / "overrides.json").read_text())
    documents = overrides["@jupyterlab/docmanager-extension:plugin"]
    assert documents["autosave"] is False and documents["defaultViewers"] == {"python": "Jupytext Notebook"}
    # the news question is answered (no pop-up); the keys are those of the installed lab's schema
    schema = Path(sys.prefix) / "share/jupyter/lab/schemas/@jupyterlab/apputils-extension/notification.json"
    notification = overrides["@jupyterlab/apputils-extension:notification"]
    assert notification["fetchNews"] == "false"
    assert set(notification) <= set(json.loads(schema.read_text())["properties"])
    config = (REPO / ".jupyter" / "jupyter_server_config.py").read_text()
    assert 'c.LabApp.app_settings_dir = str(Path(__file__).resolve().parent / "lab" / "settings")' in config
