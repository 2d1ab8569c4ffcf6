"""An attempt is its whole process tree: nothing it started outlives a cancel, a preemption or its own end,
whatever session a process put itself in; and torchrun jobs keep the single-process exit protocol.

Real processes, a real torchrun (gloo on cpu slots) and, where this machine has a writable cgroup v2, both
ways of tracking a tree: the cgroup and psutil's descendants (`AUTORESEARCH_CGROUP=off`).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.api import jobs as api
from orchestrator.executors.local import procs
from orchestrator.executors.base import job_argv, job_env, torchrun_shutdown_timeout
from orchestrator.executors.local.executor import LocalExecutor
from orchestrator.executors.torchrun import exit_code
from orchestrator.core.layout import Layout
from orchestrator.queue.models import Job, JobSpec
from tests.orchestrator.helpers import SCRIPTS, wait_for

RANK_JOB = str(SCRIPTS / "rank_job.py")
HAS_CGROUP = procs.cgroup2_root() is not None and os.access(procs.cgroup2_root(), os.W_OK)
TRACKING = ["cgroup", "psutil"]
MODES = ["auto", "off"]


def needs_cgroup(mode: str) -> None:
    """The cgroup cases skip where no writable cgroup v2 exists, and fail under CI (`.ci/run` provides one)."""
    from tests.support.requires import require

    if mode in ("cgroup", "auto"):
        require("a writable cgroup v2", None if HAS_CGROUP else
                f"none at {procs.cgroup2_root() or '/sys/fs/cgroup'} (mount one: see .ci/run)")


@pytest.fixture
def tracking(request, monkeypatch):
    needs_cgroup(request.param)
    monkeypatch.setenv("AUTORESEARCH_CGROUP", "auto" if request.param == "cgroup" else "off")
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")  # device checks are the health suite's
    return request.param


def ranks(out: Path, attempt: int, n: int = 2) -> list[dict]:
    """The records of an attempt's ranks, once all `n` wrote theirs."""
    found = [out / f"{attempt}.{r}.json" for r in range(n)]
    return [json.loads(p.read_text()) for p in found] if all(p.exists() for p in found) else []


def living(records: list[dict]) -> list[int]:
    """The pids of recorded processes that still run (the same process, not a zombie)."""
    alive = []
    for rec in records:
        try:
            proc = psutil.Process(rec["pid"])
            if abs(proc.create_time() - rec["start"]) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(rec["pid"])
        except psutil.Error:
            pass
    return alive


def kill(records: list[dict]) -> None:
    for pid in living(records):
        os.kill(pid, signal.SIGKILL)


def stubborn_pair(out: Path, **kw) -> JobSpec:
    """A two-rank torchrun job whose ranks ignore SIGTERM."""
    return JobSpec(argv=[sys.executable, RANK_JOB, "stubborn", str(out)], gpus=2, grace=3, track=False, **kw)


@pytest.mark.parametrize("tracking", TRACKING, indirect=True)
def test_cancel_leaves_no_rank_of_a_torchrun_job_alive(make_service, tmp_path, tracking):
    """The reported orphan: torchrun starts each rank in a session of its own, so signalling the job's process
    group missed them and both ranks outlived the cancel."""
    service = make_service("cpu:2")
    assert service.executor.tracking == tracking
    job_id = api.submit(stubborn_pair(tmp_path))[0].id
    records = wait_for(lambda: ranks(tmp_path, 1), timeout=120, what="both ranks to start")
    try:
        assert len({os.getsid(r["pid"]) for r in records}) == 2  # each rank leads a session of its own
        api.cancel(job_id)
        wait_for(lambda: service.store.get(job_id).state == "CANCELLED", timeout=60, what="the cancel")
        assert living(records) == []
    finally:
        kill(records)


def test_preemption_frees_the_devices_only_once_every_rank_is_gone(make_service, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTORESEARCH_CGROUP", "off")  # the harder case: psutil's tree, no cgroup
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")
    service = make_service("cpu:2", preempt_after=0)
    low = api.submit(stubborn_pair(tmp_path, priority=0))[0].id
    records = wait_for(lambda: ranks(tmp_path, 1), timeout=120, what="both ranks to start")
    try:
        high = api.submit(JobSpec(argv=["sh", "-c", "echo high"], priority=50, track=False))[0].id
        wait_for(lambda: service.store.get(high).state == "SUCCEEDED", timeout=60, what="the high job")
        assert living(records) == []  # its device was handed over only after both ranks were gone
        assert service.store.get(low).preemptions == 1
        api.cancel(low)
        wait_for(lambda: service.store.get(low).state == "CANCELLED", timeout=60, what="the cancel")
    finally:
        kill(records + ranks(tmp_path, 2))


def test_a_ranks_exit_75_requeues_the_job_without_spending_an_attempt(make_service, tmp_path, monkeypatch):
    """torchrun reports any failed rank as exit 1; a rank asking to be requeued must not use up the job's
    only attempt. The ranks see the job protocol's variables, not the wrapper's own variables."""
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")
    service = make_service("cpu:2")
    spec = JobSpec(argv=[sys.executable, RANK_JOB, "tempfail", str(tmp_path)], gpus=2, max_attempts=1,
                   track=False)
    job_id = api.submit(spec)[0].id
    wait_for(lambda: service.store.get(job_id).job_state.value in ("SUCCEEDED", "FAILED"), timeout=180,
             what="the job to end")
    job = service.store.get(job_id)
    assert (job.state, job.attempts, job.failures) == ("SUCCEEDED", 2, 0), [e.reason for e in
                                                                          service.store.events(job_id)]
    assert any("exit 75" in e.reason for e in service.store.events(job_id))
    # Rank 1's own record (rank 0's may never be written: torchrun stops it once rank 1 has exited).
    env = set(json.loads((tmp_path / "1.1.json").read_text())["env"])
    assert {"AUTORESEARCH_JOB_ID", "AUTORESEARCH_CHECKPOINT_DIR"} <= env
    assert not {"AUTORESEARCH_EXIT_FILE", "AUTORESEARCH_CGROUP"} & env


# ---- the executor alone ------------------------------------------------------------------------------------

def _job(tmp_path: Path, argv: list[str], job_id: int = 1) -> Job:
    return Job(id=job_id, attempts=1, argv=argv, gpus=1, devices=[], cwd=str(tmp_path), grace=2.0,
               log_path=str(tmp_path / f"{job_id}.log"), track=False)


def _reap(pids: list[int]) -> None:
    """Collect the wrappers this test process started through an executor it closed (a service that went
    away leaves that to init): a zombie keeps its cgroup from being removed."""
    for pid in pids:
        try:
            psutil.Process(pid).kill()
            os.waitpid(pid, 0)
        except (psutil.Error, ChildProcessError):
            pass


def _daemonizing(pidfile: Path, then: str, then_in_helper: str = "exec sleep 300") -> list[str]:
    """A job that starts a helper in a session of its own (ignoring SIGTERM; it goes on with `then_in_helper`),
    waits until it runs, then `then` (shell commands)."""
    helper = f"trap '' TERM; echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; {then_in_helper}"
    return ["sh", "-c", f'setsid sh -c "{helper}" & while [ ! -e {pidfile} ]; do sleep 0.02; done; {then}']


@pytest.mark.parametrize("mode", MODES)
def test_an_attempt_is_reported_only_once_its_daemonized_helper_is_gone(tmp_path, mode):
    needs_cgroup(mode)
    exits: queue.Queue = queue.Queue()
    layout = Layout(tmp_path / "home")
    executor = LocalExecutor(layout, exits.put, cgroup=mode)
    pidfile = tmp_path / "helper.pid"
    job = _job(tmp_path, _daemonizing(pidfile, "exit 0"))
    try:
        executor.launch(job, job_env(job, base=dict(os.environ), layout=layout, tracking_uri=""))
        ended = exits.get(timeout=30)
        helper = int(pidfile.read_text())
        assert (ended.job_id, ended.code) == (1, 0) and "leftover processes" in ended.detail
        assert not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE
    finally:
        executor.close()


@pytest.mark.parametrize("mode", MODES)
def test_an_ended_jobs_leftover_that_keeps_starting_processes_leaves_none_running(tmp_path, mode):
    """A leftover that starts processes as fast as it can (a worker pool respawning its workers): one it starts
    just before its SIGKILL is orphaned to init, outside the tree the watcher looked at. The watcher looks
    again by the job's environment until nothing of the attempt is left, and only then reports the end."""
    needs_cgroup(mode)
    exits: queue.Queue = queue.Queue()
    layout = Layout(tmp_path / "home")
    executor = LocalExecutor(layout, exits.put, cgroup=mode)
    pidfile = tmp_path / "helper.pid"
    job = _job(tmp_path, _daemonizing(pidfile, "exit 0", then_in_helper="while :; do sleep 300 & done"))
    env = job_env(job, base=dict(os.environ), layout=layout, tracking_uri="")
    env["TEST_ATTEMPT_MARK"] = str(tmp_path)
    try:
        executor.launch(job, env)
        ended = exits.get(timeout=60)
        assert (ended.job_id, ended.code) == (1, 0) and "leftover processes" in ended.detail
        assert _marked(str(tmp_path)) == []
    finally:
        for proc in _marked(str(tmp_path)):
            proc.kill()
        executor.close()


def _marked(mark: str) -> list[psutil.Process]:
    """Live processes started with TEST_ATTEMPT_MARK=`mark`."""
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TEST_ATTEMPT_MARK") == mark and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


@pytest.mark.parametrize("mode", MODES)
def test_stop_reaches_a_helper_in_another_session_and_adoption_finds_the_tree_again(tmp_path, mode):
    """SIGTERM, then SIGKILL after the grace, to every process of the attempt; a second executor (a restarted
    service) stops a tree it did not start."""
    needs_cgroup(mode)
    exits: queue.Queue = queue.Queue()
    layout = Layout(tmp_path / "home")
    first = LocalExecutor(layout, lambda _exit: None, cgroup=mode)
    pidfile = tmp_path / "helper.pid"
    job = _job(tmp_path, _daemonizing(pidfile, "trap '' TERM; sleep 300"))
    launched = first.launch(job, job_env(job, base=dict(os.environ), layout=layout, tracking_uri=""))
    wait_for(pidfile.exists, timeout=30, what="the helper")
    helper = int(pidfile.read_text())
    watch = first._watcher.get((job.id, job.attempts))  # what the service knows of the attempt's tree
    wait_for(lambda: helper in {p.pid for p in watch.tree.members(refresh=False)}, timeout=30,
             what="the watcher's refresh to know the helper (psutil mode)")
    first.close()  # the service goes away; the job keeps running
    job.pid, job.proc_start = launched.pid, launched.proc_start
    second = LocalExecutor(layout, exits.put, cgroup=mode)
    try:
        assert second.probe(job).state.value == "running"
        assert second.adopt(job) is True
        assert second.stop(job) == signal.SIGTERM  # ignored by both
        assert second.stop(job, since=time.time()) is None  # within the grace: nothing more
        assert second.stop(job, since=time.time() - job.grace) == signal.SIGKILL
        ended = exits.get(timeout=30)
        assert ended.code == -signal.SIGKILL
        helper = int(pidfile.read_text())
        assert not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE
        assert second.probe(job).state.value == "gone"
    finally:
        _reap([launched.pid])
        second.close()


def test_torchrun_gets_a_shutdown_timeout_below_the_grace():
    for grace in (1, 3, 30, 120, 600):
        timeout = torchrun_shutdown_timeout(grace)
        assert 1 <= timeout and (timeout < grace or grace <= 1)
        assert timeout >= 0.6 * grace or grace < 5  # most of the grace goes to the ranks' own save
    argv = job_argv(Job(id=1, argv=["python", "t.py"], gpus=2, grace=120))
    assert "--shutdown-timeout=115" in argv and argv[-2:] == ["python", "t.py"]


def test_torchrun_exit_codes_map_back_to_the_job_protocol():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failures(*codes):
        return {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="")
                for rank, code in enumerate(codes)}

    assert exit_code(failures(75)) == 75
    assert exit_code(failures(-signal.SIGTERM, 75)) == 75  # one rank asked to be requeued
    assert exit_code(failures(3)) == 3
    assert exit_code(failures(-signal.SIGKILL)) == 128 + signal.SIGKILL


def _restarted(tmp_path: Path, mode: str, jobs: list[Job], ready: Path) -> LocalExecutor:
    """Start `jobs` through one service's executor, wait for `ready` to exist, and close that executor as a
    service that went away does; the executor of the service started next."""
    layout = Layout(tmp_path / "home")
    first = LocalExecutor(layout, lambda _exit: None, cgroup=mode)
    for job in jobs:
        launched = first.launch(job, job_env(job, base=dict(os.environ), layout=layout, tracking_uri=""))
        job.pid, job.proc_start = launched.pid, launched.proc_start
    wait_for(ready.exists, timeout=30, what=f"{ready.name} to exist")
    first.close()
    return LocalExecutor(layout, lambda _exit: None, cgroup=mode)


@pytest.mark.parametrize("mode", MODES)
def test_strays_are_stopped_with_every_process_they_started(tmp_path, mode):
    """A restarted service finds attempts the queue no longer gives it (another host reaped it meanwhile) and
    stops each whole tree: SIGTERM, then SIGKILL after the grace for what ignores it."""
    needs_cgroup(mode)
    pidfile = tmp_path / "helper.pid"
    kept, stray = _job(tmp_path, ["sleep", "300"], job_id=1), _job(tmp_path, _daemonizing(pidfile, "sleep 300"), 2)
    second = _restarted(tmp_path, mode, [kept, stray], pidfile)
    try:
        assert second.stop_strays({(kept.id, kept.attempts)}, grace=0.5) == [stray.id]
        helper = int(pidfile.read_text())
        wait_for(lambda: second.probe(stray).state.value != "running", timeout=30, what="the stray to stop")
        assert not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE
        assert second.probe(kept).state.value == "running"  # still the queue's: left alone
        assert second.stop(kept) == signal.SIGTERM
        wait_for(lambda: second.probe(kept).state.value != "running", timeout=30, what="the kept job to stop")
    finally:
        _reap([kept.pid, stray.pid])
        second.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_stray_that_starts_a_process_as_it_is_stopped_leaves_nothing_running(tmp_path, mode):
    """A stray's job that answers SIGTERM by starting a process (an upload on the way out) and exiting leaves
    that process orphaned, outside every tree the stop looked at: the SIGKILL after the grace still finds it, by
    the job's environment, as the watcher does for a job that ends."""
    needs_cgroup(mode)
    ready, late = tmp_path / "ready", tmp_path / "late.pid"
    on_term = f"sleep 300 & echo $! > {late}.tmp; mv {late}.tmp {late}; exit 0"
    stray = _job(tmp_path, ["sh", "-c", f"trap '{on_term}' TERM; touch {ready}; while :; do sleep 0.05; done"], 3)
    second = _restarted(tmp_path, mode, [stray], ready)
    try:
        assert second.stop_strays(set(), grace=0.5) == [stray.id]
        wait_for(late.exists, timeout=30, what="the process started on SIGTERM")
        orphan = int(late.read_text())
        wait_for(lambda: not procs.pid_alive(orphan), timeout=30, what="the process started on SIGTERM to be killed")
        assert second.probe(stray).state.value != "running"
    finally:
        _reap([stray.pid])
        second.close()


def test_adoption_finds_a_wrapper_whose_start_time_was_recorded_in_another_format(tmp_path):
    """Jobs recorded by an older service (kernel ticks instead of psutil's start time) are adopted through the
    wrapper's environment, not killed as leftovers."""
    exits: queue.Queue = queue.Queue()
    layout = Layout(tmp_path / "home")
    first = LocalExecutor(layout, lambda _exit: None)
    gate = tmp_path / "gate"
    job = _job(tmp_path, ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 5"])
    job.pid = first.launch(job, job_env(job, base=dict(os.environ), layout=layout, tracking_uri="")).pid
    job.proc_start = "123456789"  # field 22 of /proc/PID/stat, as services before psutil recorded it
    first.close()
    second = LocalExecutor(layout, exits.put)
    try:
        assert second.adopt(job) is True
        gate.touch()
        ended = exits.get(timeout=30)
        assert (ended.job_id, ended.code) == (job.id, 5)
    finally:
        _reap([job.pid])
        second.close()
