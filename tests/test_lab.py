"""`make lab`: the command the Makefile runs starts JupyterLab on notebooks/ and prints the URL with its access token;
the server serves the notebooks through its API to that token only, and stops when asked. The Makefile's own command
line is run (read with ``make -n``, so the set-up it depends on is not rerun here), on a free port, with Jupyter's
settings kept in a temporary directory."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120

pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (the notebooks extra: scripts/setup.sh)")


def lab_command(port: int) -> str:
    """The `make lab` recipe, with the port given through its LAB_ARGS."""
    dry = subprocess.run(["make", "-n", "lab", f"LAB_ARGS=--port={port} --ServerApp.port_retries=0"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    recipe = dry.stdout.replace("\\\n", " ")  # the recipe's continued lines, joined
    (line,) = [line for line in recipe.splitlines() if "jupyter lab" in line]
    return line


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_make_lab_serves_the_notebooks(tmp_path):
    port = free_port()
    command = lab_command(port)
    assert "--no-browser" in shlex.split(command) and "--ServerApp.root_dir=notebooks" in shlex.split(command)
    env = {**os.environ, **{name: str(tmp_path / name.lower()) for name in (
        "JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTERLAB_SETTINGS_DIR",
        "JUPYTERLAB_WORKSPACES_DIR", "IPYTHONDIR")}}
    log = (tmp_path / "lab.log").open("w")
    # its own process group: the recipe is a shell running jupyter, and both are stopped together
    server = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (printed := re.search(rf"http://127\.0\.0\.1:{port}/lab\?token=(\w+)",
                                        (tmp_path / "lab.log").read_text())):
            assert server.poll() is None, f"JupyterLab exited: {(tmp_path / 'lab.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"JupyterLab printed no URL: {(tmp_path / 'lab.log').read_text()}"
            time.sleep(0.5)
        token = printed.group(1)
        assert get(f"{base}/api/status?token={token}")[0] == 200
        assert get(f"{base}/api/contents/quickstart.ipynb")[0] == 403  # the token is needed
        status, body = get(f"{base}/api/contents/quickstart.ipynb?token={token}")
        assert status == 200
        notebook = json.loads(body)
        assert notebook["type"] == "notebook" and notebook["content"]["cells"]
        assert any("parameters" in cell["metadata"].get("tags", []) for cell in notebook["content"]["cells"])
        status, page = get(f"{base}/lab?token={token}")
        assert status == 200 and b"JupyterLab" in page
    finally:
        stop(server)
        log.close()


def stop(server: subprocess.Popen) -> None:
    """Stop the server's process group: politely, then for good."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        try:
            server.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
