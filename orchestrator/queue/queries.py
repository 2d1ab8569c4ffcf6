"""Reading the queue: jobs by id, state, owner or host, their event logs, and what a dispatch pass needs.

`JobQueries` (`JobStore.queries`; `JobStore` offers each of its reads) only reads; every change of a job goes
through `Transitions` (orchestrator.queue.transitions).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from sqlalchemy import bindparam, func, or_, select as core_select
from sqlmodel import select

from orchestrator.core.errors import JobNotFound
from orchestrator.queue import listing as listings
from orchestrator.queue.db import Database
from orchestrator.queue.models import Job, JobEvent
from orchestrator.queue.rows import Held, Queued
from orchestrator.queue.states import ACTIVE, HOLDING, JobState

S = JobState
JOBS = Job.__table__


# A pass's reads, built once: building a statement cost more than running it. The line (every project, through
# ix_jobs_line), a declared project's line (ix_jobs_project_line), the scavengers' line, and the held jobs.
_WAITING_COLUMNS = (JOBS.c.id, JOBS.c.priority, JOBS.c.submitted_at, JOBS.c.gpus, Job.needs_run_sql(),
                    JOBS.c.project, JOBS.c.scavenger, JOBS.c.deadline, JOBS.c.time_limit, JOBS.c.preemptible,
                    JOBS.c.gpu_share, JOBS.c.gpu_memory)
_LINE_ORDER = (JOBS.c.priority.desc(), JOBS.c.submitted_at, JOBS.c.id)
_WAITING = (core_select(*_WAITING_COLUMNS)
            .where(JOBS.c.state == S.QUEUED.value, JOBS.c.gpus <= bindparam("capacity"),
                   JOBS.c.scavenger.isnot(True))
            .order_by(*_LINE_ORDER).limit(bindparam("limit")))
_PROJECT_WAITING = (core_select(*_WAITING_COLUMNS)
                    .where(JOBS.c.state == S.QUEUED.value, JOBS.c.project == bindparam("project"),
                           JOBS.c.scavenger == False,  # noqa: E712 - SQL, through the index
                           JOBS.c.gpus <= bindparam("capacity"))
                    .order_by(*_LINE_ORDER).limit(bindparam("limit")))
_SCAVENGERS = (core_select(*_WAITING_COLUMNS)
               .where(JOBS.c.state == S.QUEUED.value, JOBS.c.scavenger == True,  # noqa: E712
                      JOBS.c.gpus <= bindparam("capacity"))
               .order_by(*_LINE_ORDER).limit(bindparam("limit")))
_HELD = (core_select(*(JOBS.c[name] for name in Held.COLUMNS))
         .where(JOBS.c.state.in_([s.value for s in HOLDING]), JOBS.c.host == bindparam("host")))
NO_LIMIT = 2 ** 62


class JobQueries:
    """Read-only views of the jobs table and its event log."""

    def __init__(self, db: Database):
        self.db = db

    def find_by_key(self, key: str) -> Optional[Job]:
        """The job submitted with this idempotency key, if any."""
        with self.db.read() as session:
            return session.exec(select(Job).where(Job.idempotency_key == key)).first()

    def get(self, job_id: int) -> Job:
        """The job with this id, or JobNotFound (a BadInput: exit 2)."""
        with self.db.read() as session:
            job = session.get(Job, job_id)
            if job is None:
                raise JobNotFound(job_id)
            return job

    def get_many(self, job_ids: Iterable[int]) -> list[Job]:
        """The jobs with these ids that exist, in id order."""
        with self.db.read() as session:
            return list(session.exec(select(Job).where(Job.id.in_(list(job_ids))).order_by(Job.id)))

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
        with self.db.read() as session:
            return list(session.exec(stmt.order_by(Job.id)))

    def unfinished(self) -> list[Job]:
        """What `autoresearch queue` shows by default: active jobs and failed ones awaiting a retry."""
        with self.db.read() as session:
            stmt = select(Job).where(or_(Job.state.in_([s.value for s in ACTIVE]), Job.retrying_sql()))
            return list(session.exec(stmt.order_by(Job.id)))

    def listing(self, *, finished: bool = False, limit: Optional[int] = listings.DEFAULT_LIMIT,
                owner: Optional[str] = None) -> listings.Listing:
        """What `autoresearch queue` lists: the first `limit` (None: all) unfinished jobs (every job with
        `finished`) in listing order as dicts, with the counts by state of all of them (orchestrator.queue.listing)."""
        with self.db.reading() as conn:
            return listings.listing(conn, finished=finished, limit=limit, owner=owner)

    def record(self, job_id: int) -> dict:
        """One job with its events as `show --json` prints it (JobNotFound: exit 2)."""
        with self.db.reading() as conn:
            return listings.record(conn, job_id)

    def state_counts(self, *, finished: bool = False, owner: Optional[str] = None) -> dict[str, int]:
        """Unfinished jobs (every job with `finished`) by state, counted in SQL."""
        with self.db.reading() as conn:
            return listings.counts(conn, finished=finished, owner=owner)

    def phase_counts(self, owner: str, *, skip_cancelled: Optional[str] = None
                     ) -> list[tuple[Optional[str], str, int]]:
        """(phase, state, how many) of `owner`'s jobs (an agent session's trials by phase), counted in SQL;
        CANCELLED ones whose reason starts with `skip_cancelled` left out, unless scored (`listing.phase_counts`)."""
        with self.db.reading() as conn:
            return listings.phase_counts(conn, owner, skip_cancelled=skip_cancelled)

    def line(self, limit: int) -> list:
        """The first `limit` QUEUED jobs in line order, as read-only rows with the Job's column attributes."""
        with self.db.reading() as conn:
            return listings.line(conn, limit)

    def events(self, job_id: int) -> list[JobEvent]:
        """The job's event log, oldest first."""
        self.get(job_id)
        with self.db.read() as session:
            stmt = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
            return list(session.exec(stmt))

    def recent_events(self, limit: int = 20) -> list[JobEvent]:
        """The latest `limit` transitions of any job, newest first (for live views)."""
        with self.db.read() as session:
            return list(session.exec(select(JobEvent).order_by(JobEvent.id.desc()).limit(limit)))

    def count(self) -> int:
        """How many jobs exist."""
        with self.db.read() as session:
            return session.exec(select(func.count()).select_from(Job)).one()

    def count_in(self, state: JobState) -> int:
        """How many jobs are in `state`."""
        with self.db.read() as session:
            return session.exec(select(func.count()).select_from(Job).where(Job.state == JobState(state).value)).one()

    def waiting_with(self, *, gpus_over: int, reason_prefix: str) -> list[Job]:
        """QUEUED jobs needing more than `gpus_over` devices, or whose reason starts with `reason_prefix`."""
        with self.db.read() as session:
            stmt = select(Job).where(Job.state == S.QUEUED.value,
                                     or_(Job.gpus > gpus_over, Job.reason.startswith(reason_prefix)))
            return list(session.exec(stmt.order_by(Job.id)))

    def snapshot(self, host: str, *, capacity: Optional[int] = None, limit: Optional[int] = None,
                 skip: Iterable[int] = (), projects: Sequence[str] = ()) -> tuple[list[Queued], list[Held]]:
        """What one dispatch pass needs: QUEUED jobs as light rows (`Queued`), and the jobs this host holds
        devices for (`Held`).

        The first `limit` jobs of the whole line in line order, then the first `limit` of each of `projects`'
        lines and of the scavengers' (each its own indexed read: fair sharing may pick a project's head from far
        back in the whole line). `capacity`: only jobs needing at most this many devices (the others can never
        run here and must not take places in the window); `skip`: ids left out (held back).
        Statements without a write lock (a pass only reads here; its changes re-read under the lock)."""
        skip = set(skip)
        wanted = NO_LIMIT if limit is None else limit + len(skip)
        params = {"capacity": NO_LIMIT if capacity is None else capacity, "limit": wanted}
        seen: set[int] = set()
        waiting: list[Queued] = []

        def take(rows) -> None:
            part = [Queued(row) for row in rows if row[0] not in skip and row[0] not in seen]
            part = part[:limit] if limit is not None else part
            seen.update(row.id for row in part)
            waiting.extend(part)

        with self.db.lone_read() as conn:
            take(conn.execute(_WAITING, params))
            for name in projects:
                take(conn.execute(_PROJECT_WAITING, {**params, "project": name}))
            take(conn.execute(_SCAVENGERS, params))
            mine = [Held(row) for row in conn.execute(_HELD, {"host": host})]
        return waiting, mine
