"""`top`'s "next plan" column against what a real service's next pass does: the jobs top says start are the
ones the service starts, and the jobs it says are preempted are preempted for the job top named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.faces.views import snapshot
from orchestrator.queue.models import JobSpec
from orchestrator.queue.states import JobState
from orchestrator.queue.store import JobStore
from tests.orchestrator.helpers import kill_leftovers, proc_state, wait_for

HOLDING = (JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED)


def _stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (state T; a thread that ended meanwhile has none)."""
    return all(proc_state(pid, int(tid)) in ("T", None) for tid in os.listdir(f"/proc/{pid}/task"))


def _stop_between_writes(store: JobStore, pid: int) -> None:
    """SIGSTOP the service while this process holds the queue's write lock: it is then stopped outside any
    write of its own (one stopped mid-write would hold the lock, and the test's submits would time out).
    The lock is kept until every thread of the service has stopped: kill() returns before they have, and a
    thread still running on the other core (its vCPU descheduled, on a busy VM) could otherwise take the lock
    between this commit and its stop."""
    with store.db.tx() as session:
        session.connection()  # BEGIN IMMEDIATE: waits for a write under way to commit
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: _stopped(pid), timeout=30, interval=0.01, what=f"every thread of the service {pid} stopped")


def test_tops_plan_is_what_the_services_next_pass_does(home):
    settings = Settings.load()
    store = JobStore(settings.db_url)
    serve = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--devices", "cpu:2",
                              "--preempt-after", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        low = api.submit(JobSpec(argv=["sleep", "60"], priority=0, track=False), store=store)[0].id
        wait_for(lambda: store.get(low).job_state is JobState.RUNNING, timeout=120, what="the low job running")
        _stop_between_writes(store, serve.pid)  # no pass until top has planned (well within its heartbeat's age)
        try:
            waiting = [api.submit(JobSpec(argv=["sleep", "60"], priority=p, track=False), store=store)[0].id
                       for p in (10, 50, 5)]
            snap = snapshot.take(settings, store=store, with_gpus=False)
        finally:
            os.kill(serve.pid, signal.SIGCONT)
        starts = {row.job.id for row in snap.queue if row.starts}
        preempts = dict(snap.victims)  # victim -> the job it yields to
        assert starts and preempts == {low: next(iter(preempts.values()))}, [r.plan for r in snap.queue]
        for job_id in starts:
            wait_for(lambda: store.get(job_id).job_state in HOLDING, what=f"job {job_id} started")
        for victim, for_job in preempts.items():
            wait_for(lambda: any(e.dst == "PREEMPTING" for e in store.events(victim)), what="the preemption")
            reason = next(e.reason for e in store.events(victim) if e.dst == "PREEMPTING")
            assert f"#{for_job}" in reason, reason
            wait_for(lambda: store.get(for_job).job_state in HOLDING, what="the preempting job started")
        rest = set(waiting) - starts - set(preempts.values())
        assert rest and all(store.get(j).job_state is JobState.QUEUED for j in rest)  # told to wait, it waits
        others = [j for j in waiting if any(e.dst == "PREEMPTING" for e in store.events(j))]
        assert not others  # nothing else was preempted
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=60)
        kill_leftovers(store)
