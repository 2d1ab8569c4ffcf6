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


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from orchestrator.cli import main; main()", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=timeout)


def test_tpe_session_on_digits_end_to_end(home):
    done = cli("start", "--goal", "maximise validation accuracy", "--experiment", "digits", "--trials", "2",
               "--param", "epochs=1", "--param", "scale=1", "--devices", "cpu:2", "--baseline-seeds", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "proposer: tpe (no LLM endpoint configured" in done.stderr  # `start` says which it uses
    assert "trial 0 -> job" in done.stderr and "finished:" in done.stderr  # live progress
    summary = json.loads(done.stdout)
    assert summary["counts"] == {"succeeded": 2 + 2} and summary["parallel"] == 2  # the baseline's two runs first
    assert 0.0 < summary["baseline"]["mean"] <= 1.0 and summary["baseline"]["n"] == 2
    assert summary["headline"].startswith(("improvement +", "no improvement over the baseline found"))

    from orchestrator.config import Settings
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking import Tracker

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

    board = cli("leaderboard", "--experiment", "digits", "--json")
    assert board.returncode == 0, board.stderr
    (digits,) = json.loads(board.stdout)
    assert digits["metric"] == "val_accuracy" and len(digits["entries"]) == 3  # the baseline and two trials
    assert [e["baseline"] for e in digits["entries"]].count(True) == 1 and digits["headline"]
    sessions = json.loads(cli("sessions", "--json").stdout)
    assert sessions[0]["id"] == summary["session"] and sessions[0]["status"] == "finished"
    bad = cli("start", "--goal", "g", "--experiment", "digits", "--param", "epochs=lots")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "epochs" in bad.stderr
