"""JobStore: the queue's records in one SQL database (SQLite or PostgreSQL), made of parts that share it.

Each part has one job and holds the shared `Database` (`store.db`: connections and transactions):

- `store.queries` (`JobQueries`, orchestrator.queue.queries): reading jobs and their event logs;
- `store.transitions` (`Transitions`, orchestrator.queue.transitions): the only code that changes a job's
  state, one checked transition and one event row each;
- `store.hosts` (`HostRecords`, orchestrator.queue.inventory): devices and service heartbeats;
- `store.runs` (`RunRecords`, orchestrator.queue.runs): the jobs' MLflow run records;
- `store.keeping` (`KeepRecords`, orchestrator.queue.keeping): what checkpoint, log and event retention records.

The job API every face calls (submit, get, list, claim, finish, cancel, ...) is offered by the store itself,
each method handing the call to its part; the other parts are called through their attributes
(`store.hosts.heartbeat(...)`). Code keeping its own tables in the queue's database (projects, the usage
ledger) and whatever needs one transaction across calls (`store.db.transaction()`) use `store.db`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from orchestrator.core.config import Settings
from orchestrator.queue import listing as listings
from orchestrator.queue.db import Database
from orchestrator.queue.inventory import HostRecords
from orchestrator.queue.keeping import KeepRecords
from orchestrator.queue.models import Job, JobEvent, JobSpec
from orchestrator.queue.queries import JobQueries
from orchestrator.queue.rows import Held, Queued
from orchestrator.queue.runs import RunRecords
from orchestrator.queue.states import JobState
from orchestrator.queue.transitions import DEFAULT_BACKOFF, DEFAULT_BACKOFF_CAP, Transitions, backoff

__all__ = ["JobStore", "backoff"]


class JobStore:
    """Jobs, their events, devices and service heartbeats in one SQL database (SQLite or PostgreSQL).

    `retry_backoff` and `retry_backoff_cap` (settings of the same names) go to `store.transitions`, which
    reads them each time a job fails (whoever holds the store may change them there)."""

    def __init__(self, url: str, *, create: bool = True, retry_backoff: float = DEFAULT_BACKOFF,
                 retry_backoff_cap: float = DEFAULT_BACKOFF_CAP):
        self.db = Database(url, create=create)
        self.queries = JobQueries(self.db)
        self.transitions = Transitions(self.db, self.queries, retry_backoff=retry_backoff,
                                       retry_backoff_cap=retry_backoff_cap)
        self.hosts = HostRecords(self.db)
        self.runs = RunRecords(self.db)
        self.keeping = KeepRecords(self.db, self.queries)

    @classmethod
    def from_settings(cls, settings: Settings) -> "JobStore":
        """The store of a `Settings`: its database and its retry backoff."""
        return cls(settings.db_url, retry_backoff=settings.retry_backoff,
                   retry_backoff_cap=settings.retry_backoff_cap)

    # ---- the database ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the connection pool."""
        self.db.close()

    # ---- reading jobs (JobQueries) --------------------------------------------------------------------------

    def find_by_key(self, key: str) -> Optional[Job]:
        """The job submitted with this idempotency key, if any."""
        return self.queries.find_by_key(key)

    def get(self, job_id: int) -> Job:
        """The job with this id, or JobNotFound (a BadInput: exit 2)."""
        return self.queries.get(job_id)

    def get_many(self, job_ids: Iterable[int]) -> list[Job]:
        """The jobs with these ids that exist, in id order."""
        return self.queries.get_many(job_ids)

    def list(self, states: Optional[Iterable[JobState]] = None, *, owner: Optional[str] = None,
             experiment: Optional[str] = None, host: Optional[str] = None) -> list[Job]:
        """Jobs in id order, filtered by state(s), owner, experiment and host."""
        return self.queries.list(states, owner=owner, experiment=experiment, host=host)

    def unfinished(self) -> list[Job]:
        """Active jobs and failed ones awaiting a retry (what `autoresearch queue` shows by default)."""
        return self.queries.unfinished()

    def listing(self, *, finished: bool = False, limit: Optional[int] = listings.DEFAULT_LIMIT,
                owner: Optional[str] = None) -> listings.Listing:
        """What `autoresearch queue` lists (`JobQueries.listing`)."""
        return self.queries.listing(finished=finished, limit=limit, owner=owner)

    def record(self, job_id: int) -> dict:
        """One job with its events as `show --json` prints it (JobNotFound: exit 2)."""
        return self.queries.record(job_id)

    def state_counts(self, *, finished: bool = False, owner: Optional[str] = None) -> dict[str, int]:
        """Unfinished jobs (every job with `finished`) by state, counted in SQL."""
        return self.queries.state_counts(finished=finished, owner=owner)

    def phase_counts(self, owner: str, *, skip_cancelled: Optional[str] = None
                     ) -> list[tuple[Optional[str], str, int]]:
        """(phase, state, how many) of `owner`'s jobs, counted in SQL (CANCELLED ones whose reason starts with
        `skip_cancelled` left out)."""
        return self.queries.phase_counts(owner, skip_cancelled=skip_cancelled)

    def line(self, limit: int) -> list:
        """The first `limit` QUEUED jobs in line order, as read-only rows."""
        return self.queries.line(limit)

    def events(self, job_id: int) -> list[JobEvent]:
        """The job's event log, oldest first."""
        return self.queries.events(job_id)

    def recent_events(self, limit: int = 20) -> list[JobEvent]:
        """The latest `limit` transitions of any job, newest first."""
        return self.queries.recent_events(limit)

    def count(self) -> int:
        """How many jobs exist."""
        return self.queries.count()

    def count_in(self, state: JobState) -> int:
        """How many jobs are in `state`."""
        return self.queries.count_in(state)

    def waiting_with(self, *, gpus_over: int, reason_prefix: str) -> list[Job]:
        """QUEUED jobs needing more than `gpus_over` devices, or whose reason starts with `reason_prefix`."""
        return self.queries.waiting_with(gpus_over=gpus_over, reason_prefix=reason_prefix)

    def snapshot(self, host: str, *, capacity: Optional[int] = None, limit: Optional[int] = None,
                 skip: Iterable[int] = (), projects: Sequence[str] = ()) -> tuple[list[Queued], list[Held]]:
        """What one dispatch pass needs (`JobQueries.snapshot`)."""
        return self.queries.snapshot(host, capacity=capacity, limit=limit, skip=skip, projects=projects)

    # ---- changing jobs (Transitions) ------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Job:
        """Queue a job. With an idempotency key already used, return that job instead of a new one."""
        return self.transitions.submit(spec)

    def claim(self, starts: Sequence[tuple[int, Sequence[str]]], host: str, *,
              checkpoint_root: Optional[str] = None, log_root: Optional[str] = None) -> list[Job]:
        """QUEUED -> STARTING for each (job id, devices) still queued (`Transitions.claim`)."""
        return self.transitions.claim(starts, host, checkpoint_root=checkpoint_root, log_root=log_root)

    def note(self, reasons: dict[int, str]) -> None:
        """Update the state reason of QUEUED jobs (why a job waits) without a transition."""
        self.transitions.note(reasons)

    def mark_running(self, job_id: int, pid: int, proc_start: Optional[str], host: Optional[str] = None) -> Job:
        """STARTING -> RUNNING once the process exists."""
        return self.transitions.mark_running(job_id, pid, proc_start, host)

    def mark_running_many(self, launched: Sequence[tuple], host: Optional[str] = None) -> list[int]:
        """`mark_running` for many (job id, pid, proc start[, how it started]) in one commit; the ids found."""
        return self.transitions.mark_running_many(launched, host)

    def finish(self, job_id: int, exit_code: int, host: Optional[str] = None, *, detail: str = "") -> Job:
        """Record the end of an attempt and move the job to the state its process earned."""
        return self.transitions.finish(job_id, exit_code, host, detail=detail)

    def finish_many(self, results: Sequence[tuple[int, int, int, str]], host: Optional[str] = None) -> list[Any]:
        """`finish` for many (job id, attempt, exit code, detail) in one commit (`Transitions.finish_many`)."""
        return self.transitions.finish_many(results, host)

    def requeue(self, job_id: int, reason: str, host: Optional[str] = None) -> Job:
        """Put a STARTING or RUNNING job back in line without spending an attempt."""
        return self.transitions.requeue(job_id, reason, host)

    def requeue_due(self, now: Optional[float] = None) -> list[Job]:
        """FAILED jobs whose backoff has elapsed and that have attempts left -> QUEUED."""
        return self.transitions.requeue_due(now)

    def preempt(self, job_ids: Iterable[int], reason: "str | Mapping[int, str]",
                host: Optional[str] = None) -> list[Job]:
        """RUNNING -> PREEMPTING (`Transitions.preempt`)."""
        return self.transitions.preempt(job_ids, reason, host)

    def mark_stop_sent(self, job_id: int, at: Optional[float] = None) -> None:
        """Record when SIGTERM went to a stopping job."""
        self.transitions.mark_stop_sent(job_id, at)

    def cancel(self, job_id: int, reason: str = "cancelled by user") -> Job:
        """Cancel: a queued job ends now; a running one moves to CANCELLING and the service stops it."""
        return self.transitions.cancel(job_id, reason)

    def expire(self, job_id: int, now: Optional[float] = None) -> Optional[Job]:
        """A RUNNING job past its time limit -> CANCELLING; None when it is not running any more."""
        return self.transitions.expire(job_id, now)

    def miss_deadlines(self, job_ids: Iterable[int] = (), now: Optional[float] = None) -> list[Job]:
        """QUEUED jobs that can no longer finish by their deadline -> CANCELLED."""
        return self.transitions.miss_deadlines(job_ids, now)

    def demote(self, job_id: int, priority: int, reason: str = "demoted") -> Job:
        """Lower a job's priority; a running job is preempted."""
        return self.transitions.demote(job_id, priority, reason)
