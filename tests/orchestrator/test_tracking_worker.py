"""The tracking worker killed (kill -9) or hung in the middle of a batch of runs: the jobs whose runs it had not
answered wait with the "waiting: MLflow" reason, no attempt spent; a new worker makes their runs later; every job
ends with one MLflow run, the one the queue records (none made twice, none left behind)."""

from __future__ import annotations

import os
import signal
import sqlite3
from collections import Counter

import psutil
import pytest

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.tracking import worker as tracking_worker
from orchestrator.tracking.client import TAG_JOB
from orchestrator.tracking.preparer import RunPreparer
from orchestrator.tracking.worker import TrackingWorker

def mlflow_runs(db) -> Counter:
    """How many runs the MLflow store holds per job id tag."""
    with sqlite3.connect(db, timeout=60) as conn:
        rows = conn.execute("SELECT value FROM tags WHERE key = ?", (TAG_JOB,)).fetchall()
    return Counter(int(value) for value, in rows)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_tracking_worker_lost_mid_batch_leaves_one_run_per_job(home, monkeypatch, how):
    settings = Settings.load()
    db = settings.tracking_uri[len("sqlite:///"):]
    store = JobStore(settings.db_url)
    # Tracked, and heavy to record (100 params each): the worker is still writing the batch long after the
    # test has taken the lock at the first answers, however fast the machine.
    params = {f"p{i}": "x" * 100 for i in range(100)}
    jobs = [api.submit(JobSpec(argv=["true"], params=params), store=store)[0].id for _ in range(120)]
    worker = TrackingWorker(settings.tracking_uri, settings.artifacts_dir)
    lock = sqlite3.connect(db, timeout=60, isolation_level=None)
    lost = []

    def on_ready() -> None:  # the first runs are recorded: the batch is under way
        if lost:
            return
        pid = worker.pid
        lost.append(pid)
        # (Set only now: the first answer waits for MLflow's import, slow on a loaded machine.)
        monkeypatch.setattr(tracking_worker, "ANSWER_WITHIN", 2.0)
        # No further run can be committed from here. The worker is stopped wherever it is: in a transaction,
        # or between a commit and its answers (the next worker adopts those runs instead of making them twice).
        lock.execute("BEGIN EXCLUSIVE")
        made = lock.execute("SELECT COUNT(*) FROM tags WHERE key = ?", (TAG_JOB,)).fetchone()[0]
        assert made < len(jobs), "the worker made the whole batch before it could be stopped"
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)

    preparer = RunPreparer(store, worker, capacity=lambda: 1, on_ready=on_ready, retry_after=0.1,
                           batch=len(jobs))
    try:
        preparer.prepare_once()
        lock.execute("COMMIT")
        assert lost and not psutil.pid_exists(lost[0])  # the hung one was killed, and both were collected
        waiting = [store.get(job_id) for job_id in jobs if store.get(job_id).mlflow_run_id is None]
        assert waiting, "the worker was stopped after the batch"
        reason = waiting[0].reason
        assert reason.startswith("waiting: MLflow") and "no attempt spent" in reason, reason
        assert ("gave no answer" if how == "hung" else "exited") in reason, reason
        assert all(job.reason == reason and job.attempts == 0 and job.state == "QUEUED" for job in waiting)
        monkeypatch.setattr(tracking_worker, "ANSWER_WITHIN", 300.0)  # (the new worker imports MLflow)
        preparer.prepare_once()  # the pause is over: a new worker makes the rest
        assert worker.started == 2
        recorded = {job_id: store.get(job_id).mlflow_run_id for job_id in jobs}
        assert None not in recorded.values()
        assert mlflow_runs(db) == Counter(jobs)  # one run per job: none made twice, none orphaned
        with sqlite3.connect(db) as conn:
            made = {int(v): r for r, v in conn.execute("SELECT run_uuid, value FROM tags WHERE key = ?",
                                                        (TAG_JOB,))}
        assert made == recorded  # the runs in MLflow are the runs the queue records
    finally:
        lock.close()
        worker.close()


def test_runs_made_and_never_answered_are_adopted_not_made_twice(home):
    """A service (or worker) killed between the commit of a batch's runs and their answers: the next worker
    answers those runs for their jobs; a run tagged with a reused job id from before the job was submitted
    (an earlier queue) is not taken."""
    from orchestrator.tracking.client import Tracker
    from orchestrator.tracking.jobruns import create_runs, run_request

    settings = Settings.load()
    db = settings.tracking_uri[len("sqlite:///"):]
    store = JobStore(settings.db_url)
    jobs = [api.submit(JobSpec(argv=["true"]), store=store)[0] for _ in range(4)]
    tracker = Tracker(settings.tracking_uri, settings.artifacts_dir)
    requests = [run_request(job) for job in jobs]
    orphans = dict(create_runs(tracker, requests[:2] + [requests[3]]))  # committed; the queue never heard of them
    with sqlite3.connect(db) as conn:  # job 4's run is from an earlier queue: two hours before its submission
        conn.execute("UPDATE runs SET start_time = start_time - 7200000 WHERE run_uuid = ?", (orphans[jobs[3].id],))
    worker = TrackingWorker(settings.tracking_uri, settings.artifacts_dir)
    try:
        RunPreparer(store, worker, capacity=lambda: 1, on_ready=lambda: None).prepare_once()
    finally:
        worker.close()
    recorded = {job.id: store.get(job.id).mlflow_run_id for job in jobs}
    assert recorded[jobs[0].id] == orphans[jobs[0].id] and recorded[jobs[1].id] == orphans[jobs[1].id]
    assert None not in recorded.values()
    runs = mlflow_runs(db)
    assert runs[jobs[0].id] == runs[jobs[1].id] == runs[jobs[2].id] == 1  # none made twice
    assert runs[jobs[3].id] == 2 and recorded[jobs[3].id] != orphans[jobs[3].id]  # the stale run not taken
