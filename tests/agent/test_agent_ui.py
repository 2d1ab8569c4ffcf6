"""`autoresearch ui` starts a real MLflow server on this home's store, serving a session's plot artifact."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ui_serves_this_homes_runs_and_artifacts(home):
    from orchestrator.core.config import Settings
    from orchestrator.tracking.client import Tracker

    cli = [sys.executable, "-c", "from orchestrator.faces.cli import main; main()", "ui"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Bad input is refused before anything starts; it is checked alongside the server's start-up.
    bad = subprocess.Popen([*cli, "--port", "0"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    tracker = Tracker.from_settings(Settings.load())
    run = tracker.session_run("s-0000ui00", "digits", {"goal": "g"})
    tracker.best_so_far_plot(run, [0.5, None, 0.7, 0.6], "maximize", "val_accuracy")
    port = free_port()
    said_path = home.parent / "ui.stderr"
    # Its output goes to a file, not a pipe: after Ctrl-C the server's worker may hold a pipe open for
    # seconds while it winds down, and what it said is complete once the command itself has exited.
    with open(said_path, "wb") as said_file:
        proc = subprocess.Popen([*cli, "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=said_file, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, body = time.time() + 150, None
        while time.time() < deadline and proc.poll() is None:
            try:
                url = f"{base}/get-artifact?path=best_so_far.png&run_uuid={run}"
                body = urllib.request.urlopen(url, timeout=10).read()
                break
            except OSError:
                time.sleep(0.25)
        assert body is not None and body[:8] == b"\x89PNG\r\n\x1a\n", said_path.read_text()[-2000:] \
            if proc.poll() is not None else "the server did not answer in time"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of its group (a worker still winding down)
        except ProcessLookupError:
            pass
    # It says where the session's runs are, and MLflow 3 opens the experiment on its training-runs table.
    exp = tracker.client.get_experiment_by_name("digits")
    said = said_path.read_text()
    assert f"session s-0000ui00: {base}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning" \
        "&searchFilter=" in said
    assert f"experiment digits: {base}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning\n" \
        in said
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert bad.wait(timeout=60) == 2 and "--port" in bad.stderr.read()
