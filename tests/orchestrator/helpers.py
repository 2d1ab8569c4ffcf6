"""Helpers for queue tests (imported as tests.orchestrator.helpers)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from orchestrator.queue.models import JobSpec
from orchestrator.queue.states import HOLDING

SCRIPTS = Path(__file__).parent / "scripts"


def wait_for(predicate, timeout=30.0, interval=0.05, what="condition"):
    """Poll `predicate` until it returns a truthy value; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def ckpt_job(steps: int, **kw) -> JobSpec:
    """A JobSpec for the checkpointing stand-in job (50 ms per step)."""
    kw.setdefault("track", False)
    return JobSpec(argv=[sys.executable, str(SCRIPTS / "ckpt_job.py"), str(steps)], **kw)


def proc_state(pid: int, tid: int | None = None) -> str | None:
    """The state letter of process `pid` (or of its thread `tid`) in /proc: R, S, T, Z...; None once it is gone."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    try:
        with open(path) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces
    except FileNotFoundError:
        return None


def started(store, job_id: int) -> list[str]:
    """How each attempt of the job started, as `show` says it (its RUNNING events: `pid N, warm` or `pid N, cold:
    why`)."""
    from orchestrator.api import jobs as api

    return [e.reason for e in api.show(job_id, store)[1] if e.dst == "RUNNING"]


def kill_leftovers(store) -> None:
    """Tests stop services with jobs still running (they would be adopted); kill those process trees (a
    torchrun rank leads a session of its own, outside the job's process group)."""
    import psutil

    for job in store.list(HOLDING):
        if not job.pid:
            continue
        try:
            tree = [psutil.Process(job.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.Error:
            tree = []
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in tree:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(tree, timeout=5)  # dead before the service stops, so it can collect them
