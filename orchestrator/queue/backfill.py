"""The shadow time of EASY backfill (Slurm's `sched/backfill`, Lifka's EASY): when a blocked job could start.

Pure arithmetic over what the running jobs' time limits promise (`shadow`), and the starts it allows behind a
blocked job without delaying it (`backfill`), for `orchestrator.queue.policy.plan`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

from orchestrator.queue.devshare import Packing
from orchestrator.queue.plantypes import Waiting


def shadow(need: int, available: int, ends: Sequence[tuple[Optional[float], int]]
           ) -> Optional[tuple[float, int]]:
    """When `need` devices will be free at the latest, and how many more than `need` are free then.

    Args:
        need: devices the blocked job needs.
        available: devices free, or already being released, now (fewer than `need`).
        ends: (the time a running job ends at the latest, or None when it has no time limit, its devices).

    Returns:
        (shadow time, surplus devices at it), or None when the time is unknown: the devices needed include
        those of a job without a time limit, so no start behind can be shown not to delay the blocked job.
    """
    total = available
    known = sorted((t, n) for t, n in ends if t is not None)
    for i, (t, n) in enumerate(known):
        total += n
        if total >= need:
            # Jobs ending at the same moment free their devices together.
            total += sum(m for u, m in known[i + 1:] if u == t)
            return t, total - need
    return None  # not enough devices end in known time: the start waits on a job without a limit


def backfill(blocked: Waiting, rest: Iterable[Waiting], ends: list[tuple[Optional[float], int]], free: list[str],
             coming: int, books: Any, now: float, packing: Packing) -> list[tuple[int, tuple[str, ...]]]:
    """EASY backfill behind `blocked`: the starts that cannot delay its start (the policy's rules). `ends`:
    (latest end or None, usable devices) of the running jobs not already being released, and of the partly
    used devices."""
    # A blocked sharing job found no free device with its memory: none of them counts for it.
    at = shadow(blocked.gpus, (len(free) if blocked.share == 1.0 else 0) + coming, ends)
    if at is None:
        return []
    when, surplus = at
    starts = []
    for job in rest:
        if not free and not packing.room_left():
            break
        if job.share == 1.0 and job.gpus > len(free) or not books.may_start(job):
            continue
        ends_first = job.time_limit is not None and now + job.time_limit <= when
        if job.share < 1.0:
            # Room on a device not counted as free by the shadow time costs nothing; else one device of surplus.
            room = packing.best(job, ok=None if ends_first else lambda r: r.end > when)
            if room is None and (ends_first or surplus >= 1):
                room = packing.best(job) or packing.open(job, free)
                if room is not None and not ends_first:
                    surplus -= 1
            if room is None:
                continue
            room.take(job, math.inf if job.time_limit is None else now + job.time_limit)
            starts.append((job.id, (room.name,)))
            books.started(job)
            continue
        if not ends_first:
            if job.gpus > surplus:
                continue
            surplus -= job.gpus
        starts.append((job.id, tuple(free[: job.gpus])))
        del free[: job.gpus]
        books.started(job)
    return starts
