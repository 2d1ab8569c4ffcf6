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
    from orchestrator.config import Settings
    from orchestrator.tracking import Tracker

    tracker = Tracker.from_settings(Settings.load())
    run = tracker.session_run("s-0000ui00", "digits", {"goal": "g"})
    tracker.best_so_far_plot(run, [0.5, None, 0.7, 0.6], "maximize", "val_accuracy")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from orchestrator.cli import main; main()", "ui", "--port",
                             str(port)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, body = time.time() + 150, None
        while time.time() < deadline and proc.poll() is None:
            try:
                url = f"{base}/get-artifact?path=best_so_far.png&run_uuid={run}"
                body = urllib.request.urlopen(url, timeout=10).read()
                break
            except OSError:
                time.sleep(1)
        assert body is not None and body[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr.read().decode()[-2000:] \
            if proc.poll() is not None else "the server did not answer in time"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # It says where the session's runs are, and MLflow 3 opens the experiment on its training-runs table.
    exp = tracker.client.get_experiment_by_name("digits")
    said = proc.stderr.read().decode()
    assert f"session s-0000ui00: {base}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning" \
        "&searchFilter=" in said
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    bad = subprocess.run([sys.executable, "-c", "from orchestrator.cli import main; main()", "ui", "--port", "0"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--port" in bad.stderr
