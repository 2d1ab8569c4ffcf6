"""The scheduling policy of the job queue: a pure function from the queue's state to a plan.

`plan` decides which waiting jobs start now (and on which devices), which running jobs to preempt and which
waiting jobs can no longer meet their deadline. It does no I/O, reads no clock and uses no randomness, so the
same inputs always give the same `Plan`; the service calls it on every dispatch tick and applies the result.

Rules (after Slurm, Kueue and Determined; the policy table in docs/guides/projects.md):

- Line order within a project: priority (higher first), then deadline (earlier first; none last), then submit
  time, then id. A job needing more devices than exist here is skipped entirely: it neither starts, reserves
  nor preempts; so is a sharing job asking more GPU memory than any usable device has (when all are known).
- Between projects (`Project`; with none declared every job is in one default project and the order is the
  line order above): the next job is the head of the project that, with that job, stays within its quota
  (guaranteed devices); among those, and among the projects above their quota, the lowest decayed usage
  (device-seconds) per unit of share; then the head's line order. A start adds its devices x (time limit, or
  ``charge``) to its project's usage for the rest of the pass, so one pass spreads its starts. A job sharing
  a device counts its share: a 0.25 job holds 0.25 devices of its project's quota and adds 0.25 x time.
- Borrowing: a project may run beyond its quota on devices others do not use, up to its ``borrow_limit``
  beyond the quota (None: no cap); a project whose head would exceed the cap takes no more this pass. A
  non-preemptible job never borrows while any project declares a quota: borrowed devices must be reclaimable.
- All or nothing: a job with ``gpus=N`` starts on the first N free devices in preference order, or not
  at all. A device held by any running job is not free, usable or not.
- Sharing a device: a job with ``share`` < 1 (and ``gpus=1``) runs beside others on one device. A device held
  by sharers (running jobs with ``share`` < 1) is partly used: its remaining share is 1 minus their shares,
  its remaining memory (when ``device_memory`` names its total) the total minus the memory they asked (a
  sharer that asked none counts its share of the total). A sharing job starts on the partly used device with
  the least remaining share that still fits its share and memory (ties: preference order), else on the first
  free device that has the memory, which is then partly used for the rest of the pass so the next sharing
  jobs pack onto it. Neither share (within a float epsilon: four 0.25 fill a device) nor memory is ever
  over-committed. A whole-device job never gets a partly used device. A device whose sharers are all
  releasing is coming (freeing up), once; one with only some of them releasing is not free, and the room
  they give back may be reserved by a sharing job that waits for it. GPU memory only matters for sharing
  jobs: a whole-device job has the whole device.
- Reservations (no starvation): a job that cannot start now claims, in order, the capacity that will reach
  it: first devices that are already being released (jobs PREEMPTING or CANCELLING, and victims preempted
  for jobs ahead of it that free more than those jobs need), then devices of victims it preempts itself, and
  only for the rest does it hold free devices. Jobs behind it may start on the free devices left over. A
  sharing job that cannot start claims, in order, room that releasing sharers give back on a partly used
  device, room left on a device a sharing job ahead of it claimed this pass, and else one whole device like
  a one-device job (so several sharing jobs behind each other claim, and preempt for, one device together).
  It preempts only on devices with the memory it asks for; devices already being released are counted, not
  named, so their memory is not checked (nor, for the room on a claimed device, more than the smallest total).
- A blocked job that cannot be served even after preempting every eligible victim holds everything that is or
  will be free, and nothing behind it starts or preempts, except by EASY backfill: with the running jobs'
  time limits known, the blocked job's start time (the shadow time) is when enough of them will have ended;
  a job behind it may start on free devices if its time limit ends by then, or if it needs no more than the
  devices left over at that time (each such start uses up that surplus). Without a time limit on every job it
  waits on, nothing is backfilled: the start could be delayed forever. A partly used device frees up when
  the last of its sharers ends; a sharing job may backfill onto it without using any surplus when it ends by
  the shadow time or when the device is not counted as free by then, else it uses one device of surplus (as
  on a free device). A blocked sharing job counts as needing one whole device (conservative: room on a
  partly used device may reach it earlier).
- Preemption: only running jobs that are preemptible, not already releasing, and running for at least
  ``preempt_after`` seconds, and that are either of strictly lower priority in the same project, or (reclaim)
  of a project above its quota when the job is within its own quota, whatever their priority. Scavenger jobs
  are victims of any job, before any other, at once (no ``preempt_after``). Nothing is preempted when the
  releases under way cover the shortfall. Victims: scavengers first; then the fewest; among equally few, the
  earliest set in the order reclaimable borrowers first, lowest priority, youngest (latest start), id. The
  sharers of one device are victims together, as one candidate of one device: eligible only when every one
  of them not already releasing is; a scavenger candidate when all are scavengers, a borrower one when all
  the others are borrowers; ordered by their highest priority, their latest start, their lowest id. Once
  chosen, each of them is preempted. A device someone starts on (or claims room on) in this pass is no
  victim in it.
- Scavengers start last, only on free devices (or room on partly used ones) no other waiting job could use in
  this pass (nothing blocked, nothing reserved), and count towards no project's quota or usage.
- Deadlines: a waiting job whose deadline is before now plus its time limit (now, without one) is not started:
  it is listed in ``Plan.expired`` (the service ends it with the reason ``deadline``).

Victims keep their devices until they have released them, so a start never uses a victim's devices in
the plan that preempts it; the job it was preempted for starts on a later tick.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Mapping, Optional, Sequence, Union

from orchestrator.queue.backfill import backfill as easy_backfill
from orchestrator.queue.devshare import SHARE_EPSILON, Group, Packing, Room
from orchestrator.queue.plantypes import DEFAULT_PROJECT, Plan, Project, Running, Waiting
from orchestrator.queue.victims import victim_key, victims_for
from orchestrator.queue.victims import why as why_

__all__ = ["Waiting", "Running", "Project", "Plan", "plan", "fits", "unplaceable_reason", "misses_deadline",
           "UNPLACEABLE", "DEFAULT_PROJECT", "DEADLINE", "SHARE_EPSILON"]

UNPLACEABLE = "no live service has"  # how the reason of a job that nothing can place starts
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


def _line_key(job: Waiting) -> tuple[int, float, float, int]:
    return (-job.priority, math.inf if job.deadline is None else job.deadline, job.submitted_at, job.id)


def _plain_key(job: Waiting) -> tuple[int, float, int]:
    return (-job.priority, job.submitted_at, job.id)  # `_line_key` when no job has a deadline: the same order


class _Books:
    """What one pass knows of each project: devices held (usable or elsewhere; shares count as fractions),
    usage, quota, share, cap."""

    def __init__(self, projects: Mapping[str, Project]):
        self.projects = dict(projects)
        self.held: dict[str, float] = {name: p.held_elsewhere for name, p in self.projects.items()}
        self.usage: dict[str, float] = {name: p.usage for name, p in self.projects.items()}
        self.quotas = any(p.quota for p in self.projects.values())

    def project(self, name: str) -> Project:
        if name not in self.projects:
            self.projects[name] = Project(name)
            self.held[name], self.usage[name] = 0, 0.0
        return self.projects[name]

    def within_quota(self, name: str, gpus: float) -> bool:
        return self.held[name] + gpus <= self.project(name).quota

    def borrowing(self, name: str) -> bool:
        return self.held[name] > self.project(name).quota

    def may_start(self, job: Waiting) -> bool:
        """The borrowing rules: the cap, and no non-preemptible borrower while quotas exist."""
        p = self.project(job.project)
        over = self.held[job.project] + job.gpus * job.share - p.quota
        if over <= 0:
            return True
        if p.borrow_limit is not None and over > p.borrow_limit:
            return False
        return not (self.quotas and not job.preemptible)

    def order(self, name: str, head: Waiting) -> tuple:
        p = self.project(name)
        return (0 if self.within_quota(name, head.gpus * head.share) else 1, self.usage[name] / p.share,
                _line_key(head), name)

    def started(self, job: Waiting) -> None:
        self.held[job.project] += job.gpus * job.share
        self.usage[job.project] += job.gpus * job.share * (job.time_limit or CHARGE)


def plan(
    waiting: Sequence[Waiting],
    running: Sequence[Running],
    devices: Sequence[str],
    now: float,
    preempt_after: float,
    projects: Sequence[Project] = (),
    backfill: bool = True,
    device_memory: Mapping[str, int] = {},  # noqa: B006 (read only)
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
        device_memory: each device's total GPU memory in bytes; on a device not listed only shares count.

    Returns:
        The `Plan`. Starts use only devices that are free now (or room on partly used ones); preempted
        jobs' devices are counted towards the jobs they were preempted for, which start once the victims
        have released them.
    """
    usable = tuple(dict.fromkeys(devices))  # drop duplicates, keep preference order
    usable_set = frozenset(usable)

    def usable_count(job: Union[Running, Group]) -> int:
        # A device outside `devices` (disabled or quarantined) is no use to anyone when it frees up.
        return sum(1 for d in set(job.devices) if d in usable_set)

    books = _Books({p.name: p for p in projects})
    for job in running:
        books.project(job.project)
        if not job.scavenger:
            books.held[job.project] += usable_count(job) * job.share
    held = {d for job in running for d in job.devices}
    free = [d for d in usable if d not in held]
    totals = {d: device_memory[d] for d in usable if device_memory.get(d) is not None} if device_memory else {}
    packing = Packing(usable, usable_set, totals)
    sharers = [job for job in running if job.share < 1.0]
    # Devices that will free up without anyone deciding anything more: unclaimed, counted, not named.
    coming = sum(usable_count(job) for job in running if job.releasing and job.share == 1.0)
    candidates: list[Union[Running, Group]] = [
        job for job in running if job.preemptible and not job.releasing and job.share == 1.0
        and usable_count(job) > 0 and (job.scavenger or now - job.started_at >= preempt_after)]
    if sharers:
        coming += packing.load(sharers, {d for job in running if job.share == 1.0 for d in job.devices}, now,
                               preempt_after)
        candidates += packing.groups.values()
    candidates.sort(key=victim_key)

    def settle(room: Room) -> None:
        # Someone starts on (or waits for room on) this device in this pass: its sharers are no victims in it.
        group = packing.groups.pop(room.name, None) if room.name is not None else None
        if group is not None and group in candidates:
            candidates.remove(group)

    expired = tuple(sorted(job.id for job in waiting
                           if job.deadline is not None and misses_deadline(job.deadline, job.time_limit, now)))
    gone = set(expired)
    capacity = len(usable)
    # The most memory a sharing job may ask for here (inf: some device's total is unknown).
    largest = max((totals.get(d, math.inf) for d in usable), default=0) if totals else math.inf
    # Jobs that can never run on this host (the capacity rule, `fits`, inline) or cannot be started must not
    # block the line. Grouped in one loop, then each project's line sorted (cheaper than sorting them all).
    lines: dict[str, list[Waiting]] = {}
    scavengers: list[Waiting] = []
    dated = False
    for job in waiting:
        if job.gpus > capacity or (gone and job.id in gone) or (job.memory is not None and job.share < 1.0
                                                               and job.memory > largest):
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
        if job.share < 1.0:
            room = packing.best(job) or packing.open(job, free)
            if room is not None:
                settle(room)
                room.take(job, math.inf if job.time_limit is None else now + job.time_limit)
                starts.append((job.id, (room.name,)))
                books.started(job)
                continue
            room = packing.claim(job)
            if room is not None:
                settle(room)
                books.held[job.project] += job.share  # reserved: counts against its quota from now on
                continue
            have = 0  # no free device has its memory: it needs one freed, like a one-device job
        elif job.gpus <= len(free):
            starts.append((job.id, tuple(free[: job.gpus])))
            del free[: job.gpus]
            books.started(job)
            continue
        else:
            have = len(free)
        shortfall = job.gpus - have - coming
        victims: Optional[list[Union[Running, Group]]] = []
        if shortfall > 0:
            pool = candidates if job.share == 1.0 else packing.useful(job, candidates)
            victims = victims_for(job, pool, books, usable_count, shortfall)
        if victims is None:
            blocked = job  # cannot be served yet: it holds everything that is or will be free
            break
        for victim in victims:
            candidates.remove(victim)
            members = victim.members if isinstance(victim, Group) else (victim,)
            for member in members:
                preempt.append(member.id)
                preempt_for.append((member.id, job.id))
                why.append(why_(member, job))
                if not member.scavenger:
                    books.held[member.project] -= usable_count(member) * member.share
            coming += usable_count(victim)
            if isinstance(victim, Group):
                del packing.rooms[victim.devices[0]]  # it frees up: no room to start on in this pass
                packing.groups.pop(victim.devices[0], None)
        # Reserve: take what is coming first, so that as many free devices as possible stay usable
        # by the jobs behind; hold free devices only for the rest.
        from_coming = min(coming, job.gpus)
        coming -= from_coming
        del free[: job.gpus - from_coming]
        books.held[job.project] += job.gpus * job.share  # reserved: counts against its quota from now on
        if job.share < 1.0:
            packing.claim_device(job)

    if blocked is not None:
        if backfill:
            # The jobs behind, in line order across projects, read lazily: most passes stop at the first few.
            rest = heapq.merge(*(itertools.islice(line, pos[name], None) for name, line in lines.items()),
                               key=_line_key)
            gone_now = set(preempt)
            ends = [(job.ends_at, usable_count(job)) for job in running
                    if not job.releasing and job.share == 1.0 and job.id not in gone_now and usable_count(job)]
            # A partly used device frees up when the last of its sharers ends.
            ends += [(None if room.end == math.inf else room.end, 1) for room in packing.rooms.values()]
            starts += easy_backfill(blocked, rest, ends, free, coming, books, now, packing)
    else:
        for job in scavengers:
            if job.share < 1.0:
                room = packing.best(job) or packing.open(job, free)
                if room is not None:
                    room.take(job, math.inf if job.time_limit is None else now + job.time_limit)
                    starts.append((job.id, (room.name,)))
            elif job.gpus <= len(free):
                starts.append((job.id, tuple(free[: job.gpus])))
                del free[: job.gpus]
    return Plan(starts=tuple(starts), preempt=tuple(preempt), expired=expired, why=tuple(why),
                preempt_for=tuple(preempt_for))
