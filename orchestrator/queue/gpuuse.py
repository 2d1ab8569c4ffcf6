"""The GPU busy share: how busy the GPUs were, and how busy while jobs held them (tables in
`orchestrator.queue.gpumodels`).

The arithmetic is pure (`integrate`, `integrate_host`): from two NVML samples of one device and the jobs holding
it, the seconds observed, busy-seconds (the mean utilisation of the two samples x the time between them), the
seconds held and busy while held; and each holder's share of that (a `--gpus 0.25` job counts a quarter of the
device's time, and a quarter of its busy time, so its busy share is the device's utilisation while it held it).
A holder counts only from its attempt's start (`Holder.since`), and nothing is counted across a gap longer than
`max_gap` (a sampler that stalled, a service that was down): an unknown stretch is not guessed at.

`GpuUse` keeps the figures (one small write per device and per holding job per sample) and answers the faces:
`top` (the last sample), `usage` (held and busy device-hours by project, owner or session), a session's report
(`busy_share`) and the service's MLflow logging of a job's figures once it ends (`to_log`, `logged`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from sqlalchemy import case, insert, or_, select, text, update

from orchestrator.queue.gpumodels import DeviceUse, JobGpuUse
from orchestrator.queue.models import RETRYING_SQL, Job
from orchestrator.queue.policy import DEFAULT_PROJECT
from orchestrator.queue.states import FINISHED
from runtime.protocol import UTILIZATION_METRIC

DEVICES, USE, JOBS = DeviceUse.__table__, JobGpuUse.__table__, Job.__table__
# The device memory used (MLflow's own system-metric name and unit, 10^6 bytes), logged next to
# `runtime.protocol.UTILIZATION_METRIC` on a job's run: the peak the sampler saw on its devices while it held them.
MEMORY_USED_METRIC = "system/gpu_memory_usage_megabytes"
MB = 1e6


# ---- the arithmetic ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """One NVML reading of one device: when, utilisation (percent), memory used and total (bytes), compute pids."""

    at: float
    util: float
    mem_used: int = 0
    mem_total: int = 0
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Holder:
    """A job holding a device: its share of it (1.0: the whole device) and since when (its attempt's start)."""

    job_id: int
    share: float = 1.0
    since: float = 0.0


@dataclass
class DeviceStep:
    """What one device adds to its integrals between two samples (seconds)."""

    seconds: float = 0.0
    busy: float = 0.0
    held: float = 0.0
    busy_held: float = 0.0


@dataclass
class JobStep:
    """What one job adds to its integrals: wall seconds, device-seconds held and busy, the peak memory seen."""

    seconds: float = 0.0
    held: float = 0.0
    busy: float = 0.0
    peak_memory: int = 0

    def add(self, other: "JobStep") -> "JobStep":
        """This job's step over several devices: wall seconds are not added up, device-seconds are."""
        return JobStep(max(self.seconds, other.seconds), self.held + other.held, self.busy + other.busy,
                       max(self.peak_memory, other.peak_memory))


def integrate(prev: Optional[Sample], cur: Sample, holders: Sequence[Holder], *,
              max_gap: float) -> tuple[DeviceStep, dict[int, JobStep]]:
    """One device's step from `prev` to `cur` with `holders` holding it at `cur` (see the module's rules).
    Without a previous sample, or across a gap over `max_gap`, only the holders' peak memory counts."""
    dt = 0.0 if prev is None else cur.at - prev.at
    if not 0 < dt <= max_gap:
        return DeviceStep(), {h.job_id: JobStep(peak_memory=cur.mem_used) for h in holders}
    util = min(100.0, max(0.0, (prev.util + cur.util) / 2)) / 100
    jobs, held = {}, 0.0
    for h in holders:
        t = min(dt, max(0.0, cur.at - max(prev.at, h.since)))
        held = max(held, t)
        share = min(1.0, max(0.0, h.share))
        step = JobStep(t, share * t, share * util * t, cur.mem_used)
        jobs[h.job_id] = jobs[h.job_id].add(step) if h.job_id in jobs else step
    return DeviceStep(dt, util * dt, held, util * held), jobs


def integrate_host(prev: Mapping[str, Sample], cur: Mapping[str, Sample], holders: Mapping[str, Sequence[Holder]],
                   *, max_gap: float) -> tuple[dict[str, DeviceStep], dict[int, JobStep]]:
    """`integrate` for every device sampled now (`cur`), each job's steps over its devices combined."""
    devices: dict[str, DeviceStep] = {}
    jobs: dict[int, JobStep] = {}
    for name, sample in cur.items():
        devices[name], mine = integrate(prev.get(name), sample, holders.get(name, ()), max_gap=max_gap)
        for job_id, step in mine.items():
            jobs[job_id] = jobs[job_id].add(step) if job_id in jobs else step
    return devices, jobs


def share_text(held: float, busy: float) -> str:
    """The line of a session's report: how busy the GPUs were while its trials held them."""
    if held <= 0:
        return "no GPU held"
    return f"GPU busy {100 * busy / held:.0f}% of the device time it held ({held / 3600:.2f} device-hours)"


# ---- the records ---------------------------------------------------------------------------------------------

def _greatest(column: Any, value: Any) -> Any:
    return case((column < value, value), else_=column)


@dataclass
class Figures:
    """Held and busy device-seconds of some jobs (`GpuUse.totals`)."""

    held: float = 0.0
    busy: float = 0.0
    jobs: set = field(default_factory=set)

    @property
    def share(self) -> Optional[float]:
        """Busy / held (None when nothing was held)."""
        return self.busy / self.held if self.held > 0 else None


class GpuUse:
    """The busy-share records in the queue's database (`db`: `orchestrator.queue.db.Database`)."""

    def __init__(self, db: Any):
        self.db = db

    def record(self, host: str, samples: Mapping[str, Sample], devices: Mapping[str, DeviceStep],
               jobs: Mapping[int, JobStep], now: Optional[float] = None) -> None:
        """One sample of `host`'s GPUs, in one transaction: each device's last values and integrals, each holding
        job's integrals (an UPDATE, or an INSERT for a row not there yet)."""
        now = time.time() if now is None else now
        with self.db.tx() as session:
            conn = session.connection()
            for name, s in samples.items():
                d = devices.get(name) or DeviceStep()
                values = dict(sampled_at=s.at, util=float(s.util), mem_used=int(s.mem_used),
                              mem_total=int(s.mem_total), pids=list(s.pids))
                done = conn.execute(update(DEVICES).where(DEVICES.c.host == host, DEVICES.c.device == name).values(
                    **values, seconds=DEVICES.c.seconds + d.seconds, busy_seconds=DEVICES.c.busy_seconds + d.busy,
                    held_seconds=DEVICES.c.held_seconds + d.held,
                    busy_held_seconds=DEVICES.c.busy_held_seconds + d.busy_held)).rowcount
                if not done:
                    conn.execute(insert(DEVICES).values(host=host, device=name, **values, seconds=d.seconds,
                                                        busy_seconds=d.busy, held_seconds=d.held,
                                                        busy_held_seconds=d.busy_held))
            for job_id, j in jobs.items():
                done = conn.execute(update(USE).where(USE.c.job_id == job_id).values(
                    seconds=USE.c.seconds + j.seconds, held_seconds=USE.c.held_seconds + j.held,
                    busy_seconds=USE.c.busy_seconds + j.busy,
                    peak_memory=_greatest(USE.c.peak_memory, int(j.peak_memory)), updated_at=now)).rowcount
                if not done:
                    conn.execute(insert(USE).values(job_id=job_id, seconds=j.seconds, held_seconds=j.held,
                                                    busy_seconds=j.busy, peak_memory=int(j.peak_memory),
                                                    updated_at=now))

    def devices(self, host: Optional[str] = None) -> list[Any]:
        """The devices' rows (last sample and integrals), of one host or all."""
        stmt = select(DEVICES).order_by(DEVICES.c.host, DEVICES.c.device)
        if host is not None:
            stmt = stmt.where(DEVICES.c.host == host)
        with self.db.lone_read() as conn:
            return list(conn.execute(stmt))

    def jobs(self, job_ids: Iterable[int]) -> dict[int, Any]:
        """The rows of these jobs (those that held a GPU while sampled), by job id."""
        ids = sorted({int(i) for i in job_ids})
        if not ids:
            return {}
        with self.db.lone_read() as conn:
            return {row.job_id: row for row in conn.execute(select(USE).where(USE.c.job_id.in_(ids)))}

    def totals(self, by: str, since: Optional[float] = None) -> dict[str, Figures]:
        """Held and busy device-seconds per project or owner ('session' reads owners) of the jobs that held a
        GPU; with `since`, only jobs not finished before then (the figures are per job, not per moment)."""
        key = JOBS.c.project if by == "project" else JOBS.c.owner
        stmt = (select(key, USE.c.job_id, USE.c.held_seconds, USE.c.busy_seconds)
                .join(JOBS, JOBS.c.id == USE.c.job_id))
        if since is not None:
            stmt = stmt.where(or_(JOBS.c.finished_at.is_(None), JOBS.c.finished_at >= since))
        out: dict[str, Figures] = {}
        with self.db.lone_read() as conn:
            for name, job_id, held, busy in conn.execute(stmt):
                name = name or (DEFAULT_PROJECT if by == "project" else "")
                fig = out.setdefault(name, Figures())
                fig.held += held or 0.0
                fig.busy += busy or 0.0
                fig.jobs.add(job_id)
        return out

    def to_log(self, limit: int = 64) -> list[tuple[int, Optional[str], float, float, int]]:
        """Jobs ended for good whose figures are not on their MLflow run yet: (job id, run id or None, held
        device-seconds, busy device-seconds, peak memory in bytes), the longest ended first."""
        stmt = (select(USE.c.job_id, JOBS.c.mlflow_run_id, USE.c.held_seconds, USE.c.busy_seconds,
                       USE.c.peak_memory)
                .join(JOBS, JOBS.c.id == USE.c.job_id)
                .where(USE.c.logged_at.is_(None), JOBS.c.state.in_([s.value for s in FINISHED]),
                       text(f"NOT ({RETRYING_SQL})"))
                .order_by(JOBS.c.finished_at).limit(limit))
        with self.db.lone_read() as conn:
            return [tuple(row) for row in conn.execute(stmt)]

    def logged(self, job_ids: Iterable[int], now: Optional[float] = None) -> None:
        """Note that these jobs' figures were logged (or had nowhere to go)."""
        ids = list(job_ids)
        if ids:
            with self.db.tx() as session:
                session.connection().execute(update(USE).where(USE.c.job_id.in_(ids))
                                             .values(logged_at=time.time() if now is None else now))


def metrics(held: float, busy: float, peak_memory: int) -> dict[str, float]:
    """The MLflow metrics of one job's figures: mean device utilisation while it held it, peak memory used."""
    out = {MEMORY_USED_METRIC: round(peak_memory / MB, 3)}
    if held > 0:
        out[UTILIZATION_METRIC] = round(100 * busy / held, 3)
    return out


def busy_share(store_or_db: Any, job_ids: Iterable[int]) -> tuple[float, float]:
    """(held device-seconds, busy device-seconds) of these jobs' GPU use, as the service sampled it (0, 0 when
    none held a GPU: cpu slots, or no sampler). `store_or_db`: a `JobStore` or its `Database`."""
    db = getattr(store_or_db, "db", store_or_db)
    rows = GpuUse(db).jobs(job_ids).values()
    return sum(r.held_seconds for r in rows), sum(r.busy_seconds for r in rows)


__all__ = ["Sample", "Holder", "DeviceStep", "JobStep", "integrate", "integrate_host", "GpuUse", "Figures",
           "busy_share", "metrics", "share_text", "MEMORY_USED_METRIC"]
