"""Transitions: the only code that changes a job's state (`JobStore` offers each of them).

Every transition runs in one transaction that re-reads the row under a write lock (SQLite `BEGIN IMMEDIATE`;
PostgreSQL `SELECT ... FOR UPDATE`), checks the job states allow it, updates the job and appends one event row.
Methods that act on many jobs (the dispatcher's starts, the reaper's finishes) take a batch and still give each
job its own checked transition and event, but share one commit, and their rows are written with SQLAlchemy Core
in a few executemany statements (`rows.Writes`) rather than by the ORM's unit of work. Whether a job is final or
will be retried is the job's rule (`Job.final`, `Job.retrying`).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from sqlalchemy import bindparam, func, insert, select as core_select, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput, InvalidTransition, JobNotFound
from orchestrator.queue.db import Database
from orchestrator.queue.models import Device, Job, JobSpec, check_priority
from orchestrator.queue.queries import JobQueries
from orchestrator.queue.rows import INSERT_EVENT, Moving, Writes, detached_job, detached_jobs, new_job_values
from orchestrator.queue.states import (FINISHED, HOLDING, OUT_OF_SHARED_MEMORY, TIME_LIMIT, JobState, StopCause,
                                       allowed)
from runtime.protocol import EX_TEMPFAIL, completed_attempt, oom_attempt

S = JobState
# The settings' own defaults (declared once, in Settings): the first retry after 5 s, doubling (Kueue-style) up
# to 5 minutes.
DEFAULT_BACKOFF = Settings.retry_backoff
DEFAULT_BACKOFF_CAP = Settings.retry_backoff_cap


def backoff(failures: int, base: float = DEFAULT_BACKOFF, cap: float = DEFAULT_BACKOFF_CAP) -> float:
    """Seconds to wait before retry number `failures` (1-based): base, 2*base, 4*base, ... capped."""
    return min(cap, base * (2 ** max(0, failures - 1)))


JOBS = Job.__table__
_INSERT_JOB = insert(JOBS)
DEVICES = Device.__table__
_DEVICE_STATES = core_select(DEVICES.c.name, DEVICES.c.state).where(DEVICES.c.host == bindparam("host"))
_CLAIMABLE = core_select(JOBS).where(JOBS.c.id.in_(bindparam("ids", expanding=True)),
                                    JOBS.c.state == S.QUEUED.value)
# Queued jobs past the point where they could meet their deadline (through the partial index ix_jobs_deadline).
_LATE = core_select(JOBS.c.id).where(JOBS.c.state == S.QUEUED.value, JOBS.c.deadline.isnot(None),
                                     JOBS.c.deadline < bindparam("now") + func.coalesce(JOBS.c.time_limit, 0.0))
_JOBS_BY_ID = select(Job).where(Job.id.in_(bindparam("ids", expanding=True)))
_ROWS_BY_ID = (core_select(*(JOBS.c[name] for name in Moving.COLUMNS))
               .where(JOBS.c.id.in_(bindparam("ids", expanding=True))))


class Transitions:
    """Every change of a job's state, each checked and logged (`JobStore.transitions`).

    `retry_backoff` and `retry_backoff_cap` (settings of the same names) are read each time a job fails, so
    whoever holds it may change them."""

    def __init__(self, db: Database, jobs: JobQueries, *, retry_backoff: float = DEFAULT_BACKOFF,
                 retry_backoff_cap: float = DEFAULT_BACKOFF_CAP):
        self.db = db
        self.jobs = jobs  # the reads a transition answers with (`submit` of a used key, `mark_running`)
        self.retry_backoff = retry_backoff
        self.retry_backoff_cap = retry_backoff_cap

    def _lock_many(self, session: Session, job_ids: Sequence[int]) -> dict[int, Job]:
        """Load (and on PostgreSQL row-lock) several jobs in one query: batches stay one round trip."""
        stmt = _JOBS_BY_ID.with_for_update() if self.db.is_postgres else _JOBS_BY_ID
        return {job.id: job for job in session.exec(stmt, params={"ids": list(job_ids)})}

    def _lock_rows(self, session: Session, job_ids: Sequence[int]) -> dict[int, Moving]:
        """`_lock_many` as light rows (`Moving`): for batch transitions whose callers need no `Job`."""
        stmt = _ROWS_BY_ID.with_for_update() if self.db.is_postgres else _ROWS_BY_ID
        return {row[0]: Moving(row) for row in session.connection().execute(stmt, {"ids": list(job_ids)})}

    def _lock(self, session: Session, job_id: int) -> Job:
        stmt = select(Job).where(Job.id == job_id)
        if self.db.is_postgres:
            stmt = stmt.with_for_update()
        job = session.exec(stmt).first()
        if job is None:
            raise JobNotFound(job_id)
        return job

    @contextmanager
    def _moving(self) -> Iterator[tuple[Session, Writes]]:
        """A transaction for transitions: the session (to read and lock rows) and the writes, flushed in
        batches before the commit (nothing is written when the block raises)."""
        with self.db.tx() as session:
            writes = Writes()
            yield session, writes
            writes.flush(session)

    @staticmethod
    def _move(writes: Writes, job: Job, dst: JobState, reason: str, by: Optional[str], now: float,
              **fields: Any) -> Any:
        src = job.job_state
        if not allowed(src, dst):
            raise InvalidTransition(f"job {job.id}: {src} -> {dst} is not allowed")
        if job.final:
            raise InvalidTransition(f"job {job.id}: failed with no attempts left; it never changes again")
        if dst in FINISHED:
            fields["finished_at"] = now
        writes.set(job, state=dst.value, reason=reason, **fields)
        writes.events.append({"job_id": job.id, "at": now, "src": src.value, "dst": dst.value, "reason": reason,
                              "host": by})
        return job

    # ---- submitting ---------------------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Job:
        """Queue a job. With an idempotency key already used, return that job instead of a new one."""
        now = time.time()
        if spec.idempotency_key:
            existing = self.jobs.find_by_key(spec.idempotency_key)
            if existing is not None:
                return existing
        values = dict(new_job_values(), argv=list(spec.argv), env=dict(spec.env), cwd=spec.cwd, track=spec.track,
                      name=spec.name or _default_name(spec), priority=spec.priority, gpus=spec.gpus * spec.nodes,
                      max_attempts=spec.max_attempts, grace=float(spec.grace), preemptible=spec.preemptible,
                      owner=spec.owner, experiment=spec.experiment, params=spec.params,
                      mlflow_run_id=spec.mlflow_run_id, idempotency_key=spec.idempotency_key,
                      time_limit=spec.time_limit, image=spec.image, image_id=spec.image_id,
                      mounts=list(spec.mounts) if spec.mounts else None, env_file=spec.env_file,
                      project=spec.project, scavenger=spec.scavenger, deadline=spec.deadline,
                      keep_checkpoint=spec.keep_checkpoint, phase=spec.phase,
                      gpu_share=spec.gpu_share, gpu_memory=spec.gpu_memory,
                      nodes=spec.nodes if spec.nodes > 1 else None, min_nodes=spec.min_nodes,
                      state=S.QUEUED.value, reason="submitted", submitted_at=now, devices=[])
        try:
            with self.db.tx() as session:
                conn = session.connection()  # Core: the ORM's flush of one new row cost more than the commit
                # Values as parameters, not in the statement: the statement then compiles once, cached.
                job_id = conn.execute(_INSERT_JOB, values).inserted_primary_key[0]
                conn.execute(INSERT_EVENT, {"job_id": job_id, "at": now, "src": None, "dst": S.QUEUED.value,
                                             "reason": "submitted", "host": None})
                if self.db.is_postgres:
                    from sqlalchemy import text

                    session.execute(text("NOTIFY autoresearch_jobs"))
        except IntegrityError:
            if spec.idempotency_key:  # a concurrent submit with the same key won the race
                existing = self.jobs.find_by_key(spec.idempotency_key)
                if existing is not None:
                    return existing
            raise
        # The Job as the ORM would load it (its __init__ cost more than the insert): the values just written.
        return detached_job({**values, "id": job_id})

    # ---- the service's transitions ----------------------------------------------------------------------

    def claim(self, starts: Sequence[tuple[int, Sequence[str]]], host: str, *,
              checkpoint_root: Optional[str] = None, log_root: Optional[str] = None) -> list[Job]:
        """QUEUED -> STARTING for each (job id, devices); jobs no longer QUEUED are skipped (another host won).

        Each claim takes the next attempt number (AUTORESEARCH_ATTEMPT). Numbers are never reused, even when
        the attempt is given back before it ran (a bad device): a late report about an old attempt can then
        never be mistaken for the current one."""
        now = time.time()
        claimed: list[Job] = []
        if not starts:
            return claimed
        with self._moving() as (session, writes):
            # A device disabled or quarantined since the pass read the inventory is not used: the job stays in
            # line for the next pass. The device rows are read under the transaction's lock (SQLite's write lock;
            # PostgreSQL: FOR SHARE), so a state change lands before this claim or after it, never in between.
            devices_now = _DEVICE_STATES.with_for_update(read=True) if self.db.is_postgres else _DEVICE_STATES
            unusable = {name for name, state in session.connection().execute(devices_now, {"host": host})
                        if state != "available"}
            stmt = _CLAIMABLE.with_for_update(skip_locked=True) if self.db.is_postgres else _CLAIMABLE
            rows = {job.id: job for job in detached_jobs(session.connection().execute(
                stmt, {"ids": [job_id for job_id, _ in starts]}))}
            for job_id, devices in starts:
                job = rows.get(job_id)
                if job is None or unusable.intersection(devices):
                    continue
                fields: dict[str, Any] = dict(devices=list(devices), host=host, attempts=job.attempts + 1,
                                              exit_code=None, pid=None, proc_start=None, stop_sent_at=None)
                if checkpoint_root and not job.checkpoint_dir:
                    fields["checkpoint_dir"] = os.path.join(checkpoint_root, str(job.id))
                if log_root and not job.log_path:
                    fields["log_path"] = os.path.join(log_root, f"{job.id}.log")
                claimed.append(self._move(writes, job, S.STARTING, f"placed on {','.join(devices)}", host, now,
                                          **fields))
        return claimed

    def note(self, reasons: dict[int, str]) -> None:
        """Update the state reason of QUEUED jobs (why a job waits) without a transition."""
        if not reasons:
            return
        with self._moving() as (session, writes):
            for job in self._lock_many(session, list(reasons)).values():
                if job.job_state is S.QUEUED and job.reason != reasons[job.id]:
                    writes.set(job, reason=reasons[job.id])

    def mark_running(self, job_id: int, pid: int, proc_start: Optional[str], host: Optional[str] = None) -> Job:
        """STARTING -> RUNNING once the process exists. A job cancelled meanwhile keeps its stopping state."""
        if not self.mark_running_many([(job_id, pid, proc_start)], host):
            raise JobNotFound(job_id)
        return self.jobs.get(job_id)

    def mark_running_many(self, launched: Sequence[tuple], host: Optional[str] = None) -> list[int]:
        """`mark_running` for many (job id, pid, proc start[, how it started]) in one commit (`how`, e.g. the
        local executor's `warm`, goes into the RUNNING event's reason); returns the ids of the jobs found."""
        now = time.time()
        out: list[int] = []
        if not launched:
            return out
        with self._moving() as (session, writes):
            rows = self._lock_rows(session, [start[0] for start in launched])
            for job_id, pid, proc_start, *how in launched:
                job = rows.get(job_id)
                if job is None:
                    continue
                out.append(job_id)
                if job.job_state is not S.STARTING:
                    writes.set(job, pid=pid, proc_start=proc_start)
                    continue
                reason = f"pid {pid}, {how[0]}" if how and how[0] else f"pid {pid}"
                self._move(writes, job, S.RUNNING, reason, host, now, pid=pid, proc_start=proc_start,
                           started_at=now)
        return out

    def finish(self, job_id: int, exit_code: int, host: Optional[str] = None, *, detail: str = "") -> Job:
        """Record the end of an attempt and move the job to the state its process earned."""
        now = time.time()
        with self._moving() as (session, writes):
            job = self._lock(session, job_id)
            return self._finish(writes, job, exit_code, host, now, detail)

    def _finish(self, writes: Writes, job: Job, code: int, host: Optional[str], now: float,
                detail: str) -> Job:
        state = job.job_state
        how = detail or f"exit code {code}"
        if state is S.CANCELLING and job.timed_out:  # stopped by expire(): a failure, never retried
            return self._move(writes, job, S.FAILED, f"{TIME_LIMIT} ({how})", host, now, exit_code=code,
                              failures=job.max_attempts, not_before=None)
        if state is S.CANCELLING:  # why it was cancelled stays its reason ("cancelled by user (exit code -15)")
            return self._move(writes, job, S.CANCELLED, f"{job.reason} ({how})", host, now, exit_code=code)
        if state is S.PREEMPTING:
            # Slurm's PreemptMode=REQUEUE: back in line whatever the exit code (a plain SIGTERM handler that
            # saves and exits 0 has not finished its training), unless the job told the runtime that this
            # attempt did its last step (runtime.context.JobContext.complete).
            if code == 0 and job.checkpoint_dir and completed_attempt(job.checkpoint_dir) == job.attempts:
                return self._move(writes, job, S.SUCCEEDED, f"finished its last step while being preempted "
                                  f"({how})", host, now, exit_code=code)
            return self._move(writes, job, S.QUEUED, f"preempted ({how}); back in line", host, now,
                              exit_code=code, devices=[], preemptions=job.preemptions + 1, stop_sent_at=None)
        if state not in (S.RUNNING, S.STARTING):
            return job  # already finished (e.g. reconciled twice): nothing to change
        if code == 0:
            return self._move(writes, job, S.SUCCEEDED, how, host, now, exit_code=code)
        if job.gpu_share and job.checkpoint_dir and oom_attempt(job.checkpoint_dir) == job.attempts:
            # Its neighbours' memory, not the job, is what ran out: run it alone, at no cost to its attempts.
            return self._move(writes, job, S.QUEUED, f"{OUT_OF_SHARED_MEMORY} ({how}): requeued to run alone on a "
                              "whole GPU without spending an attempt", host, now, exit_code=code, devices=[],
                              gpu_share=None, gpu_memory=None)
        if code == EX_TEMPFAIL:
            # An executor's own reason (Slurm requeued it, a node failed) is kept; a plain exit 75 needs none.
            why = f" ({detail})" if detail and not detail.startswith("exit code") else ""
            return self._move(writes, job, S.QUEUED, f"exit 75: requeued without spending an attempt{why}", host,
                              now, exit_code=code, devices=[])
        failures = job.failures + 1
        if job.retries_after_failure:
            delay = backoff(failures, self.retry_backoff, self.retry_backoff_cap)
            reason = f"{how}; retry {failures + 1}/{job.max_attempts} in {delay:.0f}s"
            return self._move(writes, job, S.FAILED, reason, host, now, exit_code=code, failures=failures,
                              not_before=now + delay)
        return self._move(writes, job, S.FAILED, f"{how}; no attempts left", host, now, exit_code=code,
                          failures=failures, not_before=None)

    def finish_many(self, results: Sequence[tuple[int, int, int, str]], host: Optional[str] = None) -> list[Any]:
        """`finish` for many (job id, attempt, exit code, detail) in one commit. A report about an attempt
        other than the job's current one, or from a host that no longer holds the job, is ignored. Returns
        the jobs changed, as light rows (`id`, `state`, `reason`, ...; not `Job`s)."""
        now = time.time()
        out: list[Any] = []
        if not results:
            return out
        with self._moving() as (session, writes):
            rows = self._lock_rows(session, [r[0] for r in results])
            for job_id, attempt, code, detail in results:
                job = rows.get(job_id)
                if job is None or job.attempts != attempt or job.job_state not in HOLDING or (host and job.host != host):
                    continue
                out.append(self._finish(writes, job, code, host, now, detail))
        return out

    def requeue(self, job_id: int, reason: str, host: Optional[str] = None) -> Job:
        """Put a STARTING or RUNNING job back in line without spending an attempt (bad device, lost host).

        A job that was being cancelled ends CANCELLED; one being preempted counts the preemption."""
        now = time.time()
        with self._moving() as (session, writes):
            job = self._lock(session, job_id)
            state = job.job_state
            if state is S.CANCELLING:
                return self._move(writes, job, S.CANCELLED, f"{job.reason} ({reason})", host, now)
            if state is S.PREEMPTING:
                return self._move(writes, job, S.QUEUED, f"preempted ({reason})", host, now, devices=[],
                                  preemptions=job.preemptions + 1, stop_sent_at=None)
            if state in (S.STARTING, S.RUNNING):  # `attempts` stays: attempt numbers are never reused
                return self._move(writes, job, S.QUEUED, reason, host, now, devices=[], stop_sent_at=None)
            return job

    def requeue_due(self, now: Optional[float] = None) -> list[Job]:
        """FAILED jobs whose backoff has elapsed and that have attempts left -> QUEUED.

        Every service on a shared queue runs this each second: on PostgreSQL the rows are locked as they are
        read, and those another service holds are skipped (it is requeueing them). A plain read let two
        services requeue one job, each writing its own FAILED -> QUEUED event, and the later write could land
        after the first requeue had already been claimed, putting a starting job back in line."""
        now = time.time() if now is None else now
        with self._moving() as (session, writes):
            stmt = select(Job).where(Job.retrying_sql(), Job.not_before <= now)
            if self.db.is_postgres:
                stmt = stmt.with_for_update(skip_locked=True)
            return [self._move(writes, job, S.QUEUED, f"retry {job.failures + 1}/{job.max_attempts}", None,
                               now, devices=[], not_before=None) for job in session.exec(stmt)]

    def preempt(self, job_ids: Iterable[int], reason: "str | Mapping[int, str]",
                host: Optional[str] = None) -> list[Job]:
        """RUNNING -> PREEMPTING; the service then signals the process group. `reason`: one for all, or each
        job's (by id; a job without one gets "preempted for a higher-priority job")."""
        now = time.time()
        out = []
        job_ids = list(job_ids)
        with self._moving() as (session, writes):
            rows = self._lock_many(session, job_ids)
            for job_id in job_ids:
                job = rows.get(job_id)
                if job is None:
                    raise JobNotFound(job_id)
                if job.job_state is S.RUNNING:
                    why = (reason if isinstance(reason, str)
                           else reason.get(job_id, "preempted for a higher-priority job"))
                    out.append(self._move(writes, job, S.PREEMPTING, why, host, now))
        return out

    def mark_stop_sent(self, job_id: int, at: Optional[float] = None) -> None:
        """Record when SIGTERM went to a stopping job (SIGKILL follows after its grace)."""
        with self.db.tx() as session:
            session.execute(update(Job).where(Job.id == job_id).values(stop_sent_at=at or time.time()))

    # ---- people's and agents' requests ------------------------------------------------------------------

    def cancel(self, job_id: int, reason: str = "cancelled by user") -> Job:
        """Cancel: a queued job ends now; a running one moves to CANCELLING and the service stops it."""
        now = time.time()
        with self._moving() as (session, writes):
            job = self._lock(session, job_id)
            state = job.job_state
            if state is S.QUEUED:
                return self._move(writes, job, S.CANCELLED, reason, None, now)
            if state in (S.RUNNING, S.PREEMPTING):
                return self._move(writes, job, S.CANCELLING, reason, None, now, stop_sent_at=None)
            if state is S.STARTING:  # the service stops it as soon as its process exists
                return self._move(writes, job, S.CANCELLING, reason, None, now, stop_sent_at=None)
            if state is S.CANCELLING:
                return job
            if job.retrying:
                # No more retries; it stays FAILED (an event without a change of state).
                writes.set(job, max_attempts=job.failures, not_before=None,
                           reason=f"{job.reason}; {reason}: retries stopped")
                writes.events.append({"job_id": job.id, "at": now, "src": state.value, "dst": state.value,
                                      "reason": f"{reason}: retries stopped", "host": None})
                return job
            raise BadInput(f"job {job_id} is already {state.value}; nothing to cancel")

    def expire(self, job_id: int, now: Optional[float] = None) -> Optional[Job]:
        """A RUNNING job past its time limit -> CANCELLING ("time limit exceeded"); the service then stops it
        (SIGTERM, SIGKILL after its grace) and its exit makes it FAILED. None when it is not running any more."""
        now = time.time() if now is None else now
        with self._moving() as (session, writes):
            job = self._lock(session, job_id)
            if job.job_state is not S.RUNNING:
                return None
            return self._move(writes, job, S.CANCELLING, TIME_LIMIT, None, now, stop_sent_at=None,
                              stop_cause=StopCause.TIME_LIMIT.value)

    def miss_deadlines(self, job_ids: Iterable[int] = (), now: Optional[float] = None) -> list[Job]:
        """QUEUED jobs that can no longer finish by their deadline -> CANCELLED ("deadline"): those given (the
        plan's `expired`) and any other queued job whose deadline is before now plus its time limit. The rule
        is the policy's (`scheduling.misses_deadline`), checked again under the lock."""
        from orchestrator.queue.policy import DEADLINE, misses_deadline

        now = time.time() if now is None else now
        given = list(job_ids)
        with self.db.lone_read() as conn:  # most seconds find none: no write lock for that
            late = [row[0] for row in conn.execute(_LATE, {"now": now})]
        if not late and not given:
            return []
        with self._moving() as (session, writes):
            due = self._lock_many(session, sorted(set(late) | set(given)))
            out = []
            for job in due.values():
                if job.job_state is S.QUEUED and misses_deadline(job.deadline, job.time_limit, now):
                    limit = f" + its time limit {job.time_limit:g}s" if job.time_limit else ""
                    out.append(self._move(writes, job, S.CANCELLED, f"{DEADLINE}: cannot finish by it (now{limit} "
                                          "is past it)", None, now))
            return out

    def demote(self, job_id: int, priority: int, reason: str = "demoted") -> Job:
        """Lower a job's priority; a running job is preempted (it checkpoints and waits in line)."""
        now = time.time()
        with self._moving() as (session, writes):
            job = self._lock(session, job_id)
            if job.final:
                raise BadInput(f"job {job_id} is already {job.state}")
            writes.set(job, priority=check_priority(priority))
            if job.job_state is S.RUNNING:
                return self._move(writes, job, S.PREEMPTING, f"{reason} (priority {priority})", None, now)
            return job


def _default_name(spec: JobSpec) -> str:
    if spec.experiment:
        return spec.experiment
    return os.path.basename(spec.argv[0])[:64]
