"""What the queue records for retention (`orchestrator.service.retention`, `orchestrator.service.gc`): a trial's score in its
session's ranking, a job marked to keep, what retention did to a job's checkpoint, and compaction of the event
log of jobs that finished long ago. None of this is a job's state: no transition, no event row.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from sqlalchemy import and_, bindparam, case, delete, func, or_, select as core_select, text, update

from orchestrator.core.errors import BadInput, JobNotFound
from orchestrator.queue.db import Database
from orchestrator.queue.models import KEEP_MODES, RETRYING_SQL, Job, JobEvent
from orchestrator.queue.queries import JobQueries
from orchestrator.queue.states import FINISHED, HOLDING

JOBS = Job.__table__
EVENTS = JobEvent.__table__
_FINAL = and_(JOBS.c.state.in_([s.value for s in FINISHED]), text(f"NOT ({RETRYING_SQL})"))
# What the retention policy reads of each final job that has (or had) a checkpoint dir.
RETENTION_COLUMNS = ("id", "owner", "experiment", "state", "keep_checkpoint", "phase", "score", "checkpoint_dir",
                     "checkpoint_gc", "finished_at", "mlflow_run_id")
# Removed dirs stay removed and their jobs are left out: a pass reads the jobs that still hold a checkpoint (a
# removed trial was outside its session's best then, and scores only get beaten, so ranking without it keeps
# the same best, or more).
_HOLDS_CHECKPOINT = and_(_FINAL, JOBS.c.checkpoint_dir.is_not(None),
                         or_(JOBS.c.checkpoint_gc.is_(None), JOBS.c.checkpoint_gc != "removed"))
_RETENTION_ROWS = core_select(*(JOBS.c[c] for c in RETENTION_COLUMNS)).where(_HOLDS_CHECKPOINT).order_by(JOBS.c.id)
# What the policy reads of those rows, summed in one aggregate: which jobs, their scores, marks and what was done.
# Equal sums mean nothing the policy reads has changed (ids weigh each change, so two rarely cancel out).
_KEEP_CODE = case((JOBS.c.keep_checkpoint == "all", 1), (JOBS.c.keep_checkpoint == "latest", 2),
                  (JOBS.c.keep_checkpoint == "none", 3), else_=0)
_RETENTION_FINGERPRINT = core_select(
    func.count(), func.max(JOBS.c.id), func.sum(JOBS.c.id), func.count(JOBS.c.score),
    func.sum(JOBS.c.score * JOBS.c.id), func.sum(_KEEP_CODE * JOBS.c.id),
    func.sum(case((JOBS.c.checkpoint_gc.is_not(None), JOBS.c.id), else_=0))).where(_HOLDS_CHECKPOINT)
_SET_SCORE = update(JOBS).where(JOBS.c.id == bindparam("_id")).values(score=bindparam("v_score"))
_SET_GC = (update(JOBS).where(JOBS.c.id == bindparam("_id"))
           .values(checkpoint_gc=bindparam("v_gc"), checkpoint_gc_at=bindparam("v_at")))


class KeepRecords:
    """The queue's side of checkpoint, log and event retention (`JobStore.keeping`)."""

    def __init__(self, db: Database, jobs: JobQueries):
        self.db = db
        self.jobs = jobs  # what `set_keep` answers with

    def set_scores(self, scores: dict[int, Optional[float]]) -> None:
        """Record trials' scores in their session's ranking (higher is better; None: no value)."""
        if not scores:
            return
        with self.db.tx() as session:
            session.connection().execute(_SET_SCORE, [{"_id": k, "v_score": v} for k, v in scores.items()])

    def set_keep(self, job_id: int, mode: str) -> Job:
        """Mark a job's checkpoint to keep (`all`), keep only its latest (`latest`), or remove (`none`)."""
        if mode not in KEEP_MODES:
            raise BadInput(f"keep mode must be one of {', '.join(KEEP_MODES)}, got {mode!r}")
        with self.db.tx() as session:
            job = session.get(Job, job_id)
            if job is None:
                raise JobNotFound(job_id)
            job.keep_checkpoint = mode
            session.add(job)
        return self.jobs.get(job_id)

    def retention_rows(self) -> list[dict[str, Any]]:
        """Every final job whose checkpoint dir retention has not removed, as plain dicts of
        `RETENTION_COLUMNS`, oldest first."""
        with self.db.reading() as conn:
            return [dict(zip(RETENTION_COLUMNS, row)) for row in conn.execute(_RETENTION_ROWS)]

    def retention_fingerprint(self) -> tuple:
        """A summary of what `retention_rows` would return (which jobs, scores, marks, what retention did):
        equal between two reads when none of it changed (the service's pass skips the policy then)."""
        with self.db.reading() as conn:
            return tuple(conn.execute(_RETENTION_FINGERPRINT).one())

    def growing_logs(self, since: float) -> list[str]:
        """Log paths of the jobs that may have written to their log since `since`: those holding devices and
        those that finished since (a finished job's log no longer grows)."""
        stmt = core_select(JOBS.c.log_path).where(
            JOBS.c.log_path.is_not(None),
            or_(JOBS.c.state.in_([s.value for s in HOLDING]), JOBS.c.finished_at >= since))
        with self.db.reading() as conn:
            return [row[0] for row in conn.execute(stmt)]

    def record_gc(self, done: Sequence[tuple[int, str]], at: Optional[float] = None) -> None:
        """Record what retention did to these jobs' checkpoints (`removed` or `trimmed`)."""
        if not done:
            return
        at = time.time() if at is None else at
        with self.db.tx() as session:
            session.connection().execute(_SET_GC, [{"_id": job_id, "v_gc": what, "v_at": at}
                                                   for job_id, what in done])

    def finished_before(self, before: float) -> list[tuple[int, Optional[str]]]:
        """(id, log path) of the final jobs that finished before this time."""
        stmt = core_select(JOBS.c.id, JOBS.c.log_path).where(_FINAL, JOBS.c.finished_at < before)
        with self.db.reading() as conn:
            return [(row[0], row[1]) for row in conn.execute(stmt)]

    def compact_events(self, before: float) -> int:
        """Drop the middle of the event log of jobs that finished before this time: each keeps its first event
        (submitted) and its last (how it ended), so `show` still says when and why. Returns the rows dropped.
        Jobs that finished since keep every event."""
        old = core_select(JOBS.c.id).where(_FINAL, JOBS.c.finished_at < before).scalar_subquery()
        ends = (core_select(func.min(EVENTS.c.id)).where(EVENTS.c.job_id.in_(old)).group_by(EVENTS.c.job_id)
                .union(core_select(func.max(EVENTS.c.id)).where(EVENTS.c.job_id.in_(old))
                       .group_by(EVENTS.c.job_id)))
        stmt = delete(EVENTS).where(EVENTS.c.job_id.in_(old), EVENTS.c.id.not_in(ends))
        with self.db.tx() as session:
            return session.connection().execute(stmt).rowcount or 0

