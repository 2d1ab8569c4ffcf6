"""The usage ledger: device-seconds per attempt, read from the job event log.

An attempt holds its devices from the event that placed it (-> STARTING) to the event that gave them back
(-> QUEUED, SUCCEEDED, FAILED or CANCELLED); its device-seconds are its devices x that time (an attempt still
holding counts up to now; a job sharing one GPU, `--gpus 0.25`, counts its share of it: 0.25 x that time). The
ledger sums attempts by project, owner (the agent session for trial jobs) or session, scavengers apart (they
are never charged); the scheduler weighs each project's *decayed* usage, every second of use counting
2^(-age / half-life) (Slurm's PriorityDecayHalfLife, Kueue's usage half-life).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from sqlalchemy import or_, select

from orchestrator.core.errors import BadInput
from orchestrator.queue.models import Job, JobEvent
from orchestrator.queue.states import JobState
from orchestrator.queue.policy import DEFAULT_PROJECT

S = JobState
JOBS, EVENTS = Job.__table__, JobEvent.__table__
_RELEASED = {S.QUEUED.value, S.SUCCEEDED.value, S.FAILED.value, S.CANCELLED.value}
BY = ("project", "owner", "session")


@dataclass(frozen=True)
class Attempt:
    """One attempt's hold of devices: which job, charged to whom, how many devices, from when to when."""

    job_id: int
    project: str
    owner: str
    scavenger: bool
    gpus: float  # devices held: a share of one (`gpu_share`) for a job sharing a GPU
    start: float
    end: float
    open: bool  # still holding its devices (end is the time of the read)

    def device_seconds(self, since: Optional[float] = None) -> float:
        """Devices x seconds held, only from `since` on when given."""
        start = self.start if since is None else max(self.start, since)
        return self.gpus * max(0.0, self.end - start)

    def decayed(self, now: float, half_life: float) -> float:
        """Device-seconds with each second weighted 2^(-(now - t) / half_life)."""
        if half_life <= 0:
            return self.device_seconds()
        rate = math.log(2) / half_life
        return self.gpus * (math.exp(-rate * (now - self.end)) - math.exp(-rate * (now - self.start))) / rate


def attempts(store: Any, *, since: Optional[float] = None, now: Optional[float] = None) -> list[Attempt]:
    """Every attempt that held devices at some time from `since` (None: ever) to `now`, from the event log."""
    now = time.time() if now is None else now
    stmt = (select(EVENTS.c.job_id, EVENTS.c.at, EVENTS.c.dst, JOBS.c.project, JOBS.c.owner, JOBS.c.scavenger,
                   JOBS.c.gpus, JOBS.c.gpu_share)
            .join(JOBS, JOBS.c.id == EVENTS.c.job_id)
            .order_by(EVENTS.c.job_id, EVENTS.c.id))
    if since is not None:  # a job finished before `since` held nothing since
        stmt = stmt.where(or_(JOBS.c.finished_at.is_(None), JOBS.c.finished_at >= since))
    out: list[Attempt] = []
    current, start = None, None
    last: Any = None
    with store.db.reading() as conn:
        for job_id, at, dst, project, owner, scavenger, gpus, share in conn.execute(stmt):
            if job_id != current:
                if start is not None:
                    out.append(Attempt(current, *last, start, now, True))
                current, start = job_id, None
            last = (project or DEFAULT_PROJECT, owner or "", bool(scavenger), float(share or gpus or 1))
            if dst == S.STARTING.value and start is None:
                start = at
            elif dst in _RELEASED and start is not None:
                out.append(Attempt(job_id, *last, start, at, False))
                start = None
        if start is not None:
            out.append(Attempt(current, *last, start, now, True))
    return [a for a in out if since is None or a.end >= since]


def decayed_by_project(items: Iterable[Attempt], now: float, half_life: float) -> dict[str, float]:
    """Each project's decayed device-seconds (what fair sharing weighs); scavengers are not charged."""
    out: dict[str, float] = {}
    for a in items:
        if not a.scavenger:
            out[a.project] = out.get(a.project, 0.0) + a.decayed(now, half_life)
    return out


def ledger(items: Iterable[Attempt], *, by: str = "project", since: Optional[float] = None) -> list[dict]:
    """Rows of `autoresearch usage`: per key (project, owner or session), device-seconds charged, scavenger
    device-seconds (apart, not charged), attempts and jobs. `session`: owners that are agent sessions only."""
    if by not in BY:
        raise BadInput(f"--by must be one of {', '.join(BY)}, got {by!r}")
    rows: dict[str, dict] = {}
    for a in items:
        key = a.project if by == "project" else a.owner
        if by == "session" and not key.startswith("s-"):  # agent sessions' ids (orchestrator.agent.session)
            continue
        row = rows.setdefault(key, {by: key, "device_seconds": 0.0, "scavenger_device_seconds": 0.0,
                                    "attempts": 0, "jobs": set(), "running": 0})
        row["scavenger_device_seconds" if a.scavenger else "device_seconds"] += a.device_seconds(since)
        row["attempts"] += 1
        row["jobs"].add(a.job_id)
        row["running"] += a.open
    out = []
    for row in sorted(rows.values(), key=lambda r: -(r["device_seconds"] + r["scavenger_device_seconds"])):
        row["jobs"] = len(row["jobs"])
        row["device_hours"] = round(row["device_seconds"] / 3600, 4)
        out.append(row)
    return out
