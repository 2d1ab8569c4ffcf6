"""Several services sharing one queue: reaping the jobs of a host that died, and waking on PostgreSQL NOTIFY.

Dead-host semantics (a documented choice). A service heart-beats every 2 s into the `services` table. When a
host's heartbeat is older than `stale_after`, any live service may reap it; exactly one does at a time (it holds
the host's `services` row lock, `FOR UPDATE SKIP LOCKED`, while it works; on SQLite, which only services of
one machine can share, an atomic UPDATE gives it a short lease on that row). For each job the dead host held:
- its process is still alive on this machine (the service died, not the machine; the pid and its kernel start
  time both match): it is stopped like a preemption, SIGTERM then SIGKILL after the job's grace, and settled
  on a later pass once gone. It checkpoints and runs again elsewhere; it never runs twice at once;
- it ended and its wrapper recorded an exit code (visible here: same machine or a shared home): the job gets
  the state that code earns, except that the code of a job this reaper stopped requeues it without spending
  an attempt (the loss was not the job's fault);
- a Ray job (`proc_start` is `ray:SID@ADDRESS`): the Ray job is stopped through the Jobs API, and settled the
  same way from Ray's status once it has ended (while the cluster does not answer, the job waits);
- otherwise (another machine that stopped answering, or a job not yet spawned) it is requeued, like Slurm
  requeues the jobs of a node that went down. A job whose machine is alive but unreachable from here would
  then run twice: the stale limit (10 s, five missed heartbeats) is the guard, as in every lease-based queue.
When such a machine's service comes back, it does not adopt the jobs it lost (they are no longer its own);
stopping their orphaned processes then is left to its reconcile step (not done yet).
Once the dead host holds nothing, its `services` row is deleted. A service that stopped cleanly removes its
own row and its jobs wait for it to come back (they are adopted), so only crashed hosts are reaped.
"""

from __future__ import annotations

import logging
import os
import select as io_select
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from sqlalchemy import delete, update
from sqlmodel import Session, select

from orchestrator.executors.base import group_alive, proc_start_time, same_process
from orchestrator.queue.models import Job, ServiceRecord
from orchestrator.queue.states import HOLDING, JobState
from orchestrator.queue.store import JobStore

log = logging.getLogger(__name__)
S = JobState
CHANNEL = "autoresearch_jobs"
LEASE = 5.0  # seconds a SQLite reaper owns a dead host's row


def reap_dead_hosts(store: JobStore, self_host: str, stale_after: float) -> list[Job]:
    """Settle the jobs of every host whose heartbeat is older than `stale_after` seconds; returns the jobs
    whose state changed (requeued or finished), so the caller can wake its dispatcher."""
    cutoff = time.time() - stale_after
    with Session(store.engine) as session:
        stale = list(session.exec(select(ServiceRecord.host).where(
            ServiceRecord.host != self_host, ServiceRecord.heartbeat_at < cutoff)))
    changed: list[Job] = []
    for host in stale:
        changed.extend(_reap_host(store, host, self_host, cutoff))
    return changed


def _reap_host(store: JobStore, host: str, self_host: str, cutoff: float) -> list[Job]:
    if not store.is_postgres:
        # SQLite: holding a write transaction here would block the store's own. Elect by an atomic UPDATE that
        # takes a short lease on the dead host's row (it looks fresh to other reapers for LEASE seconds).
        with store.engine.begin() as conn:
            won = conn.execute(update(ServiceRecord).where(ServiceRecord.host == host,
                                                           ServiceRecord.heartbeat_at < cutoff)
                               .values(heartbeat_at=cutoff + LEASE)).rowcount
        if not won:
            return []
        changed, done = _settle(store, host, self_host, home=_home_of(store, host))
        if done:
            with store.engine.begin() as conn:
                conn.execute(delete(ServiceRecord).where(ServiceRecord.host == host,
                                                         ServiceRecord.heartbeat_at <= cutoff + LEASE))
        return changed
    with Session(store.engine) as session, session.begin():
        record = session.exec(select(ServiceRecord).where(
            ServiceRecord.host == host, ServiceRecord.heartbeat_at < cutoff)
            .with_for_update(skip_locked=True)).first()
        if record is None:
            return []  # another service is reaping it, or it came back
        changed, done = _settle(store, host, self_host, home=record.home)
        if done:
            session.delete(record)
            log.warning("host %s is gone (no heartbeat since %.0fs ago); its jobs were settled",
                        host, time.time() - record.heartbeat_at)
    return changed


def _home_of(store: JobStore, host: str) -> Optional[str]:
    with Session(store.engine) as session:
        record = session.get(ServiceRecord, host)
        return record.home if record is not None else None


def _settle(store: JobStore, host: str, self_host: str, home: Optional[str]) -> tuple[list[Job], bool]:
    """One pass over the dead host's jobs; True when none is left holding devices."""
    changed: list[Job] = []
    pending = False
    reason = f"host {host} lost (no heartbeat)"
    for job in store.list(HOLDING, host=host):
        outcome = _probe(job, home)
        if job.job_state is S.STARTING and outcome not in (None, "unknown"):
            # Spawned, but the dead service never recorded it: record it, then stop or settle it as the rest.
            pgid = _attempt_group(job, home) if outcome == "running" else None
            job = store.mark_running(job.id, pgid or 0, proc_start_time(pgid) if pgid else None, self_host)
        if outcome in ("running", "unknown"):
            if outcome == "running":
                _stop(store, job, home)
            pending = True
            continue
        stopped_by_us = job.job_state is S.RUNNING and job.stop_sent_at is not None
        if isinstance(outcome, int) and not (stopped_by_us and outcome != 0):
            changed.append(store.finish(job.id, outcome, self_host,
                                        detail=f"exit code {outcome}, recorded after {reason}"))
        else:
            changed.append(store.requeue(job.id, reason, self_host))
        log.info("reaped job %s of %s -> %s", job.id, host, changed[-1].state)
    return changed, not pending


def _probe(job: Job, home: Optional[str]):
    """'running' while the attempt's processes live; its exit code once it ended and left one; else None."""
    from orchestrator.executors import ray as ray_exec

    handle = ray_exec.parse_handle(job.proc_start)
    if handle is not None:
        try:
            info = ray_exec.client_for(handle[1]).get_job_info(handle[0])
        except Exception as exc:
            if "does not exist" in str(exc):
                return None  # the cluster forgot it (restarted): requeue
            log.warning("cannot ask Ray about job %s (%s); trying again later", job.id, exc)
            return "unknown"  # an unreachable cluster runs nothing new either: wait rather than risk a rerun
        if not info.status.is_terminal():
            return "running"
        return ray_exec.exit_of(info)[0] if info.driver_exit_code is not None else None
    if job.pid and same_process(job.pid, job.proc_start):
        return "running"
    if _attempt_group(job, home) is not None:
        return "running"  # the wrapper is gone (or unrecorded) but a process of the attempt lives on
    if home:
        try:
            return int((Path(home) / "run" / f"{job.id}.{job.attempts}.exit").read_text().strip())
        except (OSError, ValueError):
            pass
    return None


def _attempt_group(job: Job, home: Optional[str]) -> Optional[int]:
    """The process group of the job's attempt on this machine, found by the exit file its environment names
    (the local executor's wrapper sets it); None when no such process lives here."""
    if not home or (job.pid and not group_alive(job.pid)):
        return None
    needle = f"AUTORESEARCH_EXIT_FILE={Path(home) / 'run' / f'{job.id}.{job.attempts}.exit'}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            pgid = os.getpgid(int(entry))
            if job.pid and pgid != job.pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    return pgid
        except OSError:
            continue
    return None


def _stop(store: JobStore, job: Job, home: Optional[str]) -> None:
    """SIGTERM the orphaned attempt once, then SIGKILL after its grace (one step per reaper pass)."""
    from orchestrator.executors import ray as ray_exec

    handle = ray_exec.parse_handle(job.proc_start)
    if job.stop_sent_at is not None and time.time() - job.stop_sent_at < job.grace:
        return
    sig = signal.SIGTERM if job.stop_sent_at is None else signal.SIGKILL
    if handle is not None:
        try:
            ray_exec.client_for(handle[1]).stop_job(handle[0])  # Ray applies the grace itself
        except Exception as exc:
            log.warning("could not stop Ray job %s: %s", handle[0], exc)
    else:
        pgid = job.pid if job.pid and same_process(job.pid, job.proc_start) else _attempt_group(job, home)
        try:
            if pgid:
                os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if job.stop_sent_at is None:
        store.mark_stop_sent(job.id)
    log.warning("job %s of a lost host still runs here: sent %s", job.id, signal.Signals(sig).name)


class PgListener:
    """Calls `callback` whenever PostgreSQL delivers a NOTIFY on `autoresearch_jobs` (a submit on any host).

    A daemon thread LISTENs on its own connection and waits on its socket with select(); it reconnects with
    a backoff when the connection drops, and calls the callback after reconnecting, since notifications sent
    meanwhile are lost."""

    def __init__(self, url: str, callback: Callable[[], None], *, channel: str = CHANNEL):
        self.dsn = _dsn(url)
        self.channel = channel
        self._callback = callback
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._conn = None
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-listen", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = 0.5
        first = True
        while not self._stop.is_set():
            try:
                self._listen(first)
                delay = 0.5
            except Exception as exc:
                log.warning("LISTEN %s failed (%s); reconnecting in %.1fs", self.channel, exc, delay)
            finally:
                self.connected.clear()
                self._close_conn()
            first = False
            self._stop.wait(delay)
            delay = min(delay * 2, 10.0)

    def _listen(self, first: bool) -> None:
        import psycopg2
        import psycopg2.extensions

        conn = psycopg2.connect(self.dsn, connect_timeout=5)
        conn.set_isolation_level(psycopg2.extensions.ISOLATION_LEVEL_AUTOCOMMIT)
        self._conn = conn
        with conn.cursor() as cur:
            cur.execute(f"LISTEN {self.channel}")
        self.connected.set()
        if not first:
            self._callback()  # submits made while we were disconnected
        while not self._stop.is_set():
            ready, _, _ = io_select.select([conn, self._wake_r], [], [], 30.0)
            if self._wake_r in ready:
                return
            conn.poll()  # raises when the connection is gone
            if not ready:
                with conn.cursor() as cur:
                    cur.execute("SELECT 1")  # detect a dead peer on an idle connection
                continue
            if conn.notifies:
                conn.notifies.clear()
                self._callback()

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def close(self) -> None:
        """Stop listening and close the connection."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _dsn(url: str) -> str:
    """A libpq DSN from a SQLAlchemy PostgreSQL URL (options such as search_path are kept)."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    parts = {"host": u.host, "port": u.port, "dbname": u.database, "user": u.username, "password": u.password}
    parts.update({k: v for k, v in u.query.items() if isinstance(v, str)})
    return " ".join(f"{k}='{str(v)}'" for k, v in parts.items() if v is not None)
