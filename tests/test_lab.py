"""`evolm lab`: the jupyter-lab command it builds (our options, pass-through, root), and a real server
started as the test user (root in CI) whose REST API serves the project's notebooks and runs, and whose
saves of notebooks/*.ipynb leave the tracked files as they were."""
from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

from evolm_lib.cli.lab import clean_notebook_save, lab_command, lab_environment, strip_notebook

REPO = Path(__file__).resolve().parents[1]
JUPYTER = [sys.executable, "-m", "jupyter", "lab"]


# --------------------------------------------------------------------------- the command line

def test_our_options_become_jupyter_settings_and_the_lab_is_rooted_at_the_project(tmp_path):
    (tmp_path / "notebooks").mkdir()
    command = lab_command(["--port", "8890", "--no-browser", "--ip", "0.0.0.0"], tmp_path, as_root=False)
    assert command == JUPYTER + ["--ServerApp.port=8890", "--ServerApp.ip=0.0.0.0", "--no-browser",
                                 f"--ServerApp.root_dir={tmp_path}", "--LabApp.default_url=/lab/tree/notebooks"]


def test_as_root_allow_root_is_added_once(tmp_path):
    assert "--allow-root" in lab_command([], tmp_path, as_root=True)
    assert "--allow-root" not in lab_command([], tmp_path, as_root=False)
    assert lab_command(["--allow-root"], tmp_path, as_root=True).count("--allow-root") == 1


def test_other_options_pass_through_in_order_after_a_double_dash_too(tmp_path):
    passed = ["--ServerApp.token=abc", "--LabApp.news_url", "", "--debug"]
    assert lab_command(["--port=9000", *passed], tmp_path, as_root=False)[-4:] == passed
    # `evolm lab -- --port 8890`: after `--` everything is jupyter-lab's, ours included
    command = lab_command(["--", "--port", "8890", "--no-browser"], tmp_path, as_root=False)
    assert command[-3:] == ["--port", "8890", "--no-browser"] and "--" not in command
    assert "--ServerApp.port=8890" not in command


def test_a_folder_of_the_users_own_replaces_the_project_root_and_start_page(tmp_path):
    (tmp_path / "notebooks").mkdir()
    command = lab_command(["--ServerApp.root_dir=/data"], tmp_path, as_root=False)
    assert not [c for c in command if c.startswith(("--ServerApp.root_dir=" + str(tmp_path), "--LabApp.default_url"))]
    command = lab_command(["--LabApp.default_url=/lab/tree/runs"], tmp_path, as_root=False)
    assert f"--ServerApp.root_dir={tmp_path}" in command
    assert [c for c in command if "default_url" in c] == ["--LabApp.default_url=/lab/tree/runs"]


def test_bad_values_of_our_options_are_refused_naming_the_option(capsys):
    from evolm_lib.cli.lab import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--port", "eighty"])
    assert exit_info.value.code == 2 and "--port" in capsys.readouterr().err


def test_make_lab_passes_args():
    result = subprocess.run(["make", "-n", "lab", "ARGS=--port 8890 --no-browser"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    # under `make test` the nested make also prints its directory lines: the command is the lab line
    [command] = [line for line in result.stdout.splitlines() if "-m evolm_lib.cli lab" in line]
    assert command.endswith("-m evolm_lib.cli lab --port 8890 --no-browser")


# --------------------------------------------------------------------------- clean saves, without a server

def test_strip_notebook_keeps_what_the_py_keeps():
    notebook = nbformat.v4.new_notebook(metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "jupytext": {"formats": "ipynb,py:percent", "notebook_metadata_filter": "kernelspec,jupytext",
                     "cell_metadata_filter": "tags,-all"},
        "language_info": {"name": "python", "version": "3.11.7"}, "widgets": {"state": {}}})
    cell = nbformat.v4.new_code_cell("print(1)", metadata={"tags": ["parameters"], "scrolled": True, "execution": {}},
                                     execution_count=3, outputs=[nbformat.v4.new_output("stream", text="1\n")])
    notebook.cells = [cell, nbformat.v4.new_markdown_cell("# Title", metadata={"jupyter": {"source_hidden": True}})]
    strip_notebook(notebook)
    assert set(notebook.metadata) == {"kernelspec", "jupytext"}
    assert notebook.cells[0].outputs == [] and notebook.cells[0].execution_count is None
    assert notebook.cells[0].metadata == {"tags": ["parameters"]} and notebook.cells[1].metadata == {}
    assert notebook.cells[0].source == "print(1)" and notebook.cells[1].source == "# Title"


class _Server:
    """What the hook reads of a contents manager: the folder it serves."""

    def __init__(self, root_dir):
        self.root_dir = str(root_dir)


def test_the_save_hook_cleans_the_project_notebooks_only(tmp_path):
    project = _project_copy(tmp_path)
    (project / "runs" / "quick" / "point").mkdir(parents=True)
    executed = nbformat.read(project / "notebooks" / "03_es_stepper.ipynb", as_version=4)
    executed.cells[1].outputs = [nbformat.v4.new_output("stream", text="generation 1\n")]
    for path, cleaned in (("notebooks/03_es_stepper.ipynb", True), ("runs/quick/point/notebook.ipynb", False)):
        model = {"type": "notebook", "content": copy.deepcopy(executed)}
        clean_notebook_save(model, path, _Server(project))
        assert (model["content"].cells[1].outputs == []) is cleaned, path
    # the model the caller still holds (jupytext writes the .py from it) is not changed
    model = {"type": "notebook", "content": executed}
    clean_notebook_save(model, "notebooks/03_es_stepper.ipynb", _Server(project))
    assert executed.cells[1].outputs and model["content"] is not executed


# --------------------------------------------------------------------------- a real server

def _project_copy(tmp_path: Path) -> Path:
    """The parts of the project a lab serves, copied (the test saves notebooks into it)."""
    project = tmp_path / "project"
    for folder in ("notebooks", "papermill_runs", ".jupyter"):
        shutil.copytree(REPO / folder, project / folder)
    shutil.copy(REPO / "jupytext.toml", project / "jupytext.toml")
    return project


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(base: str, token: str, path: str, method: str = "GET", body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, method=method,
                                     headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read()
    return json.loads(text) if text else {}


@pytest.mark.slow
def test_evolm_lab_serves_the_project_to_a_remote_user_and_saves_cleanly(tmp_path):
    """`evolm lab --port P --no-browser`, as the test user with no --allow-root of ours (root in CI):
    the API answers with the token, lists notebooks/ and runs/, opens a notebook, starts its kernel;
    saving it after a run (outputs, the lab's kernelspec and language_info) leaves the .py byte-identical
    and the .ipynb without outputs."""
    project = _project_copy(tmp_path)
    (project / "runs" / "quick").mkdir(parents=True)
    notebook, source = project / "notebooks" / "03_es_stepper.ipynb", project / "notebooks" / "03_es_stepper.py"
    tracked_ipynb, tracked_py = notebook.read_bytes(), source.read_bytes()
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = open(tmp_path / "lab.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "evolm_lib.cli", "lab", "--port", str(port), "--no-browser",
         # jupyter-lab's own options, passed through
         f"--IdentityProvider.token={token}", "--ServerApp.port_retries=0",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://localhost:{port}"
    try:
        _wait_for(base, token, process, tmp_path / "lab.log")
        assert _api(base, token, "/api/status")["started"]
        with pytest.raises(urllib.error.HTTPError) as refused:  # the token is needed
            urllib.request.urlopen(f"{base}/api/contents/notebooks", timeout=10)
        assert refused.value.code == 403

        # the lab is rooted at the project and opens at notebooks/
        root = {item["name"] for item in _api(base, token, "/api/contents")["content"]}
        assert {"notebooks", "runs", "papermill_runs"} <= root
        with urllib.request.urlopen(f"{base}/?token={token}", timeout=30) as response:
            assert response.geturl().split("?")[0] == f"{base}/lab/tree/notebooks"
        names = {item["name"] for item in _api(base, token, "/api/contents/notebooks")["content"]}
        assert {"03_es_stepper.ipynb", "03_es_stepper.py"} <= names
        assert [item["name"] for item in _api(base, token, "/api/contents/runs")["content"]] == ["quick"]

        # open the notebook and its kernel, as the lab does
        model = _api(base, token, "/api/contents/notebooks/03_es_stepper.ipynb?content=1")
        assert model["type"] == "notebook" and len(model["content"]["cells"]) >= 8
        session = _api(base, token, "/api/sessions", "POST", {"path": "notebooks/03_es_stepper.ipynb",
                                                              "type": "notebook", "kernel": {"name": "python3"}})
        kernel = _api(base, token, f"/api/kernels/{session['kernel']['id']}")
        assert kernel["name"] == "python3"
        spec = _api(base, token, "/api/kernelspecs")["kernelspecs"]["python3"]["spec"]

        # save it as the lab would after Run All: outputs, counts, the running kernel's spec, language_info
        content = model["content"]
        content["metadata"]["kernelspec"] = {"display_name": spec["display_name"], "language": spec["language"],
                                             "name": "python3"}
        content["metadata"]["language_info"] = {"name": "python", "version": sys.version.split()[0]}
        code = [cell for cell in content["cells"] if cell["cell_type"] == "code"]
        for count, cell in enumerate(code, 1):
            cell["execution_count"] = count
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": f"generation {count}\n" * 200}]
            cell["metadata"]["execution"] = {"iopub.status.idle": "2025-11-26T10:00:00Z"}
        _api(base, token, "/api/contents/notebooks/03_es_stepper.ipynb", "PUT",
             {"type": "notebook", "format": "json", "content": content})
        assert source.read_bytes() == tracked_py  # the paired .py: not one byte changed (kernelspec included)
        saved = json.loads(notebook.read_text())
        assert not [cell for cell in saved["cells"] if cell.get("outputs") or cell.get("execution_count")]
        assert notebook.read_bytes() == tracked_ipynb  # nothing for git to show

        # a notebook outside notebooks/ keeps what it was saved with (an executed batch point)
        _api(base, token, "/api/contents/runs/quick/notebook.ipynb", "PUT",
             {"type": "notebook", "format": "json", "content": content})
        kept = json.loads((project / "runs" / "quick" / "notebook.ipynb").read_text())
        first = next(c for c in kept["cells"] if c["cell_type"] == "code")
        assert first["execution_count"] == 1 and "".join(first["outputs"][0]["text"]).startswith("generation 1\n")
        _api(base, token, f"/api/sessions/{session['id']}", "DELETE")
    finally:
        try:
            _api(base, token, "/api/shutdown", "POST")
            process.wait(30)
        except Exception:  # noqa: BLE001 - the server may already be gone; terminate below
            pass
        if process.poll() is None:
            process.terminate()
            process.wait(15)
        log.close()
    assert process.returncode == 0, (tmp_path / "lab.log").read_text()[-3000:]
    printed = (tmp_path / "lab.log").read_text()
    assert "--allow-root" in printed.splitlines()[0] or os.geteuid() != 0  # the command line evolm printed


def _wait_for(base: str, token: str, process: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"evolm lab exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            _api(base, token, "/api/status")
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"evolm lab did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


def test_a_child_process_gets_this_process_environment_without_an_engines_own_variables(monkeypatch):
    from evolm_lib.env import child_environment

    monkeypatch.setenv("VLLM_DIST_IDENT", "ident-of-this-process-worker")  # what vLLM's CPU worker sets
    monkeypatch.setenv("EVOLM_SOMETHING", "kept")
    env = child_environment({"EXTRA": "1"})
    assert "VLLM_DIST_IDENT" not in env and env["EVOLM_SOMETHING"] == "kept" and env["EXTRA"] == "1"
    assert os.environ["VLLM_DIST_IDENT"] == "ident-of-this-process-worker"  # this process keeps it
    assert "VLLM_DIST_IDENT" not in lab_environment(REPO)  # what `evolm lab` hands the server and its kernels


# --------------------------------------------------------------------------- stopping `evolm lab`

def _children(pid: int) -> list[int]:
    """The process ids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def _port_answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_to_evolm_lab_stops_its_server(tmp_path, signum):
    """`kill <pid of evolm lab>` (or SIGINT, as Ctrl-C sends) reaches jupyter-lab: the port closes, no
    jupyter-lab process is left behind, and `evolm lab` exits."""
    import signal as signals

    project = _project_copy(tmp_path)
    port = _free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = open(tmp_path / "lab.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "evolm_lib.cli", "lab", "--no-browser", "--port", str(port), "--ip", "127.0.0.1",
         "--ServerApp.port_retries=0", f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not _port_answers(port):
            assert process.poll() is None, (tmp_path / "lab.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "evolm lab did not open its port"
            time.sleep(0.5)
        servers = _children(process.pid)
        assert len(servers) == 1 and "jupyter" in Path(f"/proc/{servers[0]}/cmdline").read_text()

        process.send_signal(getattr(signals, signum))
        assert process.wait(60) == 0, (tmp_path / "lab.log").read_text()[-3000:]
        assert not _port_answers(port)
        assert not [pid for pid in servers if _alive(pid)], "jupyter-lab outlived evolm lab"
    finally:
        for pid in [process.pid, *servers]:
            if _alive(pid):
                os.kill(pid, 9)
        process.wait(10)
        log.close()
