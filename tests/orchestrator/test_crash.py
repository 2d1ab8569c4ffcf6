"""Crash safety with real processes: `kill -9` of the service mid-run, restart, and everything reconciled.

Jobs outlive the service (own sessions). After the restart, a job that finished while no service ran ends in
the state its exit code earned, a job still running is adopted (not started twice), queued jobs run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from orchestrator.api import jobs as api
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.core.config import Settings
from tests.orchestrator.helpers import kill_leftovers, proc_state, started, wait_for


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie waiting for its reaper counts as ended)."""
    return proc_state(pid) not in (None, "Z")


def start_serve(devices: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--devices", devices],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def test_kill_9_of_the_service_then_restart_reconciles_every_job(home, tmp_path):
    store = JobStore(Settings.load().db_url)
    serve = start_serve("cpu:3")
    try:
        wait_for(lambda: api.live_services(store), timeout=60, what="the service heartbeat")
        gate = tmp_path / "gate"
        ok_soon = api.submit(JobSpec(argv=["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 0"],
                                     track=False))[0].id
        fail_soon = api.submit(JobSpec(argv=["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 3"],
                                       track=False))[0].id
        long_run = api.submit(JobSpec(argv=["sh", "-c", f"while [ ! -e {gate}.2 ]; do sleep 0.05; done"],
                                      track=False))[0].id
        queued = api.submit(JobSpec(argv=["true"], track=False))[0].id
        wait_for(lambda: all(store.get(j).state == "RUNNING" for j in (ok_soon, fail_soon, long_run)),
                 what="three running jobs")
        assert store.get(queued).state == "QUEUED"
        pid_before = store.get(long_run).pid

        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(timeout=10)
        assert all(alive(store.get(j).pid) for j in (ok_soon, fail_soon, long_run)), "jobs outlive the service"
        gate.touch()  # two jobs end while no service watches them
        # Their processes are gone before the next service starts, so it must settle them from what their
        # wrappers recorded; without this wait it might just watch them end (adoption, tested below).
        wait_for(lambda: not alive(store.get(ok_soon).pid) and not alive(store.get(fail_soon).pid), timeout=10,
                 what="the two gated jobs to end with no service running")
        assert store.get(ok_soon).state == store.get(fail_soon).state == "RUNNING"  # nobody recorded them

        serve = start_serve("cpu:3")
        wait_for(lambda: store.get(ok_soon).state == "SUCCEEDED", timeout=60, what="reconcile of the finished job")
        assert store.get(fail_soon).state == "FAILED" and store.get(fail_soon).exit_code == 3
        wait_for(lambda: store.get(queued).state == "SUCCEEDED", timeout=30, what="the queued job")
        adopted = store.get(long_run)
        assert adopted.state == "RUNNING" and adopted.pid == pid_before  # adopted, not started again
        (tmp_path / "gate.2").touch()
        wait_for(lambda: store.get(long_run).state == "SUCCEEDED", timeout=30, what="the adopted job's exit")
        for job_id in (ok_soon, fail_soon, long_run, queued):
            assert store.get(job_id).attempts == 1, "no job ran twice"
    finally:
        kill_leftovers(store)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=20)


def test_sigterm_stops_the_service_cleanly_and_leaves_jobs_for_the_next_one(home, tmp_path):
    store = JobStore(Settings.load().db_url)
    serve = start_serve("cpu:1")
    try:
        wait_for(lambda: api.live_services(store), timeout=60)
        gate = tmp_path / "gate"
        job = api.submit(JobSpec(argv=["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done"], track=False))[0]
        wait_for(lambda: store.get(job.id).state == "RUNNING")
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=20) == 0
        assert not api.live_services(store)  # it said goodbye
        serve = start_serve("cpu:1")
        wait_for(lambda: api.live_services(store), timeout=60)
        gate.touch()
        wait_for(lambda: store.get(job.id).state == "SUCCEEDED", timeout=30)
        assert store.get(job.id).attempts == 1
    finally:
        kill_leftovers(store)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=20)


def test_a_restarted_service_stops_attempts_the_queue_gave_away(home, tmp_path):
    """Another host reaped this one while it was down and requeued its job: the old attempt must not keep
    running next to the new one, so the restarted service stops it."""
    store = JobStore(Settings.load().db_url)
    serve = start_serve("cpu:1")
    try:
        wait_for(lambda: api.live_services(store), timeout=60)
        marker = tmp_path / "stopped"
        script = (f'if [ "$AUTORESEARCH_ATTEMPT" = 1 ]; then trap "echo 1 >> {marker}; exit 143" TERM; '
                  'while :; do sleep 0.05; done; fi')
        job = api.submit(JobSpec(argv=["sh", "-c", script], track=False))[0]
        wait_for(lambda: store.get(job.id).state == "RUNNING")
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(timeout=10)
        store.requeue(job.id, "host lost (reaped by another service)")
        serve = start_serve("cpu:1")
        wait_for(lambda: marker.exists(), timeout=60, what="the stray attempt to be stopped")
        wait_for(lambda: store.get(job.id).state == "SUCCEEDED", timeout=60, what="the requeued attempt")
        assert store.get(job.id).attempts == 2
    finally:
        kill_leftovers(store)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=20)


def test_an_exit_seen_but_not_yet_recorded_survives_a_crash(home, tmp_path):
    """The service can die after its watcher saw a job end but before the store recorded it: the attempt's
    exit record must still be there for the next service (or another host's reaper) to settle the job."""
    import queue

    from orchestrator.executors.local.executor import LocalExecutor
    from orchestrator.core.layout import Layout

    store = JobStore(Settings.load().db_url)
    job = api.submit(JobSpec(argv=["sh", "-c", "exit 4"], track=False))[0]
    [job] = store.claim([(job.id, ["cpu:0"])], "h", log_root=str(tmp_path), checkpoint_root=str(tmp_path))
    seen: queue.Queue = queue.Queue()
    first = LocalExecutor(Layout(tmp_path), seen.put)  # its "service" never commits what it sees
    launched = first.launch(job, dict(os.environ))
    job = store.mark_running(job.id, launched.pid, launched.proc_start, "h")
    assert seen.get(timeout=30).code == 4
    first.close()
    again: queue.Queue = queue.Queue()
    second = LocalExecutor(Layout(tmp_path), again.put)
    assert second.adopt(job) is False
    report = again.get(timeout=10)
    assert (report.job_id, report.code) == (job.id, 4)
    second.forget(job.id, job.attempts)
    assert not Layout(tmp_path).exit_file(job.id, job.attempts).exists()
    second.close()


WAITER = """import pathlib, sys, time
gate = pathlib.Path(sys.argv[1])
print("waiting", flush=True)
while not gate.exists():
    time.sleep(0.05)
sys.exit(int(sys.argv[2]))
"""


def test_warm_attempts_outlive_a_kill_9_of_the_service_and_are_adopted(home, tmp_path):
    """Attempts forked from the warm pool are the cold wrapper's twins after a crash too: they outlive the
    service (and its pool, which exits with it), one that ends meanwhile is settled from its exit file, one
    still running is adopted, and none runs twice."""
    store = JobStore(Settings.load().db_url)
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    serve = start_serve("cpu:2")
    try:
        wait_for(lambda: api.live_services(store), timeout=60, what="the service heartbeat")
        first = api.submit(JobSpec(argv=[sys.executable, str(script), str(tmp_path / "open"), "0"], track=False))
        (tmp_path / "open").touch()  # the first Python attempt starts cold and the pool with it
        wait_for(lambda: store.get(first[0].id).state == "SUCCEEDED", timeout=60, what="the first job")
        run_dir = Settings.load().home / "run"
        wait_for(lambda: any(run_dir.glob("warmpool-*.json")), timeout=60, what="the warm pool to be ready")
        pool = int(json.loads(next(run_dir.glob("warmpool-*.json")).read_text())["pid"])
        ends = api.submit(JobSpec(argv=[sys.executable, str(script), str(tmp_path / "g1"), "3"], track=False))[0].id
        stays = api.submit(JobSpec(argv=[sys.executable, str(script), str(tmp_path / "g2"), "0"], track=False))[0].id
        wait_for(lambda: all(store.get(j).state == "RUNNING" for j in (ends, stays)), what="two running jobs")
        for job_id in (ends, stays):
            assert started(store, job_id)[0].endswith(", warm")
        pid_before = store.get(stays).pid

        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(timeout=10)
        assert alive(store.get(ends).pid) and alive(pid_before), "warm attempts outlive the service"
        wait_for(lambda: not alive(pool), timeout=30, what="the warm pool to exit with its service")
        (tmp_path / "g1").touch()
        wait_for(lambda: not alive(store.get(ends).pid), timeout=10, what="the gated job to end with no service")

        serve = start_serve("cpu:2")
        wait_for(lambda: store.get(ends).state == "FAILED", timeout=60, what="the ended warm job to be settled")
        assert store.get(ends).exit_code == 3
        adopted = store.get(stays)
        assert adopted.state == "RUNNING" and adopted.pid == pid_before  # adopted, not started again
        (tmp_path / "g2").touch()
        wait_for(lambda: store.get(stays).state == "SUCCEEDED", timeout=30, what="the adopted warm job's exit")
        assert all(store.get(j).attempts == 1 for j in (ends, stays)), "no job ran twice"
        assert Path(store.get(stays).log_path).read_text().count("waiting") >= 1
    finally:
        kill_leftovers(store)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=20)
