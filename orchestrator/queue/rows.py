"""Job rows without the ORM's per-object cost, for the queue's hot paths.

- light rows (`LightRow`): a few columns of a job read with SQLAlchemy Core, with the `Job`'s own rules
  borrowed, never copied: `Held` (what a dispatch pass reads of the jobs a host holds) and `Moving` (what a
  batch transition reads under the write lock);
- detached `Job`s built as the ORM loads them (`detached_job`): from the values a submit just wrote, or from
  Core rows of every column (its `__init__` and ORM loading each cost more than the statement);
- `Writes`: a transaction's row changes, flushed in as few statements as the batch allows.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

from sqlalchemy import bindparam, insert, update
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.instrumentation import manager_of_class
from sqlmodel import Session

from orchestrator.queue.models import Job, JobEvent

JOBS = Job.__table__
INSERT_EVENT = insert(JobEvent.__table__)  # one event row (or many, executemany)
_JOB_MANAGER = manager_of_class(Job)


class LightRow:
    """Some columns of one job (`COLUMNS`, in select order), as plain attributes."""

    COLUMNS: tuple[str, ...] = ()
    __slots__ = ()
    job_state = Job.__dict__["job_state"]

    def __init__(self, row: Any) -> None:
        for key, value in zip(self.COLUMNS, row):
            setattr(self, key, value)


class Held(LightRow):
    """A job a host holds devices for, as a dispatch pass reads it: the columns it plans and enforces stops with.
    Whoever signals the job loads the whole `Job` (`JobQueries.get`)."""

    COLUMNS = ("id", "state", "priority", "devices", "started_at", "preemptible", "pid", "stop_sent_at",
               "time_limit", "attempts", "grace", "project", "scavenger", "gpu_share", "gpu_memory")
    __slots__ = COLUMNS


class Queued(LightRow):
    """A QUEUED job as a dispatch pass reads it: what the policy plans with (`Waiting.of`), and whether the
    service must make its MLflow run before it starts (`Job.needs_run`, computed in the read)."""

    COLUMNS = ("id", "priority", "submitted_at", "gpus", "needs_run", "project", "scavenger", "deadline",
               "time_limit", "preemptible", "gpu_share", "gpu_memory")
    __slots__ = COLUMNS


class Moving(LightRow):
    """The columns a batch transition reads (building ORM objects cost more than the statements). The rules
    are the job's own: `Job`'s properties, shared."""

    COLUMNS = ("id", "state", "reason", "host", "attempts", "failures", "max_attempts", "preemptions",
               "checkpoint_dir", "stop_cause", "gpu_share")
    __slots__ = COLUMNS
    final = Job.__dict__["final"]
    timed_out = Job.__dict__["timed_out"]
    retrying = Job.__dict__["retrying"]
    retries_after_failure = Job.__dict__["retries_after_failure"]


def detached_job(values: Mapping[str, Any]) -> Job:
    """A `Job` with these column values, as the ORM would load it, in no session (what a caller reads and the
    store's transitions update: `Writes.set`)."""
    job = _JOB_MANAGER.new_instance()
    job.__dict__.update(values)
    return job


def detached_jobs(rows: Iterable[Any]) -> list[Job]:
    """`detached_job` of each Core row of every column."""
    return [detached_job(row._mapping) for row in rows]


@functools.lru_cache(maxsize=None)
def _column_defaults() -> tuple[tuple[str, Any], ...]:
    blank = Job(argv=[], devices=[])
    return tuple((column.name, getattr(blank, column.name)) for column in JOBS.columns if column.name != "id")


def new_job_values() -> dict[str, Any]:
    """Every column of a new job (but `id`) at its default (the mutable ones are given by the submit)."""
    return dict(_column_defaults())


@functools.lru_cache(maxsize=None)
def _update_of(keys: tuple[str, ...]) -> Any:
    """The UPDATE of these columns of one job (by `_id`), made once per set of columns: building a statement
    costs more than executing it."""
    return update(JOBS).where(JOBS.c.id == bindparam("_id")).values({k: bindparam(f"v_{k}") for k in keys})


class Writes:
    """The row changes of one transaction's transitions, written just before it commits in as few statements
    as the batch allows (SQLAlchemy Core, no ORM unit of work): one executemany UPDATE per set of changed
    columns and one INSERT of every event row. The ORM's flush cost several times these statements per transition
(benchmarks/RESULTS.md, "Queue throughput")."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}  # job id -> its new column values (later changes win)
        self.events: list[dict[str, Any]] = []

    def set(self, job: Any, **values: Any) -> None:
        """Change columns of a loaded job: in the row (at flush) and in the object the caller gets back."""
        if isinstance(job, Moving):
            for key, value in values.items():
                if key in Moving.COLUMNS:
                    setattr(job, key, value)
        elif job._sa_instance_state.session_id is None:  # a detached job: plain attributes
            job.__dict__.update(values)
        else:
            for key, value in values.items():
                set_committed_value(job, key, value)  # not dirty: the ORM writes nothing for it
        self.rows.setdefault(job.id, {}).update(values)

    def flush(self, session: Session) -> None:
        conn = session.connection()
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for job_id, values in self.rows.items():
            groups.setdefault(tuple(sorted(values)), []).append(
                {"_id": job_id, **{f"v_{k}": v for k, v in values.items()}})
        for keys, params in groups.items():
            conn.execute(_update_of(keys), params)
        if self.events:
            conn.execute(INSERT_EVENT, self.events)
        self.rows, self.events = {}, []
