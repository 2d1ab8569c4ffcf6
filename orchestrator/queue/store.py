"""JobStore: the only code that changes a job's state.

Every transition runs in one transaction that re-reads the row under a write lock (SQLite `BEGIN IMMEDIATE`;
PostgreSQL `SELECT ... FOR UPDATE`), checks Contract 2 allows it, updates the job and appends one event row.
Methods that act on many jobs (the dispatcher's starts, the reaper's finishes) take a batch and still give each
job its own checked transition and event, but share one commit: that is what makes 500 jobs/s possible on
SQLite.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional, Sequence

from sqlalchemy import event, func, or_, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlmodel import Session, SQLModel, create_engine, select

from orchestrator.errors import BadInput, InvalidTransition, JobNotFound, StoreUnavailable
from orchestrator.queue.models import Device, Job, JobEvent, JobSpec, ServiceRecord
from orchestrator.queue.states import ACTIVE, FINISHED, HOLDING, TIME_LIMIT, JobState, allowed

S = JobState
BACKOFF_BASE = 5.0  # first retry after 5 s, doubling (Kueue-style) ...
BACKOFF_CAP = 300.0  # ... up to 5 minutes
EX_TEMPFAIL = 75


def backoff(failures: int, base: float = BACKOFF_BASE, cap: float = BACKOFF_CAP) -> float:
    """Seconds to wait before retry number `failures` (1-based): base, 2*base, 4*base, ... capped."""
    return min(cap, base * (2 ** max(0, failures - 1)))


def _sqlite_engine(url: str) -> Engine:
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # noqa: ANN001
        # Take the write lock up front: read-then-write transactions never deadlock on lock upgrade.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def make_engine(url: str) -> Engine:
    """An engine for `url` (SQLite gets WAL, a busy timeout and immediate transactions)."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise StoreUnavailable(f"cannot open queue database {url}: directory {parent} does not exist")
        return _sqlite_engine(url)
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


class JobStore:
    """Jobs, their events, devices and service heartbeats in one SQL database (SQLite or PostgreSQL)."""

    def __init__(self, url: str, *, create: bool = True):
        self.url = url
        self.is_postgres = url.startswith("postgres")
        try:
            self.engine = make_engine(url)
            if create:
                SQLModel.metadata.create_all(self.engine)
            else:
                with self.engine.connect():
                    pass
        except OperationalError as exc:
            first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc).splitlines()[0]
            raise StoreUnavailable(f"cannot reach queue database {_redact(url)}: {first}") from None
        except Exception as exc:  # bad URL, missing driver
            if isinstance(exc, StoreUnavailable):
                raise
            raise StoreUnavailable(f"cannot open queue database {_redact(url)}: {exc}") from None

    @classmethod
    def from_settings(cls, settings: Any) -> "JobStore":
        return cls(settings.db_url)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session:
            with session.begin():
                yield session

    def _lock_many(self, session: Session, job_ids: Sequence[int]) -> dict[int, Job]:
        """Load (and on PostgreSQL row-lock) several jobs in one query: batches stay one round trip."""
        stmt = select(Job).where(Job.id.in_(list(job_ids)))
        if self.is_postgres:
            stmt = stmt.with_for_update()
        return {job.id: job for job in session.exec(stmt)}

    def _lock(self, session: Session, job_id: int) -> Job:
        stmt = select(Job).where(Job.id == job_id)
        if self.is_postgres:
            stmt = stmt.with_for_update()
        job = session.exec(stmt).first()
        if job is None:
            raise JobNotFound(job_id)
        return job

    @staticmethod
    def _move(session: Session, job: Job, dst: JobState, reason: str, by: Optional[str], now: float,
              **fields: Any) -> Job:
        src = job.job_state
        if not allowed(src, dst):
            raise InvalidTransition(f"job {job.id}: {src} -> {dst} is not allowed")
        if src is S.FAILED and job.failures >= job.max_attempts:
            raise InvalidTransition(f"job {job.id}: failed with no attempts left; it never changes again")
        job.state = dst.value
        job.reason = reason
        for key, value in fields.items():
            setattr(job, key, value)
        if dst in FINISHED:
            job.finished_at = now
        session.add(job)
        session.add(JobEvent(job_id=job.id, at=now, src=src.value, dst=dst.value, reason=reason, host=by))
        return job

    # ---- submitting and reading -------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Job:
        """Queue a job. With an idempotency key already used, return that job instead of a new one."""
        now = time.time()
        if spec.idempotency_key:
            existing = self.find_by_key(spec.idempotency_key)
            if existing is not None:
                return existing
        job = Job(argv=list(spec.argv), env=dict(spec.env), cwd=spec.cwd, track=spec.track, name=spec.name or _default_name(spec),
                  priority=spec.priority, gpus=spec.gpus, max_attempts=spec.max_attempts, grace=float(spec.grace),
                  preemptible=spec.preemptible, owner=spec.owner, experiment=spec.experiment,
                  params=spec.params, mlflow_run_id=spec.mlflow_run_id, idempotency_key=spec.idempotency_key,
                  time_limit=spec.time_limit, state=S.QUEUED.value, reason="submitted", submitted_at=now)
        try:
            with self._tx() as session:
                session.add(job)
                session.flush()
                session.add(JobEvent(job_id=job.id, at=now, src=None, dst=S.QUEUED.value, reason="submitted"))
                if self.is_postgres:
                    from sqlalchemy import text

                    session.execute(text("NOTIFY autoresearch_jobs"))
        except IntegrityError:
            if spec.idempotency_key:  # a concurrent submit with the same key won the race
                existing = self.find_by_key(spec.idempotency_key)
                if existing is not None:
                    return existing
            raise
        return job

    def find_by_key(self, key: str) -> Optional[Job]:
        with Session(self.engine, expire_on_commit=False) as session:
            return session.exec(select(Job).where(Job.idempotency_key == key)).first()

    def get(self, job_id: int) -> Job:
        """The job with this id, or JobNotFound (a BadInput: exit 2)."""
        with Session(self.engine, expire_on_commit=False) as session:
            job = session.get(Job, job_id)
            if job is None:
                raise JobNotFound(job_id)
            return job

    def list(self, states: Optional[Iterable[JobState]] = None, *, owner: Optional[str] = None,
             experiment: Optional[str] = None, host: Optional[str] = None) -> list[Job]:
        """Jobs in id order, filtered by state(s), owner, experiment and host."""
        stmt = select(Job)
        if states is not None:
            stmt = stmt.where(Job.state.in_([JobState(s).value for s in states]))
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        if experiment is not None:
            stmt = stmt.where(Job.experiment == experiment)
        if host is not None:
            stmt = stmt.where(Job.host == host)
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.exec(stmt.order_by(Job.id)))

    def unfinished(self) -> list[Job]:
        """What `autoresearch queue` shows by default: active jobs and failed ones awaiting a retry."""
        with Session(self.engine, expire_on_commit=False) as session:
            stmt = select(Job).where(or_(Job.state.in_([s.value for s in ACTIVE]),
                                         (Job.state == S.FAILED.value) & (Job.failures < Job.max_attempts)))
            return list(session.exec(stmt.order_by(Job.id)))

    def events(self, job_id: int) -> list[JobEvent]:
        self.get(job_id)
        with Session(self.engine, expire_on_commit=False) as session:
            stmt = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
            return list(session.exec(stmt))

    def count(self) -> int:
        with Session(self.engine) as session:
            return session.exec(select(func.count()).select_from(Job)).one()

    def count_in(self, state: JobState) -> int:
        with Session(self.engine) as session:
            return session.exec(select(func.count()).select_from(Job).where(Job.state == JobState(state).value)).one()

    # ---- the service's transitions ----------------------------------------------------------------------

    def claim(self, starts: Sequence[tuple[int, Sequence[str]]], host: str, *,
              checkpoint_root: Optional[str] = None, log_root: Optional[str] = None) -> list[Job]:
        """QUEUED -> STARTING for each (job id, devices); jobs no longer QUEUED are skipped (another host won)."""
        now = time.time()
        claimed: list[Job] = []
        if not starts:
            return claimed
        with self._tx() as session:
            ids = [job_id for job_id, _ in starts]
            stmt = select(Job).where(Job.id.in_(ids), Job.state == S.QUEUED.value)
            if self.is_postgres:
                stmt = stmt.with_for_update(skip_locked=True)
            rows = {job.id: job for job in session.exec(stmt)}
            for job_id, devices in starts:
                job = rows.get(job_id)
                if job is None:
                    continue
                fields: dict[str, Any] = dict(devices=list(devices), host=host, attempts=job.attempts + 1,
                                              exit_code=None, pid=None, proc_start=None, stop_sent_at=None)
                if checkpoint_root and not job.checkpoint_dir:
                    fields["checkpoint_dir"] = os.path.join(checkpoint_root, str(job.id))
                if log_root and not job.log_path:
                    fields["log_path"] = os.path.join(log_root, f"{job.id}.log")
                claimed.append(self._move(session, job, S.STARTING, f"placed on {','.join(devices)}", host, now,
                                          **fields))
        return claimed

    def set_run_id(self, job_id: int, run_id: str) -> None:
        """Record the MLflow run every attempt of this job logs to (set once, before the first start)."""
        with self._tx() as session:
            session.execute(update(Job).where(Job.id == job_id, Job.mlflow_run_id.is_(None))
                            .values(mlflow_run_id=run_id))

    def mark_running(self, job_id: int, pid: int, proc_start: Optional[str], host: Optional[str] = None) -> Job:
        """STARTING -> RUNNING once the process exists. A job cancelled meanwhile keeps its stopping state."""
        marked = self.mark_running_many([(job_id, pid, proc_start)], host)
        if not marked:
            raise JobNotFound(job_id)
        return marked[0]

    def mark_running_many(self, launched: Sequence[tuple[int, int, Optional[str]]], host: Optional[str] = None
                          ) -> list[Job]:
        """`mark_running` for many (job id, pid, proc start) in one commit."""
        now = time.time()
        out: list[Job] = []
        if not launched:
            return out
        with self._tx() as session, session.no_autoflush:
            rows = self._lock_many(session, [job_id for job_id, _, _ in launched])
            for job_id, pid, proc_start in launched:
                job = rows.get(job_id)
                if job is None:
                    continue
                if job.job_state is not S.STARTING:
                    job.pid, job.proc_start = pid, proc_start
                    session.add(job)
                    out.append(job)
                    continue
                out.append(self._move(session, job, S.RUNNING, f"pid {pid}", host, now, pid=pid,
                                      proc_start=proc_start, started_at=now))
        return out

    def snapshot(self, host: str, limit: int = 256) -> tuple[list[tuple], list[Job]]:
        """What one dispatch pass needs: the first `limit` QUEUED jobs in line order as light
        (id, priority, submitted_at, gpus) rows, and the jobs this host holds devices for."""
        with Session(self.engine, expire_on_commit=False) as session:
            waiting = list(session.exec(
                select(Job.id, Job.priority, Job.submitted_at, Job.gpus).where(Job.state == S.QUEUED.value)
                .order_by(Job.priority.desc(), Job.submitted_at, Job.id).limit(limit)))
            mine = list(session.exec(select(Job).where(Job.state.in_([s.value for s in HOLDING]),
                                                       Job.host == host)))
        return waiting, mine

    def finish(self, job_id: int, exit_code: int, host: Optional[str] = None, *, detail: str = "") -> Job:
        """Record the end of an attempt and move the job to the state its process earned."""
        now = time.time()
        with self._tx() as session:
            job = self._lock(session, job_id)
            return self._finish(session, job, exit_code, host, now, detail)

    def _finish(self, session: Session, job: Job, code: int, host: Optional[str], now: float,
                detail: str) -> Job:
        state = job.job_state
        how = detail or f"exit code {code}"
        if state is S.CANCELLING and job.reason == TIME_LIMIT:  # stopped by expire(): a failure, never retried
            return self._move(session, job, S.FAILED, f"{TIME_LIMIT} ({how})", host, now, exit_code=code,
                              failures=job.max_attempts, not_before=None)
        if state is S.CANCELLING:
            return self._move(session, job, S.CANCELLED, f"cancelled ({how})", host, now, exit_code=code)
        if state is S.PREEMPTING:
            if code == 0:
                return self._move(session, job, S.SUCCEEDED, f"finished while being preempted ({how})", host,
                                  now, exit_code=code)
            return self._move(session, job, S.QUEUED, f"preempted ({how}); back in line", host, now,
                              exit_code=code, devices=[], preemptions=job.preemptions + 1, stop_sent_at=None)
        if state not in (S.RUNNING, S.STARTING):
            return job  # already finished (e.g. reconciled twice): nothing to change
        if code == 0:
            return self._move(session, job, S.SUCCEEDED, how, host, now, exit_code=code)
        if code == EX_TEMPFAIL:
            return self._move(session, job, S.QUEUED, f"exit 75: requeued without spending an attempt", host,
                              now, exit_code=code, devices=[])
        failures = job.failures + 1
        if failures < job.max_attempts:
            delay = backoff(failures)
            reason = f"{how}; retry {failures + 1}/{job.max_attempts} in {delay:.0f}s"
            return self._move(session, job, S.FAILED, reason, host, now, exit_code=code, failures=failures,
                              not_before=now + delay)
        return self._move(session, job, S.FAILED, f"{how}; no attempts left", host, now, exit_code=code,
                          failures=failures, not_before=None)

    def finish_many(self, results: Sequence[tuple[int, int, int, str]], host: Optional[str] = None) -> list[Job]:
        """`finish` for many (job id, attempt, exit code, detail) in one commit. A report about an attempt
        other than the job's current one, or from a host that no longer holds the job, is ignored."""
        now = time.time()
        out = []
        if not results:
            return out
        with self._tx() as session, session.no_autoflush:
            rows = self._lock_many(session, [r[0] for r in results])
            for job_id, attempt, code, detail in results:
                job = rows.get(job_id)
                if job is None or job.attempts != attempt or job.job_state not in HOLDING or (host and job.host != host):
                    continue
                out.append(self._finish(session, job, code, host, now, detail))
        return out

    def requeue(self, job_id: int, reason: str, host: Optional[str] = None) -> Job:
        """Put a STARTING or RUNNING job back in line without spending an attempt (bad device, lost host).

        A job that was being cancelled ends CANCELLED; one being preempted counts the preemption."""
        now = time.time()
        with self._tx() as session:
            job = self._lock(session, job_id)
            state = job.job_state
            if state is S.CANCELLING:
                return self._move(session, job, S.CANCELLED, f"cancelled ({reason})", host, now)
            if state is S.PREEMPTING:
                return self._move(session, job, S.QUEUED, f"preempted ({reason})", host, now, devices=[],
                                  preemptions=job.preemptions + 1, stop_sent_at=None)
            if state in (S.STARTING, S.RUNNING):
                attempts = job.attempts - 1 if state is S.STARTING else job.attempts
                return self._move(session, job, S.QUEUED, reason, host, now, devices=[], attempts=attempts,
                                  stop_sent_at=None)
            return job

    def requeue_due(self, now: Optional[float] = None) -> list[Job]:
        """FAILED jobs whose backoff has elapsed and that have attempts left -> QUEUED."""
        now = time.time() if now is None else now
        with self._tx() as session:
            stmt = select(Job).where(Job.state == S.FAILED.value, Job.failures < Job.max_attempts,
                                     Job.not_before <= now)
            return [self._move(session, job, S.QUEUED, f"retry {job.failures + 1}/{job.max_attempts}", None,
                               now, devices=[], not_before=None) for job in session.exec(stmt)]

    def preempt(self, job_ids: Iterable[int], reason: str, host: Optional[str] = None) -> list[Job]:
        """RUNNING -> PREEMPTING; the service then signals the process group."""
        now = time.time()
        out = []
        with self._tx() as session:
            for job_id in job_ids:
                job = self._lock(session, job_id)
                if job.job_state is S.RUNNING:
                    out.append(self._move(session, job, S.PREEMPTING, reason, host, now))
        return out

    def mark_stop_sent(self, job_id: int, at: Optional[float] = None) -> None:
        with self._tx() as session:
            session.execute(update(Job).where(Job.id == job_id).values(stop_sent_at=at or time.time()))

    # ---- people's and agents' requests ------------------------------------------------------------------

    def cancel(self, job_id: int, reason: str = "cancelled by user") -> Job:
        """Cancel: a queued job ends now; a running one moves to CANCELLING and the service stops it."""
        now = time.time()
        with self._tx() as session:
            job = self._lock(session, job_id)
            state = job.job_state
            if state is S.QUEUED:
                return self._move(session, job, S.CANCELLED, reason, None, now)
            if state in (S.RUNNING, S.PREEMPTING):
                return self._move(session, job, S.CANCELLING, reason, None, now, stop_sent_at=None)
            if state is S.STARTING:  # the service stops it as soon as its process exists
                return self._move(session, job, S.CANCELLING, reason, None, now, stop_sent_at=None)
            if state is S.CANCELLING:
                return job
            if state is S.FAILED and job.failures < job.max_attempts:
                job.max_attempts = job.failures  # no more retries; it stays FAILED
                job.not_before = None
                job.reason = f"{job.reason}; {reason}: retries stopped"
                session.add(job)
                session.add(JobEvent(job_id=job.id, at=now, src=state.value, dst=state.value,
                                     reason=f"{reason}: retries stopped"))
                return job
            raise BadInput(f"job {job_id} is already {state.value}; nothing to cancel")

    def expire(self, job_id: int, now: Optional[float] = None) -> Optional[Job]:
        """A RUNNING job past its time limit -> CANCELLING ("time limit exceeded"); the service then stops it
        (SIGTERM, SIGKILL after its grace) and its exit makes it FAILED. None when it is not running any more."""
        now = time.time() if now is None else now
        with self._tx() as session:
            job = self._lock(session, job_id)
            if job.job_state is not S.RUNNING:
                return None
            return self._move(session, job, S.CANCELLING, TIME_LIMIT, None, now, stop_sent_at=None)

    def demote(self, job_id: int, priority: int, reason: str = "demoted") -> Job:
        """Lower a job's priority; a running job is preempted (it checkpoints and waits in line)."""
        now = time.time()
        with self._tx() as session:
            job = self._lock(session, job_id)
            if job.job_state in FINISHED and not (job.job_state is S.FAILED and job.failures < job.max_attempts):
                raise BadInput(f"job {job_id} is already {job.state}")
            job.priority = priority
            if job.job_state is S.RUNNING:
                return self._move(session, job, S.PREEMPTING, f"{reason} (priority {priority})", None, now)
            session.add(job)
            return job

    # ---- devices and services ---------------------------------------------------------------------------

    def sync_devices(self, host: str, names: Sequence[str]) -> list[Device]:
        """Make `names` this host's device inventory, keeping the state of devices already known."""
        with self._tx() as session:
            known = {d.name: d for d in session.exec(select(Device).where(Device.host == host))}
            for name in set(known) - set(names):
                session.delete(known[name])
            for pos, name in enumerate(names):
                dev = known.get(name) or Device(host=host, name=name)
                dev.position = pos
                session.add(dev)
        return self.devices(host)

    def devices(self, host: Optional[str] = None) -> list[Device]:
        with Session(self.engine, expire_on_commit=False) as session:
            stmt = select(Device)
            if host is not None:
                stmt = stmt.where(Device.host == host)
            return list(session.exec(stmt.order_by(Device.host, Device.position)))

    def set_device_state(self, host: str, name: str, state: str, reason: str = "",
                         check: Optional[dict] = None) -> Device:
        if state not in ("available", "disabled", "quarantined"):
            raise BadInput(f"unknown device state {state!r}")
        with self._tx() as session:
            dev = session.get(Device, (host, name))
            if dev is None:
                raise BadInput(f"no device {name!r} on {host}; known: "
                               + ", ".join(d.name for d in session.exec(select(Device).where(Device.host == host))))
            dev.state, dev.reason = state, reason
            if check is not None:
                dev.last_check, dev.checked_at = check, time.time()
            session.add(dev)
            return dev

    def record_check(self, host: str, name: str, check: dict) -> None:
        with self._tx() as session:
            dev = session.get(Device, (host, name))
            if dev is not None:
                dev.last_check, dev.checked_at = check, time.time()
                session.add(dev)

    def heartbeat(self, host: str, pid: int, home: str, devices: Sequence[str], started_at: float) -> None:
        """Upsert this service's liveness row."""
        with self._tx() as session:
            rec = session.get(ServiceRecord, host) or ServiceRecord(host=host)
            rec.pid, rec.home, rec.devices, rec.heartbeat_at = pid, home, list(devices), time.time()
            rec.started_at = started_at
            session.add(rec)

    def services(self, max_age: Optional[float] = None) -> list[ServiceRecord]:
        with Session(self.engine, expire_on_commit=False) as session:
            stmt = select(ServiceRecord)
            if max_age is not None:
                stmt = stmt.where(ServiceRecord.heartbeat_at >= time.time() - max_age)
            return list(session.exec(stmt))

    def remove_service(self, host: str) -> None:
        with self._tx() as session:
            rec = session.get(ServiceRecord, host)
            if rec is not None:
                session.delete(rec)


def holding(jobs: Iterable[Job]) -> list[Job]:
    """The jobs among `jobs` that occupy devices."""
    return [j for j in jobs if JobState(j.state) in HOLDING]


def _default_name(spec: JobSpec) -> str:
    if spec.experiment:
        return spec.experiment
    return os.path.basename(spec.argv[0])[:64]


def _redact(url: str) -> str:
    """Hide a password in a database URL before it reaches a message."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in creds else url
    return url
