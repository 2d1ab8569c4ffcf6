"""Jobs sharing a GPU, for the scheduling policy (`orchestrator.queue.policy.plan`): each device's room (share
and memory left, what releasing sharers give back), where a sharing job goes (best fit), and the sharers of a
device as one victim candidate. Pure bookkeeping for one pass; the rules are in the policy's docstring.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence

from orchestrator.queue.plantypes import Running, Waiting

SHARE_EPSILON = 1e-9  # float slack when adding shares of a device: four 0.25 (or three 1/3) exactly fill one
MEMORY_SLACK = 1.0  # bytes of float slack when adding shares of a device's memory (share x total)


class Group:
    """The sharers of one partly used device as one victim candidate of one device (see the rules)."""

    __slots__ = ("devices", "members", "priority", "started_at", "id", "scavenger")

    def __init__(self, device: str, members: Sequence[Running]):
        self.devices = (device,)
        self.members = tuple(members)  # those not already releasing, by id
        self.priority = max(m.priority for m in members)
        self.started_at = max(m.started_at for m in members)
        self.id = min(m.id for m in members)
        self.scavenger = all(m.scavenger for m in members)


def demand(share: float, memory: Optional[int], total: Optional[int]) -> float:
    """The memory a sharer holds on a device of `total` bytes: what it asked for, else its share of it."""
    if memory is not None:
        return memory
    return share * total if total is not None else 0.0


class Room:
    """Room for sharing jobs on one device: a partly used device (named), or one a sharing job claimed this
    pass (unnamed). ``memory`` is None when the device's total is unknown; ``back_*`` is what its releasing
    sharers give back; ``end`` is when its sharers end at the latest (inf: unknown)."""

    __slots__ = ("name", "rank", "total", "share", "memory", "back_share", "back_memory", "end")

    def __init__(self, name: Optional[str], rank: int, total: Optional[int]):
        self.name, self.rank, self.total = name, rank, total
        self.share, self.memory = 1.0, (None if total is None else float(total))
        self.back_share, self.back_memory = 0.0, 0.0
        self.end = -math.inf

    def fits(self, job: Waiting, back: bool = False) -> bool:
        share = self.share + (self.back_share if back else 0.0)
        if share + SHARE_EPSILON < job.share:
            return False
        if self.memory is None:
            return True
        memory = self.memory + (self.back_memory if back else 0.0)
        return demand(job.share, job.memory, self.total) <= memory + MEMORY_SLACK

    def take(self, job: Waiting, end: float) -> None:
        """`job` starts here now (`end`: when it ends at the latest)."""
        self.share -= job.share
        if self.memory is not None:
            self.memory -= demand(job.share, job.memory, self.total)
        self.end = max(self.end, end)

    def claim_back(self, job: Waiting) -> None:
        """`job` waits for room here: first what releasing sharers give back, the rest from the room now."""
        given = min(self.back_share, job.share)
        self.back_share -= given
        self.share -= job.share - given
        if self.memory is not None:
            need = demand(job.share, job.memory, self.total)
            given_memory = min(self.back_memory, need)
            self.back_memory -= given_memory
            self.memory -= need - given_memory
        self.end = math.inf  # it starts here later, for as long as it runs: the device frees at no known time


class Packing:
    """Where sharing jobs go in one pass: the partly used devices, the rooms claimed on devices that free up,
    and each partly used device's victim candidate. Empty (and free) when nothing shares a device."""

    def __init__(self, usable: Sequence[str], usable_set: frozenset[str], totals: Mapping[str, int]):
        self.usable, self.usable_set = usable, usable_set
        self.totals = totals
        self.rooms: dict[str, Room] = {}  # partly used devices jobs may start on now
        self.claimed: list[Room] = []  # room left on devices sharing jobs claimed in this pass (not named)
        self.groups: dict[str, Group] = {}  # victim candidate per partly used device
        self._rank: Optional[dict[str, int]] = None

    def rank(self, device: str) -> int:
        if self._rank is None:
            self._rank = {d: i for i, d in enumerate(self.usable)}
        return self._rank[device]

    def load(self, sharers: Sequence[Running], taken: set[str], now: float, preempt_after: float) -> int:
        """Read the running sharers (not on a device in `taken`, held whole); the devices coming (all of
        their sharers releasing)."""
        on: dict[str, list[Running]] = {}
        for job in sharers:
            for device in set(job.devices):
                if device not in taken and device in self.usable_set:
                    on.setdefault(device, []).append(job)
        coming = 0
        for device, members in on.items():
            members.sort(key=lambda m: m.id)  # the same float sums whatever the input order
            live = [m for m in members if not m.releasing]
            if not live:
                coming += 1  # a device frees up once, however many sharers leave it
                continue
            room = Room(device, self.rank(device), self.totals.get(device))
            for m in members:
                room.share -= m.share
                held = demand(m.share, m.memory, room.total)
                if room.memory is not None:
                    room.memory -= held
                if m.releasing:
                    room.back_share += m.share
                    room.back_memory += held
                else:
                    room.end = max(room.end, math.inf if m.ends_at is None else m.ends_at)
            self.rooms[device] = room
            if all(m.preemptible and (m.scavenger or now - m.started_at >= preempt_after) for m in live):
                self.groups[device] = Group(device, live)
        return coming

    def best(self, job: Waiting, ok: Optional[Callable[[Room], bool]] = None, back: bool = False
             ) -> Optional[Room]:
        """The partly used device with the least room that fits `job` (and `ok`), first in preference order
        among equals; with `back`, counting the room releasing sharers give back."""
        best, best_key = None, None
        for room in self.rooms.values():
            if room.fits(job, back) and (ok is None or ok(room)):
                key = (round(room.share + (room.back_share if back else 0.0), 9), room.rank)
                if best_key is None or key < best_key:
                    best, best_key = room, key
        return best

    def open(self, job: Waiting, free: list[str]) -> Optional[Room]:
        """The first free device with the memory `job` asks for, taken out of `free` and now partly used."""
        for i, device in enumerate(free):
            total = self.totals.get(device)
            if job.memory is None or total is None or job.memory <= total:
                del free[i]
                room = self.rooms[device] = Room(device, self.rank(device), total)
                return room
        return None

    def claim(self, job: Waiting) -> Optional[Room]:
        """Room `job` may wait for: given back by releasing sharers, else left on a device claimed this pass."""
        room = self.best(job, ok=lambda r: r.back_share > 0, back=True)
        if room is not None:
            room.claim_back(job)
            return room
        fitting = [r for r in self.claimed if r.fits(job)]
        if not fitting:
            return None
        room = min(fitting, key=lambda r: (round(r.share, 9), r.rank))
        room.take(job, math.inf)
        return room

    def claim_device(self, job: Waiting) -> None:
        """`job` claimed a whole device that frees up: the room it leaves is for the sharing jobs behind. Which
        device is not known, so its memory is the smallest known total (none known: only shares count)."""
        known = [self.totals[d] for d in self.usable if d in self.totals]
        room = Room(None, len(self.claimed), min(known) if known else None)
        room.take(job, math.inf)
        self.claimed.append(room)

    def room_left(self) -> bool:
        return any(room.share > SHARE_EPSILON for room in self.rooms.values())

    def useful(self, job: Waiting, candidates: list) -> list:
        """The candidates whose usable devices include one with the memory `job` asks for."""
        if job.memory is None or not self.totals:
            return candidates
        return [c for c in candidates
                if any(d in self.usable_set and self.totals.get(d, job.memory) >= job.memory for d in c.devices)]
