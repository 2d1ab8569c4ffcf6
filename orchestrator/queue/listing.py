"""Listings of the queue for people and programs (`queue`, `show`, `top`, the MCP tools), read through SQLAlchemy
Core: plain rows and dicts, no ORM object per job (building one per listed job made a long queue's listing slow:
benchmarks/RESULTS.md, "Queue throughput").

Listing order: the unfinished jobs first, those holding devices (STARTING, RUNNING, PREEMPTING, CANCELLING) by id,
then QUEUED jobs in line order (priority descending, then submit time, then id: the order the service starts them),
then FAILED jobs awaiting a retry in line order; with `finished=True` (`queue --all`) the finished jobs follow,
newest first. A limit keeps the first N of that order, each part one indexed query with its own LIMIT
(`ix_jobs_line` for the line), so a listing's cost follows N, not the length of the queue. When the limit cut the
listing short, the jobs left out are counted by state in one statement (a GROUP BY over the state index), so
"... and 9,950 more queued" reads no rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sqlalchemy import and_, func, literal, not_, or_, select, text, union_all
from sqlalchemy.engine import Connection, Row

from orchestrator.core.errors import BadInput, JobNotFound
from orchestrator.queue.models import RETRYING_SQL, Job, JobEvent, event_dict, job_dict
from orchestrator.queue.states import ACTIVE, HOLDING, JobState

DEFAULT_LIMIT = 50  # what `queue` shows a person (and the MCP list tool returns) unless told otherwise
STATE_ORDER = [s.value for s in JobState]

_jobs = Job.__table__
_events = JobEvent.__table__
_c = _jobs.c
LINE_ORDER = (_c.priority.desc(), _c.submitted_at, _c.id)
# Jobs awaiting a retry, through the partial index ix_jobs_retrying (its condition in literals; every such job
# has a `not_before`, and saying so makes SQLite prefer that index). They are few, so they are sorted after
# the read: the unary plus keeps SQLite from reading every FAILED job through ix_jobs_line for its order.
_RETRYING = text(f"{RETRYING_SQL} AND not_before IS NOT NULL")
_RETRY_ORDER = (text("+jobs.priority DESC"), text("+jobs.submitted_at"), text("+jobs.id"))
_UNFINISHED = or_(_c.state.in_([s.value for s in ACTIVE]), _RETRYING)
# The parts of a listing in order, as (condition, order); `finished=True` listings add _HISTORY.
_PARTS = ((_c.state.in_(sorted(s.value for s in HOLDING)), (_c.id,)),
          (_c.state == JobState.QUEUED.value, LINE_ORDER),
          (_RETRYING, _RETRY_ORDER))
_HISTORY = (not_(_UNFINISHED), (_c.id.desc(),))


def check_limit(limit: Any) -> Optional[int]:
    """A `--limit` as given (an integer >= 0) to a row cap: None (no cap) for 0; BadInput otherwise."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise BadInput(f"--limit must be an integer >= 0 (0: every job), got {limit!r}")
    return limit or None


@dataclass(frozen=True)
class Listing:
    """The first jobs of a listing (as `queue --json` dicts) and how many jobs match, by state."""

    jobs: list[dict]
    counts: dict[str, int]  # every matching job by state, listed or not (FAILED: awaiting a retry, unless --all)

    @property
    def total(self) -> int:
        """How many jobs match."""
        return sum(self.counts.values())

    @property
    def more(self) -> int:
        """How many matching jobs the limit left out."""
        return self.total - len(self.jobs)

    def hidden(self) -> dict[str, int]:
        """The jobs left out, by state (in the states' life-cycle order)."""
        listed: dict[str, int] = {}
        for job in self.jobs:
            listed[job["state"]] = listed.get(job["state"], 0) + 1
        left = {s: n - listed.get(s, 0) for s, n in self.counts.items()}
        return {s: left[s] for s in sorted(left, key=_state_rank) if left[s] > 0}

    def more_line(self) -> str:
        """'... and 9,950 more queued (--limit 0 for all)', or '' when nothing was left out."""
        hidden = self.hidden()
        if not hidden:
            return ""
        if len(hidden) == 1:
            (state, n), = hidden.items()
            return f"... and {n:,} more {state.lower()} (--limit 0 for all)"
        parts = ", ".join(f"{n:,} {state.lower()}" for state, n in hidden.items())
        return f"... and {self.more:,} more: {parts} (--limit 0 for all)"

    def to_dict(self) -> dict[str, Any]:
        """The jobs with their totals (the MCP list tool's answer)."""
        return {"jobs": self.jobs, "total": self.total, "more": self.more, "counts": self.counts}


def _state_rank(state: str) -> int:
    return STATE_ORDER.index(state) if state in STATE_ORDER else len(STATE_ORDER)


def _owned(cond: Any, owner: Optional[str]) -> Any:
    return cond if owner is None else and_(cond, _c.owner == owner)


def counts(conn: Connection, *, finished: bool = False, owner: Optional[str] = None) -> dict[str, int]:
    """Matching jobs by state (unfinished ones, or every job with `finished`): one GROUP BY over the state index,
    plus the FAILED jobs awaiting a retry for unfinished listings, in one statement."""
    if finished:
        stmt = select(_c.state, func.count()).select_from(_jobs)
        if owner is not None:
            stmt = stmt.where(_c.owner == owner)
        stmt = stmt.group_by(_c.state)
    else:  # an OR of both conditions would read every row for `failures`; two index searches do not
        active = (select(_c.state, func.count()).where(_owned(_c.state.in_([s.value for s in ACTIVE]), owner))
                  .group_by(_c.state))
        stmt = union_all(active, select(literal(JobState.FAILED.value), func.count()).select_from(_jobs)
                           .where(_owned(_RETRYING, owner)))
    found = {state: n for state, n in conn.execute(stmt).all() if n}
    return {s: found[s] for s in sorted(found, key=_state_rank)}


def phase_counts(conn: Connection, owner: str, *, skip_cancelled: Optional[str] = None
                 ) -> list[tuple[Optional[str], str, int]]:
    """(phase, state, how many) of the jobs `owner` submitted: an agent session's trials, in one GROUP BY.
    `skip_cancelled`: leave out CANCELLED jobs whose reason starts with it (trials a session runs again), but for
    those the session scored: a job that had finished its budget as the cancel landed keeps its result (the
    session ranks it, `orchestrator.agent.graph`), so its trial is done and is not run again."""
    stmt = select(_c.phase, _c.state, func.count()).where(_c.owner == owner)
    if skip_cancelled:
        stmt = stmt.where(not_(and_(_c.state == JobState.CANCELLED.value, _c.score.is_(None),
                                    _c.reason.startswith(skip_cancelled, autoescape=True))))
    stmt = stmt.group_by(_c.phase, _c.state)
    return [(phase, state, n) for phase, state, n in conn.execute(stmt).all()]


def rows(conn: Connection, *, finished: bool = False, limit: Optional[int] = DEFAULT_LIMIT,
         owner: Optional[str] = None) -> list[dict[str, Any]]:
    """The first `limit` (None: all) matching jobs in listing order, each a plain dict of its column values."""
    out: list[dict[str, Any]] = []
    for cond, order in _PARTS + ((_HISTORY,) if finished else ()):
        if limit is not None and len(out) >= limit:
            break
        stmt = select(_jobs).where(_owned(cond, owner)).order_by(*order)
        if limit is not None:
            stmt = stmt.limit(limit - len(out))
        result = conn.execute(stmt)
        keys = list(result.keys())
        out.extend(dict(zip(keys, row)) for row in result)  # cheaper than attribute access on each Row
    return out


def listing(conn: Connection, *, finished: bool = False, limit: Optional[int] = DEFAULT_LIMIT,
            owner: Optional[str] = None) -> Listing:
    """The first `limit` (None: all) jobs in listing order with the counts of every matching job (counted in
    SQL only when the limit cut the listing short: otherwise the rows are all there is)."""
    found = rows(conn, finished=finished, limit=limit, owner=owner)
    if limit is not None and len(found) >= limit:
        by_state = counts(conn, finished=finished, owner=owner)
    else:
        by_state = {}
        for job in found:
            by_state[job["state"]] = by_state.get(job["state"], 0) + 1
    return Listing([job_dict(r) for r in found], by_state)


def line(conn: Connection, limit: int) -> list[Row]:
    """The first `limit` QUEUED jobs in line order, as Core rows (what `top` plans and shows)."""
    stmt = select(_jobs).where(_c.state == JobState.QUEUED.value).order_by(*LINE_ORDER).limit(limit)
    return list(conn.execute(stmt).all())


def record(conn: Connection, job_id: int) -> dict[str, Any]:
    """One job as `show --json` prints it: the `queue --json` fields plus its events, oldest first."""
    row = conn.execute(select(_jobs).where(_c.id == job_id)).mappings().first()
    if row is None:
        raise JobNotFound(job_id)
    events = conn.execute(select(_events).where(_events.c.job_id == job_id).order_by(_events.c.id)).all()
    return {**job_dict(row), "events": [event_dict(e) for e in events]}
