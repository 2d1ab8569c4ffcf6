"""The scheduling policy of the job queue: a pure function from the queue's state to a plan.

`plan` decides which waiting jobs start now (and on which devices) and which running jobs to preempt.
It does no I/O, reads no clock and uses no randomness, so the same inputs always give the same `Plan`;
the service calls it on every dispatch tick and applies the result.

Rules (issue 2, "Scheduling policy"; DESIGN.md, "Semantics worth copying"):

- Line order: priority (higher first), then submit time, then id. A job needing more devices than
  exist here is skipped entirely: it neither starts, reserves nor preempts.
- All or nothing: a job with ``gpus=N`` starts on the first N free devices in preference order, or not
  at all. A device held by any running job is not free, usable or not.
- Reservations (no starvation): a job that cannot start now claims, in line order, the capacity that
  will reach it: first devices that are already being released (jobs PREEMPTING or CANCELLING, and
  victims preempted for jobs ahead of it that free more than those jobs need), then devices of victims
  it preempts itself, and only for the rest does it hold free devices. Jobs behind it may start on the
  free devices left over. Every blocked job that *can* be served this way gets its own reservation, so
  several high-priority jobs can preempt in the same tick without fighting over victims.
- A blocked job that cannot be served even after preempting every eligible victim (it waits on
  non-preemptible, higher-priority or too-young jobs) holds everything that is or will be free, and
  nothing behind it starts or preempts. Without runtime estimates any backfill could delay it forever,
  and any preemption for a job behind it would hand devices to it rather than to the preemptor.
- Preemption: only running jobs of strictly lower priority than the job it is for, preemptible, not
  already releasing, and running for at least ``preempt_after`` seconds. Nothing is preempted when the
  releases under way cover the shortfall. Victims: the fewest; among equally few, the earliest set in
  the order lowest priority, youngest (latest start), id.

Victims keep their devices until they have released them, so a start never uses a victim's devices in
the plan that preempts it; the job it was preempted for starts on a later tick.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Waiting", "Running", "Plan", "plan", "fits", "unplaceable_reason", "UNPLACEABLE"]

UNPLACEABLE = "no live service has"  # how the reason of a job that nothing can place starts


def fits(gpus: int, capacity: int) -> bool:
    """The capacity rule, used by the policy, the service and `submit`: a job needing `gpus` devices can
    ever run on `capacity` devices (all at once: jobs are never split)."""
    return gpus <= capacity


def unplaceable_reason(gpus: int, largest: int) -> str | None:
    """Why no live service can place a job of `gpus` devices when the largest has `largest`; None if one can."""
    if fits(gpus, largest):
        return None
    return f"{UNPLACEABLE} {gpus} devices; largest has {largest}"


@dataclass(frozen=True)
class Waiting:
    """A QUEUED job that may start now (its retry backoff, if any, has elapsed).

    ``submitted_at`` is the original submit time: a preempted job keeps its place in line.
    """

    id: int
    priority: int
    submitted_at: float
    gpus: int

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"job {self.id}: gpus must be at least 1, got {self.gpus}")


@dataclass(frozen=True)
class Running:
    """A job holding devices: STARTING, RUNNING, PREEMPTING or CANCELLING.

    ``started_at`` is when the current attempt started. ``releasing`` marks a job already being
    stopped (PREEMPTING or CANCELLING): its devices free up soon and it cannot be preempted again.
    """

    id: int
    priority: int
    devices: tuple[str, ...]
    started_at: float
    preemptible: bool
    releasing: bool = False


@dataclass(frozen=True)
class Plan:
    """What to do now: jobs to start, as (job id, devices) in start order, and running jobs to preempt, with
    the waiting job each is preempted for (`preempt_for`: (victim id, job id), in `preempt` order)."""

    starts: tuple[tuple[int, tuple[str, ...]], ...] = ()
    preempt: tuple[int, ...] = ()
    # Which job each victim is for: an explanation of `preempt`, so not part of a plan's identity.
    preempt_for: tuple[tuple[int, int], ...] = field(default=(), compare=False)


def _line_key(job: Waiting) -> tuple[int, float, int]:
    return (-job.priority, job.submitted_at, job.id)


def _victim_key(job: Running) -> tuple[int, float, int]:
    # Cheapest to lose first: lowest priority, then youngest (least work lost), then id for determinism.
    return (job.priority, -job.started_at, job.id)


def plan(
    waiting: Sequence[Waiting],
    running: Sequence[Running],
    devices: Sequence[str],
    now: float,
    preempt_after: float,
) -> Plan:
    """Decide which waiting jobs start now and which running jobs to preempt.

    Args:
        waiting: QUEUED jobs eligible to start now, in any order.
        running: every job holding devices, in any order (see `Running`).
        devices: the usable devices (enabled and healthy), in preference order.
        now: the current time, on the same clock as ``started_at``.
        preempt_after: minimum seconds a job must have run before it may be preempted.

    Returns:
        The `Plan`. Starts use only devices that are free now; preempted jobs' devices are counted
        towards the jobs they were preempted for, which start once the victims have released them.
    """
    usable = tuple(dict.fromkeys(devices))  # drop duplicates, keep preference order
    usable_set = frozenset(usable)

    def usable_count(job: Running) -> int:
        # A device outside `devices` (disabled or quarantined) is no use to anyone when it frees up.
        return sum(1 for d in set(job.devices) if d in usable_set)

    held = {d for job in running for d in job.devices}
    free = [d for d in usable if d not in held]
    # Devices that will free up without anyone deciding anything more: unclaimed, counted, not named.
    coming = sum(usable_count(job) for job in running if job.releasing)
    candidates = sorted(
        (
            job
            for job in running
            if job.preemptible
            and not job.releasing
            and now - job.started_at >= preempt_after
            and usable_count(job) > 0
        ),
        key=_victim_key,
    )

    starts: list[tuple[int, tuple[str, ...]]] = []
    preempt: list[int] = []
    preempt_for: list[tuple[int, int]] = []
    for job in sorted(waiting, key=_line_key):
        if not fits(job.gpus, len(usable)):
            continue  # can never run on this host; must not block the line
        if job.gpus <= len(free):
            starts.append((job.id, tuple(free[: job.gpus])))
            del free[: job.gpus]
            continue

        shortfall = job.gpus - len(free) - coming
        if shortfall > 0:
            lower = [c for c in candidates if c.priority < job.priority]
            victims = _choose_victims(lower, [usable_count(c) for c in lower], shortfall)
            if victims is None:
                break  # cannot be served yet: it holds everything that is or will be free
            for victim in victims:
                candidates.remove(victim)
                preempt.append(victim.id)
                preempt_for.append((victim.id, job.id))
                coming += usable_count(victim)

        # Reserve: take what is coming first, so that as many free devices as possible stay usable
        # by the jobs behind; hold free devices only for the rest.
        from_coming = min(coming, job.gpus)
        coming -= from_coming
        del free[: job.gpus - from_coming]

    return Plan(starts=tuple(starts), preempt=tuple(preempt), preempt_for=tuple(preempt_for))


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
