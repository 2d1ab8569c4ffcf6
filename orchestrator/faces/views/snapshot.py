"""What `autoresearch top` shows, read once: devices and their jobs, the queue with the next plan, events, sessions.

`take()` reads the queue (one home's database), the agent registry and, where devices are GPUs, the service's
last NVML sample of each (`orchestrator.queue.gpuuse`; NVML itself where no fresh sample is there). The
"next plan" column comes from the service's own policy, `orchestrator.queue.policy.plan`, run on this snapshot
per live service (its devices and the jobs it holds), so what `top` says will happen is what the service will
decide on its next pass (short of devices under an idle check, which the service alone knows about).
Nothing here changes anything.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence
from pathlib import Path

from orchestrator.api import jobs as api
from orchestrator.queue import policy as scheduling
from orchestrator.core.config import Settings
from orchestrator.core.gpushare import format_gpus
from orchestrator.core.layout import Layout
from orchestrator.queue.models import Device, Job, JobEvent, ServiceRecord
from orchestrator.queue.states import HOLDING, JobState
from orchestrator.queue.store import JobStore

S = JobState
QUEUE_ROWS = 200  # the queue is planned and shown up to this many waiting jobs (more than a screen holds)


@dataclass
class DeviceRow:
    """One device: its state, the job on it (if any; the first of `jobs` when jobs share it) and, on GPUs,
    utilisation (the busy %) and memory."""

    host: str
    name: str
    state: str
    reason: str
    job: Optional[Job] = None
    heartbeat_at: Optional[float] = None  # the job's last progress heartbeat
    step: Optional[int] = None
    util: Optional[int] = None
    mem_used: Optional[int] = None
    mem_total: Optional[int] = None
    jobs: list = field(default_factory=list)  # every job holding it, by id (several when they share it)

    def __post_init__(self) -> None:
        if self.job is not None and not self.jobs:
            self.jobs = [self.job]


@dataclass
class QueueRow:
    """One waiting job, in line order, with what the next plan does about it."""

    position: int
    job: Any  # a Job, or a read-only row with its columns (`JobStore.line`)
    plan: str  # "starts on cpu:0", "preempts #4 #7", "will preempt #8 in 42 s (...)", "next, needs 2",
    #            "waits behind #3", "no service has 4 devices"
    starts: bool = False
    preempts: tuple[int, ...] = ()


@dataclass
class Snapshot:
    """Everything one frame of `top` shows."""

    at: float
    home: str
    services: list[ServiceRecord]
    devices: list[DeviceRow]
    queue: list[QueueRow]
    victims: dict[int, int]  # running job id -> the waiting job it will be preempted for
    running: list[Job]
    events: list[tuple[JobEvent, str]]  # (event, job name)
    sessions: list[dict] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # unfinished jobs by state, all of them (not only shown)
    projects: list[dict] = field(default_factory=list)  # `projects --json` rows; empty with only the default one
    drained: dict[str, str] = field(default_factory=dict)  # Slurm node -> why this queue drained it


def _heartbeat(layout: Layout, job_id: int) -> tuple[Optional[float], Optional[int]]:
    from runtime.context import read_heartbeat

    beat = read_heartbeat(layout.heartbeat_file(job_id)) or {}
    return beat.get("time"), beat.get("step")


def _sampled_usage(rows: list[DeviceRow], store: Any, now: float, interval: float) -> None:
    """Fill utilisation and memory of GPU devices from the service's samples that are fresh (a few intervals)."""
    from orchestrator.queue.gpuuse import GpuUse

    if not any(not r.name.startswith("cpu:") for r in rows):
        return
    fresh = now - max(3 * interval, 10.0)
    samples = {(u.host, u.device): u for u in GpuUse(store.db).devices() if u.sampled_at >= fresh}
    for row in rows:
        u = samples.get((row.host, row.name))
        if u is not None:
            row.util, row.mem_used, row.mem_total = round(u.util), u.mem_used, u.mem_total


def _gpu_usage(rows: list[DeviceRow], timeout: float) -> None:
    """Fill utilisation and memory of GPU devices without a sample from NVML (nothing on cpu slots or hosts
    without NVML)."""
    gpus = [r for r in rows if not r.name.startswith("cpu:") and r.util is None]
    if not gpus:
        return
    from runtime.nvml import Nvml

    nv = Nvml(timeout_s=timeout).open()
    if not nv.available:
        return
    try:
        for row in gpus:
            try:
                row.util, row.mem_used, row.mem_total = nv.usage(row.name)
            except Exception:  # another host's device, a MIG slice without counters: leave it blank
                continue
    finally:
        nv.close()


def plan_projects(rows: list[dict]) -> tuple[scheduling.Project, ...]:
    """The policy's `Project`s from `projects --json` rows (decayed usage back in device-seconds)."""
    return tuple(scheduling.Project(r["name"], share=r["share"], quota=r["quota"], borrow_limit=r["borrow_limit"],
                                    usage=r["usage_device_hours"] * 3600)
                 for r in rows if r.get("source") != "scavenger")


def plan_queue(waiting: list[Any], holding: list[Job], devices: list[Device], services: list[ServiceRecord],
               now: float, preempt_after: float, projects: tuple = (),
               device_memory: Optional[dict[tuple[str, str], int]] = None) -> tuple[list[QueueRow], dict[int, int]]:
    """Each waiting job's fate in the next plan of the live services, and who is preempted for whom.

    The policy says which victim is preempted for which job (`Plan.preempt_for`). A job that waits only because
    its victims have not run `preempt_after` seconds yet is told when the policy will preempt them: the plan is
    run again at each moment a lower-priority job comes of age, and the first that preempts for it is the one."""
    starting: dict[int, tuple[str, ...]] = {}
    victims: dict[int, int] = {}
    # job id -> (victims, seconds until it preempts them, the service's preempt_after)
    future: dict[int, tuple[tuple[int, ...], float, float]] = {}
    line = [scheduling.Waiting.of(j) for j in waiting]
    for svc in services:
        usable = [d.name for d in devices if d.host == svc.host and d.state == "available"]
        running = [scheduling.Running.of(j, now) for j in holding if j.host == svc.host]
        after = preempt_after if svc.preempt_after is None else svc.preempt_after  # the service's own setting
        memory = {d: total for (host, d), total in (device_memory or {}).items() if host == svc.host}
        full = scheduling.plan(line, running, usable, now, after, projects, device_memory=memory)
        starting.update({job_id: devs for job_id, devs in full.starts if job_id not in starting})
        for victim, job_id in full.preempt_for:
            victims.setdefault(victim, job_id)
        acted = {job_id for job_id, _ in full.starts} | {job_id for _, job_id in full.preempt_for}
        blocked = next((k for k, w in enumerate(line) if w.id not in acted
                        and scheduling.fits(w.gpus, len(set(usable)))), None)
        if blocked is not None and line[blocked].id not in future:
            coming = _coming_of_age(line[: blocked + 1], running, usable, now, after, projects)
            if coming is not None:
                future[line[blocked].id] = (*coming, after)
    capacity = max((len(s.devices or []) for s in services), default=0)
    rows: list[QueueRow] = []
    blocker: Optional[Any] = None
    for i, job in enumerate(waiting, 1):
        mine = tuple(v for v, f in victims.items() if f == job.id)
        if job.id in starting:
            text, starts = "starts on " + ",".join(starting[job.id]), True
        elif not services:
            text, starts = "no service running", False
        elif not scheduling.fits(job.gpus, capacity):
            text, starts = f"no service has {job.gpus} devices", False
        elif mine:
            text, starts = "preempts " + " ".join(f"#{v}" for v in sorted(mine)), False
        elif blocker is None:
            blocker = job
            if job.id in future:
                ids, seconds, after = future[job.id]
                text = (f"will preempt {' '.join(f'#{v}' for v in ids)} in {math.ceil(seconds)} s "
                        f"({'its' if len(ids) == 1 else 'their'} minimum runtime, --preempt-after {after:g})")
            else:
                text = f"next, needs {format_gpus(job.gpus, getattr(job, 'gpu_share', None))}"
            starts = False
        else:
            text, starts = f"waits behind #{blocker.id}", False
        rows.append(QueueRow(i, job, text, starts, mine))
    return rows, victims


def _coming_of_age(line: list[scheduling.Waiting], running: list[scheduling.Running], usable: list[str], now: float,
                   preempt_after: float, projects: Sequence[scheduling.Project] = ()
                   ) -> Optional[tuple[tuple[int, ...], float]]:
    """(victims, seconds from now) of the first future plan that preempts for the last job of `line`, trying
    the moments running jobs reach `preempt_after` (nothing else changes a plan while nobody acts); None if
    none does."""
    job_id = line[-1].id
    moments = sorted({r.started_at + preempt_after for r in running
                      if r.preemptible and not r.releasing and r.started_at + preempt_after > now})
    for at in moments:
        plan = scheduling.plan(line, running, usable, at, preempt_after, projects)
        mine = tuple(sorted(v for v, f in plan.preempt_for if f == job_id))
        if mine:
            return mine, at - now
    return None


def line_plans(settings: Settings, store: Optional[JobStore] = None) -> dict[int, str]:
    """What the next plan does about each of the first waiting jobs (`QUEUE_ROWS`), by id: the reason `queue`
    and `show` give a QUEUED job, the same words `top` shows."""
    store = store or api.open_store(settings)
    now = time.time()
    holding = store.list(HOLDING)
    held = {j.id for j in holding}
    waiting = [row for row in store.line(QUEUE_ROWS) if row.id not in held]
    rows, _ = plan_queue(waiting, holding, store.hosts.devices(), api.live_services(store), now,
                         settings.preempt_after, *plan_inputs(settings, store, now)[1:])
    return {row.job.id: row.plan for row in rows}


def plan_inputs(settings: Settings, store: JobStore, now: float) -> tuple[list[dict], tuple, dict]:
    """What the services plan with besides the queue, for `queue`, `show` and `top` alike: the projects' table
    (its rows, and the policy's `Project`s: none when only the default project exists) and each GPU's memory
    (by host and device, from the service's last samples), so the three say what the next plan does."""
    from orchestrator.queue.gpuuse import GpuUse

    try:
        from orchestrator.api.sharing import projects_table

        shared = projects_table(settings, store, now)
    except Exception:  # a view: a bad [projects] table is `projects`' to report, not a reason to go blank
        shared = []
    if len(shared) <= 1:
        shared = []  # only the default project: nothing to say
    memory = {(u.host, u.device): u.mem_total for u in GpuUse(store.db).devices() if u.mem_total}
    return shared, plan_projects(shared), memory


def job_record(settings: Settings, store: JobStore, job_id: int) -> dict[str, Any]:
    """One job with its events (`show --json`, MCP's get_job) and, while it waits, `next`: what the next plan
    does about it (will start, will preempt #N, waits for a quota, for backfill, for a healthy device, for
    disk), in the words `queue` and `top` use."""
    record = store.record(job_id)
    if (record.get("nodes") or 1) > 1:  # a job across nodes: the nodes of each attempt and those it excludes
        from orchestrator.executors.slurm import nodes as slurm_nodes

        state = slurm_nodes.job_state(settings.home, job_id)
        record["excluded_nodes"] = state.get("excluded") or {}
        record["node_attempts"] = slurm_nodes.describe_attempts(state)
    if record["state"] == "QUEUED":
        plans = line_plans(settings, store)
        if job_id in plans:
            record["next"] = plans[job_id]
    return record


def reserved(queue: list[QueueRow]) -> bool:
    """Whether idle devices are being held: a job that could run here waits, and the plan starts nothing on them
    (the policy keeps free devices for the head of the line rather than let jobs behind it pass)."""
    return any(r.preempts or r.plan.startswith(("next", "will preempt")) for r in queue)


def take(settings: Settings, *, store: Any = None, with_gpus: bool = True, events: int = 12) -> Snapshot:
    """Read one frame's worth of state."""
    from orchestrator.agent import background as sessions_api

    store = store or api.open_store(settings)
    now = time.time()
    services = api.live_services(store)
    devices = store.hosts.devices()
    # A screenful, not the whole queue: the head of the line as light rows, the jobs holding devices (a few per
    # device), and the counts by state from SQL (10,000 queued jobs cost the same frame as 10). Separate reads:
    # a job placed in between is shown on its device, not also in the line.
    waiting = store.line(QUEUE_ROWS)
    holding = store.list(HOLDING)
    held = {j.id for j in holding}
    waiting = [row for row in waiting if row.id not in held]
    counts = store.state_counts()
    shared, projects, memory = plan_inputs(settings, store, now)
    queue, victims = plan_queue(waiting, holding, devices, services, now, settings.preempt_after, projects, memory)

    layout = Layout(settings.home)
    on: dict[tuple[str, str], list[Job]] = {}
    for job in sorted(holding, key=lambda j: j.id):
        for dev in job.devices or ():
            on.setdefault((job.host or "", dev), []).append(job)
    rows = []
    for dev in devices:
        jobs = on.get((dev.host, dev.name), [])
        job = jobs[0] if jobs else None
        beat, step = _heartbeat(layout, job.id) if job else (None, None)
        rows.append(DeviceRow(dev.host, dev.name, dev.state, dev.reason, job, beat, step, jobs=jobs))
    _sampled_usage(rows, store, now, settings.gpu_sample_interval or 2.0)
    if with_gpus:
        _gpu_usage(rows, settings.nvml_timeout)

    recent = store.recent_events(events)
    names = {j.id: j.name for j in store.get_many({e.job_id for e in recent})}
    try:
        progress = [p for p in sessions_api.sessions(settings, store) if p["status"] == "running"
                    or (p.get("updated_at") or 0) > now - 3600]
    except Exception:  # an agent database mid-migration must not take the view down
        progress = []
    return Snapshot(at=now, home=str(settings.home), services=services, devices=rows, queue=queue, victims=victims,
                    running=sorted(holding, key=lambda j: j.id), events=[(e, names.get(e.job_id, "")) for e in recent],
                    sessions=progress, counts=counts, projects=shared, drained=_drained(settings.home))


def _drained(home: Path) -> dict[str, str]:
    """The Slurm nodes this queue's multi-node jobs drained (failed `DRAIN_AFTER` times in a row), with why."""
    from orchestrator.executors.slurm import nodes as slurm_nodes

    return {node: entry["drained"] for node, entry in sorted(slurm_nodes.health(home).items())
            if entry.get("drained")}
