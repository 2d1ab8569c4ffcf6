"""The scheduling policy as it was before jobs could share a GPU (the feature "Fill the GPU"): the oracle
that whole-device jobs plan exactly as before, with projects, quotas, scavengers, deadlines and backfill.
Frozen: never edit it to make a test pass.

`plan` decides which waiting jobs start now (and on which devices), which running jobs to preempt and which
waiting jobs can no longer meet their deadline. It does no I/O, reads no clock and uses no randomness, so the
same inputs always give the same `Plan`; the service calls it on every dispatch tick and applies the result.

Rules (after Slurm, Kueue and Determined; the policy table in docs/guides/projects.md):

- Line order within a project: priority (higher first), then deadline (earlier first; none last), then submit
  time, then id. A job needing more devices than exist here is skipped entirely: it neither starts, reserves
  nor preempts.
- Between projects (`Project`; with none declared every job is in one default project and the order is the
  line order above): the next job is the head of the project that, with that job, stays within its quota
  (guaranteed devices); among those, and among the projects above their quota, the lowest decayed usage
  (device-seconds) per unit of share; then the head's line order. A start adds its devices x (time limit, or
  ``charge``) to its project's usage for the rest of the pass, so one pass spreads its starts.
- Borrowing: a project may run beyond its quota on devices others do not use, up to its ``borrow_limit``
  beyond the quota (None: no cap); a project whose head would exceed the cap takes no more this pass. A
  non-preemptible job never borrows while any project declares a quota: borrowed devices must be reclaimable.
- All or nothing: a job with ``gpus=N`` starts on the first N free devices in preference order, or not
  at all. A device held by any running job is not free, usable or not.
- Reservations (no starvation): a job that cannot start now claims, in order, the capacity that will reach
  it: first devices that are already being released (jobs PREEMPTING or CANCELLING, and victims preempted
  for jobs ahead of it that free more than those jobs need), then devices of victims it preempts itself, and
  only for the rest does it hold free devices. Jobs behind it may start on the free devices left over.
- A blocked job that cannot be served even after preempting every eligible victim holds everything that is or
  will be free, and nothing behind it starts or preempts, except by EASY backfill: with the running jobs'
  time limits known, the blocked job's start time (the shadow time) is when enough of them will have ended;
  a job behind it may start on free devices if its time limit ends by then, or if it needs no more than the
  devices left over at that time (each such start uses up that surplus). Without a time limit on every job it
  waits on, nothing is backfilled: the start could be delayed forever.
- Preemption: only running jobs that are preemptible, not already releasing, and running for at least
  ``preempt_after`` seconds, and that are either of strictly lower priority in the same project, or (reclaim)
  of a project above its quota when the job is within its own quota, whatever their priority. Scavenger jobs
  are victims of any job, before any other, at once (no ``preempt_after``). Nothing is preempted when the
  releases under way cover the shortfall. Victims: scavengers first; then the fewest; among equally few, the
  earliest set in the order reclaimable borrowers first, lowest priority, youngest (latest start), id.
- Scavengers start last, only on free devices no other waiting job could use in this pass (nothing blocked,
  nothing reserved), and count towards no project's quota or usage.
- Deadlines: a waiting job whose deadline is before now plus its time limit (now, without one) is not started:
  it is listed in ``Plan.expired`` (the service ends it with the reason ``deadline``).

Victims keep their devices until they have released them, so a start never uses a victim's devices in
the plan that preempts it; the job it was preempted for starts on a later tick.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from orchestrator.queue.backfill import shadow
from orchestrator.queue.states import JobState

_RELEASING = (JobState.PREEMPTING.value, JobState.CANCELLING.value)  # being stopped: devices free soon

__all__ = ["Waiting", "Running", "Project", "Plan", "plan", "fits", "unplaceable_reason", "misses_deadline",
           "UNPLACEABLE", "DEFAULT_PROJECT", "DEADLINE"]

UNPLACEABLE = "no live service has"  # how the reason of a job that nothing can place starts
DEFAULT_PROJECT = "default"  # the project of a job submitted without one
DEADLINE = "deadline"  # the reason of a job ended because it can no longer meet its deadline
CHARGE = 3600.0  # seconds of use a start without a time limit adds to its project's usage within one pass


def fits(gpus: int, capacity: int) -> bool:
    """The capacity rule, used by the policy, the service and `submit`: a job needing `gpus` devices can
    ever run on `capacity` devices (all at once: jobs are never split)."""
    return gpus <= capacity


def unplaceable_reason(gpus: int, largest: int) -> str | None:
    """Why no live service can place a job of `gpus` devices when the largest has `largest`; None if one can."""
    if fits(gpus, largest):
        return None
    return f"{UNPLACEABLE} {gpus} devices; largest has {largest}"


def misses_deadline(deadline: Optional[float], time_limit: Optional[float], now: float) -> bool:
    """Whether a job not yet started can no longer finish by `deadline` (it would run until now + its time
    limit; without a time limit, only a deadline already past is missed)."""
    return deadline is not None and now + (time_limit or 0.0) > deadline


@dataclass(frozen=True)
class Waiting:
    """A QUEUED job that may start now (its retry backoff, if any, has elapsed).

    ``submitted_at`` is the original submit time: a preempted job keeps its place in line. ``time_limit``
    (seconds) lets it backfill; ``deadline`` (a time) expires it; a ``scavenger`` uses only idle devices.
    """

    id: int
    priority: int
    submitted_at: float
    gpus: int
    project: str = DEFAULT_PROJECT
    scavenger: bool = False
    deadline: Optional[float] = None
    time_limit: Optional[float] = None
    preemptible: bool = True

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"job {self.id}: gpus must be at least 1, got {self.gpus}")

    @classmethod
    def of(cls, job: Any) -> "Waiting":
        """The policy's view of a QUEUED job (a `Job`, a listing row or a dispatch pass's light row): the one
        adapter the service and `top` both plan with."""
        return cls(job.id, job.priority, job.submitted_at, job.gpus, job.project or DEFAULT_PROJECT,
                   bool(job.scavenger), job.deadline, job.time_limit, bool(job.preemptible))


@dataclass(frozen=True)
class Running:
    """A job holding devices: STARTING, RUNNING, PREEMPTING or CANCELLING.

    ``started_at`` is when the current attempt started. ``releasing`` marks a job already being
    stopped (PREEMPTING or CANCELLING): its devices free up soon and it cannot be preempted again.
    ``ends_at``: when its time limit stops it at the latest (None: unknown).
    """

    id: int
    priority: int
    devices: tuple[str, ...]
    started_at: float
    preemptible: bool
    releasing: bool = False
    project: str = DEFAULT_PROJECT
    scavenger: bool = False
    ends_at: Optional[float] = None

    @classmethod
    def of(cls, job: Any, now: float) -> "Running":
        """The policy's view of a job holding devices (a `Job`, a listing row or a pass's `Held` row): the one
        adapter the service and `top` both plan with. A scavenger is always preemptible."""
        started = job.started_at or now
        return cls(job.id, job.priority, tuple(job.devices or ()), started,
                   bool(job.preemptible) or bool(job.scavenger), job.state in _RELEASING,
                   job.project or DEFAULT_PROJECT, bool(job.scavenger),
                   started + job.time_limit if job.time_limit else None)


@dataclass(frozen=True)
class Project:
    """A project sharing the devices: its weight in fair sharing, its guaranteed devices, its borrowing cap,
    its decayed usage (device-seconds) and the devices its jobs hold on other hosts of a shared queue."""

    name: str
    share: float = 1.0
    quota: int = 0
    borrow_limit: Optional[int] = None
    usage: float = 0.0
    held_elsewhere: int = 0

    def __post_init__(self) -> None:
        if not self.share > 0:
            raise ValueError(f"project {self.name}: share must be more than 0, got {self.share}")
        if self.quota < 0 or (self.borrow_limit is not None and self.borrow_limit < 0):
            raise ValueError(f"project {self.name}: quota and borrow limit must be at least 0")


@dataclass(frozen=True)
class Plan:
    """What to do now: jobs to start, as (job id, devices) in start order, running jobs to preempt, with the
    waiting job each is preempted for (`preempt_for`: (victim id, job id), in `preempt` order), and waiting
    jobs that can no longer meet their deadline."""

    starts: tuple[tuple[int, tuple[str, ...]], ...] = ()
    preempt: tuple[int, ...] = ()
    expired: tuple[int, ...] = ()
    # Explanations of `preempt`, so not part of a plan's identity: per victim, why ("priority", "reclaim": its
    # project borrows, or "scavenger"), and which waiting job it yields to.
    why: tuple[str, ...] = field(default=(), compare=False)
    preempt_for: tuple[tuple[int, int], ...] = field(default=(), compare=False)


def _line_key(job: Waiting) -> tuple[int, float, float, int]:
    return (-job.priority, math.inf if job.deadline is None else job.deadline, job.submitted_at, job.id)


def _plain_key(job: Waiting) -> tuple[int, float, int]:
    return (-job.priority, job.submitted_at, job.id)  # `_line_key` when no job has a deadline: the same order


def _victim_key(job: Running) -> tuple[int, float, int]:
    # Cheapest to lose first: lowest priority, then youngest (least work lost), then id for determinism.
    return (job.priority, -job.started_at, job.id)


class _Books:
    """What one pass knows of each project: devices held (usable or elsewhere), usage, quota, share, cap."""

    def __init__(self, projects: Mapping[str, Project]):
        self.projects = dict(projects)
        self.held: dict[str, int] = {name: p.held_elsewhere for name, p in self.projects.items()}
        self.usage: dict[str, float] = {name: p.usage for name, p in self.projects.items()}
        self.quotas = any(p.quota for p in self.projects.values())

    def project(self, name: str) -> Project:
        if name not in self.projects:
            self.projects[name] = Project(name)
            self.held[name], self.usage[name] = 0, 0.0
        return self.projects[name]

    def within_quota(self, name: str, gpus: int) -> bool:
        return self.held[name] + gpus <= self.project(name).quota

    def borrowing(self, name: str) -> bool:
        return self.held[name] > self.project(name).quota

    def may_start(self, job: Waiting) -> bool:
        """The borrowing rules: the cap, and no non-preemptible borrower while quotas exist."""
        p = self.project(job.project)
        over = self.held[job.project] + job.gpus - p.quota
        if over <= 0:
            return True
        if p.borrow_limit is not None and over > p.borrow_limit:
            return False
        return not (self.quotas and not job.preemptible)

    def order(self, name: str, head: Waiting) -> tuple:
        p = self.project(name)
        return (0 if self.within_quota(name, head.gpus) else 1, self.usage[name] / p.share, _line_key(head), name)

    def started(self, job: Waiting) -> None:
        self.held[job.project] += job.gpus
        self.usage[job.project] += job.gpus * (job.time_limit or CHARGE)


def plan(
    waiting: Sequence[Waiting],
    running: Sequence[Running],
    devices: Sequence[str],
    now: float,
    preempt_after: float,
    projects: Sequence[Project] = (),
    backfill: bool = True,
) -> Plan:
    """Decide which waiting jobs start now, which running jobs to preempt and which waiting jobs expire.

    Args:
        waiting: QUEUED jobs eligible to start now, in any order.
        running: every job holding devices, in any order (see `Running`).
        devices: the usable devices (enabled and healthy), in preference order.
        now: the current time, on the same clock as ``started_at``.
        preempt_after: minimum seconds a job must have run before it may be preempted.
        projects: the declared projects (a job of a project not listed is in one of share 1, no quota).
        backfill: whether jobs may start behind a blocked job by EASY backfill.

    Returns:
        The `Plan`. Starts use only devices that are free now; preempted jobs' devices are counted
        towards the jobs they were preempted for, which start once the victims have released them.
    """
    usable = tuple(dict.fromkeys(devices))  # drop duplicates, keep preference order
    usable_set = frozenset(usable)

    def usable_count(job: Running) -> int:
        # A device outside `devices` (disabled or quarantined) is no use to anyone when it frees up.
        return sum(1 for d in set(job.devices) if d in usable_set)

    books = _Books({p.name: p for p in projects})
    for job in running:
        books.project(job.project)
        if not job.scavenger:
            books.held[job.project] += usable_count(job)
    held = {d for job in running for d in job.devices}
    free = [d for d in usable if d not in held]
    # Devices that will free up without anyone deciding anything more: unclaimed, counted, not named.
    coming = sum(usable_count(job) for job in running if job.releasing)
    candidates = sorted((job for job in running if job.preemptible and not job.releasing and usable_count(job) > 0
                         and (job.scavenger or now - job.started_at >= preempt_after)), key=_victim_key)

    expired = tuple(sorted(job.id for job in waiting
                           if job.deadline is not None and misses_deadline(job.deadline, job.time_limit, now)))
    gone = set(expired)
    capacity = len(usable)
    # Jobs that can never run on this host (the capacity rule, `fits`, inline) or cannot be started must not
    # block the line. Grouped in one loop, then each project's line sorted (cheaper than sorting them all).
    lines: dict[str, list[Waiting]] = {}
    scavengers: list[Waiting] = []
    dated = False
    for job in waiting:
        if job.gpus > capacity or (gone and job.id in gone):
            continue
        if job.deadline is not None:
            dated = True
        if job.scavenger:
            scavengers.append(job)
        elif job.project in lines:
            lines[job.project].append(job)
        else:
            lines[job.project] = [job]
    key = _line_key if dated else _plain_key
    for line in lines.values():
        line.sort(key=key)
    scavengers.sort(key=key)
    pos = dict.fromkeys(lines, 0)  # each project's next job in its line
    starts: list[tuple[int, tuple[str, ...]]] = []
    preempt: list[int] = []
    why: list[str] = []
    preempt_for: list[tuple[int, int]] = []
    blocked: Optional[Waiting] = None
    while True:
        # The next job: the head of the project that goes first now (few projects: a scan beats a heap whose
        # keys go stale as victims' projects give devices back).
        ready = [(books.order(name, line[pos[name]]), name) for name, line in lines.items() if pos[name] < len(line)]
        if not ready:
            break
        name = min(ready)[1]
        job = lines[name][pos[name]]
        pos[name] += 1
        if not books.may_start(job):
            pos[name] = len(lines[name])  # its project takes no more this pass (the borrowing rules)
            continue
        if job.gpus <= len(free):
            starts.append((job.id, tuple(free[: job.gpus])))
            del free[: job.gpus]
            books.started(job)
            continue
        shortfall = job.gpus - len(free) - coming
        victims: Optional[list[Running]] = []
        if shortfall > 0:
            victims = _victims_for(job, candidates, books, usable_count, shortfall)
        if victims is None:
            blocked = job  # cannot be served yet: it holds everything that is or will be free
            break
        for victim in victims:
            candidates.remove(victim)
            preempt.append(victim.id)
            preempt_for.append((victim.id, job.id))
            why.append("scavenger" if victim.scavenger else "reclaim" if victim.project != job.project
                       else "priority")
            coming += usable_count(victim)
            if not victim.scavenger:
                books.held[victim.project] -= usable_count(victim)
        # Reserve: take what is coming first, so that as many free devices as possible stay usable
        # by the jobs behind; hold free devices only for the rest.
        from_coming = min(coming, job.gpus)
        coming -= from_coming
        del free[: job.gpus - from_coming]
        books.held[job.project] += job.gpus  # reserved: counts against its quota from now on

    if blocked is not None:
        if backfill:
            # The jobs behind, in line order across projects, read lazily: most passes stop at the first few.
            rest = heapq.merge(*(itertools.islice(line, pos[name], None) for name, line in lines.items()),
                               key=_line_key)
            gone_now = set(preempt)
            ends = [(job.ends_at, usable_count(job)) for job in running
                    if not job.releasing and job.id not in gone_now and usable_count(job)]
            starts += _backfill(blocked, rest, ends, free, coming, books, now)
    else:
        for job in scavengers:
            if job.gpus <= len(free):
                starts.append((job.id, tuple(free[: job.gpus])))
                del free[: job.gpus]
    return Plan(starts=tuple(starts), preempt=tuple(preempt), expired=expired, why=tuple(why),
                preempt_for=tuple(preempt_for))


def _victims_for(job: Waiting, candidates: list[Running], books: _Books, usable_count, shortfall: int
                 ) -> Optional[list[Running]]:
    """The victims to preempt for `job` (None: it cannot be served): scavengers first, then the fewest of the
    reclaimable borrowers (when `job` is within its quota) and the lower-priority jobs of its own project."""
    scav = [c for c in candidates if c.scavenger]
    if sum(usable_count(c) for c in scav) >= shortfall:
        return _choose_victims(scav, [usable_count(c) for c in scav], shortfall)
    reclaim = books.quotas and books.within_quota(job.project, job.gpus)
    borrowers = [c for c in candidates if reclaim and not c.scavenger and c.project != job.project
                 and books.borrowing(c.project)]
    lower = [c for c in candidates if not c.scavenger and c.project == job.project and c.priority < job.priority]
    others = borrowers + lower
    rest = _choose_victims(others, [usable_count(c) for c in others],
                           shortfall - sum(usable_count(c) for c in scav))
    return None if rest is None else scav + rest


def _backfill(blocked: Waiting, rest: Iterable[Waiting], ends: list[tuple[Optional[float], int]], free: list[str],
              coming: int, books: _Books, now: float) -> list[tuple[int, tuple[str, ...]]]:
    """EASY backfill behind `blocked`: the starts on `free` that cannot delay its start (the module's rules).
    `ends`: (latest end or None, usable devices) of the running jobs not already being released."""
    at = shadow(blocked.gpus, len(free) + coming, ends)
    if at is None:
        return []
    when, surplus = at
    starts = []
    for job in rest:
        if not free:
            break
        if job.gpus > len(free) or not books.may_start(job):
            continue
        ends_first = job.time_limit is not None and now + job.time_limit <= when
        if not ends_first:
            if job.gpus > surplus:
                continue
            surplus -= job.gpus
        starts.append((job.id, tuple(free[: job.gpus])))
        del free[: job.gpus]
        books.started(job)
    return starts


def _choose_victims(
    candidates: Sequence[Running], sizes: Sequence[int], shortfall: int
) -> list[Running] | None:
    """Pick the fewest candidates whose sizes add up to at least ``shortfall``, or None if none do.

    ``candidates`` are in preference order (cheapest to lose first), ``sizes`` their usable device
    counts. Among the sets of minimal size, this returns the lexicographically earliest in preference
    order: walk the candidates and take each one unless doing so would make the shortfall unreachable
    with the slots left. That is exact (skipping a candidate only happens when taking it cannot lead to
    a solution) and quadratic, instead of enumerating combinations.
    """
    by_size = sorted(sizes, reverse=True)
    total, count = 0, 0
    for size in by_size:
        if total >= shortfall:
            break
        total += size
        count += 1
    if total < shortfall:
        return None

    chosen: list[Running] = []
    need, slots = shortfall, count
    for i, candidate in enumerate(candidates):
        if slots == 0:
            break
        best_rest = sum(sorted(sizes[i + 1 :], reverse=True)[: slots - 1])
        if sizes[i] + best_rest >= need:
            chosen.append(candidate)
            need -= sizes[i]
            slots -= 1
    return chosen
