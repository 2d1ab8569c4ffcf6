"""Preemption victims for the scheduling policy (`orchestrator.queue.policy.plan`): which running jobs (or the
sharers of one device, together) a waiting job may preempt, and the fewest, cheapest to lose, that cover its
shortfall. The rules are in the policy's docstring.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from orchestrator.queue.devshare import Group

from orchestrator.queue.plantypes import Running, Waiting


def victim_key(job: Union[Running, "Group"]) -> tuple[int, float, int]:
    # Cheapest to lose first: lowest priority, then youngest (least work lost), then id for determinism.
    return (job.priority, -job.started_at, job.id)


def why(victim: Running, job: Waiting) -> str:
    return "scavenger" if victim.scavenger else "reclaim" if victim.project != job.project else "priority"


def _kind(c: Union[Running, Group], job: Waiting, reclaim: bool, books: Any) -> int:
    """What a candidate that is no scavenger is to `job`: 1 a reclaimable borrower, 2 a lower-priority job of
    its project, 0 no victim of it. The sharers of a device: 0 if any is none, 1 if all the non-scavengers
    among them are borrowers, else 2."""
    if isinstance(c, Group):
        kinds = {_kind(m, job, reclaim, books) for m in c.members if not m.scavenger}
        return 0 if 0 in kinds else max(kinds)
    if c.project == job.project:
        return 2 if c.priority < job.priority else 0
    return 1 if reclaim and books.borrowing(c.project) else 0


def victims_for(job: Waiting, candidates: list, books: Any, usable_count, shortfall: int
                 ) -> Optional[list]:
    """The victims to preempt for `job` (None: it cannot be served): scavengers first, then the fewest of the
    reclaimable borrowers (when `job` is within its quota) and the lower-priority jobs of its own project."""
    scav = [c for c in candidates if c.scavenger]
    if sum(usable_count(c) for c in scav) >= shortfall:
        return choose_victims(scav, [usable_count(c) for c in scav], shortfall)
    reclaim = books.quotas and books.within_quota(job.project, job.gpus * job.share)
    kinds = [(c, _kind(c, job, reclaim, books)) for c in candidates if not c.scavenger]
    others = [c for c, kind in kinds if kind == 1] + [c for c, kind in kinds if kind == 2]
    rest = choose_victims(others, [usable_count(c) for c in others],
                           shortfall - sum(usable_count(c) for c in scav))
    return None if rest is None else scav + rest


def choose_victims(
    candidates: Sequence[Any], sizes: Sequence[int], shortfall: int
) -> list[Any] | None:
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
