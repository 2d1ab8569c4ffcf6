"""A `tpe` session on the real digits experiment, through the CLI, the embedded queue service and MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from orchestrator.faces.cli import main; main()", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return finish(spawn(*args), timeout)


def test_tpe_session_on_digits_end_to_end(home):
    # Bad input is refused before anything is made: checked while the session runs (each CLI process mostly
    # spends its time importing, on a core the session leaves idle at times).
    bad = spawn("start", "--goal", "g", "--experiment", "digits", "--param", "epochs=lots")
    done = cli("start", "--goal", "maximise validation accuracy", "--experiment", "digits", "--trials", "2",
               "--param", "epochs=1", "--param", "scale=1", "--devices", "cpu:2", "--baseline-seeds", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "proposer: tpe (no LLM endpoint configured" in done.stderr  # `start` says which it uses
    assert "trial 0 -> job" in done.stderr and "finished:" in done.stderr  # live progress
    summary = json.loads(done.stdout)
    assert summary["counts"] == {"succeeded": 2 + 2} and summary["parallel"] == 2  # the baseline's two runs first
    assert 0.3 < summary["baseline"]["mean"] <= 1.0 and summary["baseline"]["n"] == 2  # 3x chance (10 classes)
    assert summary["headline"].startswith(("improvement +", "no improvement over the baseline found"))

    from orchestrator.core.config import Settings
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker

    settings = Settings.load()
    jobs = JobStore(settings.db_url).list(owner=summary["session"])
    assert [j.state for j in jobs] == ["SUCCEEDED"] * 4 and all(j.priority == 0 for j in jobs)
    tracker = Tracker.from_settings(settings)
    for job, proposer in zip(jobs, ["baseline", "baseline", "tpe", "tpe"]):
        run = tracker.client.get_run(job.mlflow_run_id)
        assert run.data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"]
        assert run.data.tags["autoresearch.proposer"] == proposer
        assert run.data.tags["autoresearch.job_id"] == str(job.id)
        assert "val_accuracy" in run.data.metrics and run.data.params["epochs"] == "1"
    parent = tracker.client.get_run(summary["mlflow_run_id"])
    assert parent.data.params["goal"] == "maximise validation accuracy" and "best_so_far" in parent.data.metrics
    assert sorted(a.path for a in tracker.client.list_artifacts(summary["mlflow_run_id"])) == [
        "best_so_far.png", "report.md"]

    board, listed = spawn("leaderboard", "--experiment", "digits", "--json"), spawn("sessions", "--json")
    board, listed = finish(board), finish(listed)
    assert board.returncode == 0, board.stderr
    (digits,) = json.loads(board.stdout)
    assert digits["metric"] == "val_accuracy" and len(digits["entries"]) == 3  # the baseline and two trials
    assert [e["baseline"] for e in digits["entries"]].count(True) == 1 and digits["headline"]
    sessions = json.loads(listed.stdout)
    assert sessions[0]["id"] == summary["session"] and sessions[0]["status"] == "finished"
    bad = finish(bad)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "epochs" in bad.stderr
