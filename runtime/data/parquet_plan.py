"""Where every row of a Parquet epoch goes: pure functions of (row-group sizes, seed, epoch, rank, world,
workers), property-tested, used by runtime.data.parquet.ParquetDataset.

The unit of reading is a row group. An epoch's global row sequence is the row groups in an order fixed by
(seed, epoch), concatenated. Rank r takes the contiguous slab [r*n, (r+1)*n) of that sequence, n rows per
rank, so a rank reads whole row groups except at most two that it shares with its neighbours. Every rank
gets exactly n rows: by default n = ceil(N/W) and the sequence is padded by wrapping around to its start
(up to W-1 rows seen twice per epoch, as with torch's DistributedSampler); with drop_last n = N // W and the
last N mod W rows of the order are skipped (a different few each epoch).

A rank's slab is cut into shuffle windows of `window` rows (a multiple of the batch size), each permuted
by (seed, epoch, rank, window index): the in-buffer shuffle. Batch i is rows [i*B, (i+1)*B) of the
permuted slab, so its content never depends on how many DataLoader workers there are. The batches still
to deliver are split into one contiguous run per worker (each worker reads neighbouring row groups); the
loader collects one batch from each worker in turn, so the delivery order is a round-robin interleave of
those runs, and `consumed_after` says exactly which batches k deliveries covered.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np


def unit_order(num_units: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order of row groups for one epoch; identical on every rank and worker."""
    order = list(range(num_units))
    if shuffle:
        random.Random(f"parquet:{seed}:{epoch}").shuffle(order)  # str seeds hash stably across runs
    return order


def rows_per_rank(total_rows: int, world: int, drop_last: bool = False) -> int:
    """Rows each rank gets in a full epoch."""
    return total_rows // world if drop_last else math.ceil(total_rows / world)


def split_runs(items: list[int], workers: int) -> list[list[int]]:
    """`items` cut into `workers` contiguous runs whose lengths differ by at most one (longer runs first)."""
    q, rem = divmod(len(items), workers)
    out, at = [], 0
    for w in range(workers):
        size = q + (w < rem)
        out.append(items[at:at + size])
        at += size
    return out


def pass_runs(num_batches: int, consumed: set[int], workers: int) -> list[list[int]]:
    """What each worker delivers in a pass that starts after `consumed`: the epoch's batches split into
    `workers` runs, less what is consumed, rotated so that the run whose turn it was comes first. Resumed
    with the worker count it was saved with, the pass continues the interrupted delivery order exactly;
    with another count it still delivers exactly the unconsumed batches."""
    runs = split_runs(list(range(num_batches)), workers)
    left = [[b for b in run if b not in consumed] for run in runs]
    live = [w for w in range(workers) if left[w]]
    if not live:
        return left
    # Round-robin serves the live run with the fewest deliveries next (the lowest index on a tie).
    turn = min(live, key=lambda w: (len(runs[w]) - len(left[w]), w))
    return left[turn:] + left[:turn]


def interleave(runs: list[list[int]]) -> list[int]:
    """Delivery order of torch's DataLoader over worker streams: one from each worker in turn, skipping
    workers that ran out."""
    return [run[t] for t in range(max(map(len, runs), default=0)) for run in runs if t < len(run)]


def consumed_after(runs: list[list[int]], delivered: int) -> list[int]:
    """The items of `runs` covered by the first `delivered` deliveries of `interleave(runs)` (no list of
    the whole epoch is built: this runs on every checkpoint)."""
    lengths = sorted(len(r) for r in runs)
    # Full rounds first: after t rounds sum(min(len, t)) items are out.
    lo, hi = 0, lengths[-1] if lengths else 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= delivered:
            lo = mid
        else:
            hi = mid - 1
    extra = delivered - sum(min(n, lo) for n in lengths)
    out = []
    for run in runs:
        take = min(len(run), lo)
        if extra > 0 and len(run) > lo:
            take, extra = take + 1, extra - 1
        out.extend(run[:take])
    return out


def to_ranges(items: list[int] | set[int]) -> list[list[int]]:
    """Sorted integers as half-open [lo, hi) ranges (a compact, JSON-friendly position)."""
    out: list[list[int]] = []
    for x in sorted(items):
        if out and out[-1][1] == x:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return out


def from_ranges(ranges: list[list[int]]) -> set[int]:
    """The integers a list of [lo, hi) ranges covers."""
    return {x for lo, hi in ranges for x in range(int(lo), int(hi))}


@dataclass(frozen=True)
class Segment:
    """Rows [lo, hi) of row group `unit` (an index into the dataset's list of row groups)."""

    unit: int
    lo: int
    hi: int


@dataclass(frozen=True)
class RankPlan:
    """One rank's epoch: its slab of the global row sequence, its windows and its batches."""

    unit_rows: tuple[int, ...]
    order: tuple[int, ...]
    start: int  # first global position of the slab
    rows: int  # rows in the slab (the same on every rank)
    batch_rows: int
    window: int  # shuffle window in rows, a multiple of batch_rows
    shuffle: bool
    seed: int
    epoch: int
    rank: int

    @classmethod
    def make(cls, unit_rows: list[int], *, seed: int, epoch: int, rank: int, world: int, batch_rows: int,
             window: int, shuffle: bool = True, drop_last: bool = False) -> "RankPlan":
        """The plan of `rank` for `epoch`; `window` is rounded up to a multiple of `batch_rows`."""
        total = int(sum(unit_rows))
        rows = rows_per_rank(total, world, drop_last)
        window = max(batch_rows, -(-window // batch_rows) * batch_rows)
        return cls(tuple(int(n) for n in unit_rows), tuple(unit_order(len(unit_rows), seed, epoch, shuffle)),
                   rank * rows, rows, batch_rows, window, shuffle, seed, epoch, rank)

    @property
    def num_batches(self) -> int:
        """Batches this rank delivers per epoch (only the last may be short)."""
        return -(-self.rows // self.batch_rows)

    def window_of(self, batch: int) -> int:
        """The shuffle window holding batch `batch`."""
        return batch * self.batch_rows // self.window

    def segments(self, window: int) -> list[Segment]:
        """The row-group pieces window `window` reads, in slab order (wrapping around for padding)."""
        total = sum(self.unit_rows)
        lo = self.start + window * self.window
        hi = self.start + min((window + 1) * self.window, self.rows)
        sizes = np.array([self.unit_rows[u] for u in self.order], dtype=np.int64)
        ends = np.cumsum(sizes)
        out: list[Segment] = []
        pos = lo
        while pos < hi:
            g = pos % total  # past the end: the padding wraps around to the start of the order
            k = int(np.searchsorted(ends, g, side="right"))
            first = int(ends[k] - sizes[k])
            take = min(int(ends[k]) - g, hi - pos)
            out.append(Segment(self.order[k], g - first, g - first + take))
            pos += take
        return out

    def window_rows(self, window: int) -> int:
        """Rows in window `window`."""
        return min(self.window, self.rows - window * self.window)

    def permutation(self, window: int) -> np.ndarray:
        """The in-buffer shuffle of window `window` (identity without shuffle)."""
        n = self.window_rows(window)
        if not self.shuffle:
            return np.arange(n)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, window, 0x9A4])
        return rng.permutation(n)

    def batch_slice(self, batch: int) -> tuple[int, int]:
        """Rows [lo, hi) of its window that batch `batch` takes (after the window's permutation)."""
        lo = batch * self.batch_rows - self.window_of(batch) * self.window
        return lo, lo + min(self.batch_rows, self.rows - batch * self.batch_rows)
