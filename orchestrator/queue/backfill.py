"""The shadow time of EASY backfill (Slurm's `sched/backfill`, Lifka's EASY): when a blocked job could start.

Pure arithmetic over what the running jobs' time limits promise; `orchestrator.queue.policy.plan` uses it to
let jobs start behind a blocked job without delaying it.
"""

from __future__ import annotations

from typing import Optional, Sequence


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
