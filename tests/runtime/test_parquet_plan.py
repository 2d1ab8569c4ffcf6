"""The pure functions that decide which rows each rank, worker and batch gets (runtime.data.parquet_plan)."""

from __future__ import annotations

from collections import Counter

from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.data.parquet_plan import (RankPlan, consumed_after, from_ranges, interleave, pass_runs, split_runs,
                                  to_ranges)


def rows_of(plan: RankPlan, unit_start: list[int]) -> list[int]:
    """Global row ids of the rank's batches in batch order (ids = unit start + offset)."""
    out = []
    for b in range(plan.num_batches):
        w = plan.window_of(b)
        window = [unit_start[s.unit] + r for s in plan.segments(w) for r in range(s.lo, s.hi)]
        perm = plan.permutation(w)
        lo, hi = plan.batch_slice(b)
        out += [window[i] for i in perm[lo:hi]]
    return out


@settings(max_examples=60, deadline=None)
@given(units=st.lists(st.integers(1, 40), min_size=1, max_size=12), world=st.integers(1, 4),
       batch=st.integers(1, 9), window=st.integers(1, 50), drop=st.booleans(), epoch=st.integers(0, 3))
@example(units=[1], world=2, batch=1, window=1, drop=True, epoch=0)  # fewer rows than ranks, tail dropped
def test_ranks_get_equal_disjoint_slabs_covering_the_epoch(units, world, batch, window, drop, epoch):
    total = sum(units)
    starts = [sum(units[:i]) for i in range(len(units))]
    plans = [RankPlan.make(units, seed=3, epoch=epoch, rank=r, world=world, batch_rows=batch, window=window,
                           drop_last=drop) for r in range(world)]
    per_rank = [rows_of(p, starts) for p in plans]
    n = total // world if drop else -(-total // world)
    assert all(len(rows) == n for rows in per_rank), "every rank gets the same row count"
    assert len({p.num_batches for p in plans}) == 1, "and the same number of batches (DDP never hangs)"
    seen = Counter(x for rows in per_rank for x in rows)
    if drop:
        # (fewer rows than ranks: every rank gets none)
        assert all(c == 1 for c in seen.values()) and len(seen) == n * world, "dropped: disjoint, the tail skipped"
    else:
        assert set(seen) == set(range(total)), "padded: every row is seen"
        assert sum(seen.values()) - total == n * world - total < world, "repeats are only the padding"


@settings(max_examples=80, deadline=None)
@given(items=st.integers(0, 40), workers=st.integers(1, 5), k=st.integers(0, 45))
def test_consumed_after_matches_the_delivery_order(items, workers, k):
    runs = split_runs(list(range(items)), workers)
    assert sorted(x for r in runs for x in r) == list(range(items))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    k = min(k, items)
    assert sorted(consumed_after(runs, k)) == sorted(interleave(runs)[:k])


@settings(max_examples=80, deadline=None)
@given(items=st.integers(0, 30), before=st.integers(1, 4), after=st.integers(1, 4), k=st.integers(0, 30),
       k2=st.integers(0, 30))
def test_a_resumed_pass_delivers_exactly_the_rest_and_the_same_order_with_the_same_workers(items, before, after,
                                                                                           k, k2):
    first = pass_runs(items, set(), before)
    k = min(k, items)
    done = set(consumed_after(first, k))
    second = pass_runs(items, done, after)
    rest = interleave(second)
    assert sorted(rest) == sorted(set(range(items)) - done)
    if before == after:
        assert rest == interleave(first)[k:], "resumed with the same workers: the same order"
    k2 = min(k2, len(rest))  # a second preemption in the same epoch
    done2 = done | set(consumed_after(second, k2))
    assert sorted(interleave(pass_runs(items, done2, before))) == sorted(set(range(items)) - done2)


def test_windows_shuffle_per_epoch_and_cut_batches_inside_one_window():
    units = [10] * 6
    a = RankPlan.make(units, seed=1, epoch=0, rank=0, world=1, batch_rows=4, window=9)
    assert a.window == 12, "rounded up to a multiple of the batch"
    b = RankPlan.make(units, seed=1, epoch=1, rank=0, world=1, batch_rows=4, window=9)
    starts = [10 * i for i in range(6)]
    assert rows_of(a, starts) != rows_of(b, starts) and sorted(rows_of(a, starts)) == list(range(60))
    plain = RankPlan.make(units, seed=1, epoch=0, rank=0, world=1, batch_rows=4, window=9, shuffle=False)
    assert rows_of(plain, starts) == list(range(60))


def test_ranges_round_trip():
    items = {0, 1, 2, 5, 7, 8}
    assert to_ranges(items) == [[0, 3], [5, 6], [7, 9]]
    assert from_ranges(to_ranges(items)) == items
