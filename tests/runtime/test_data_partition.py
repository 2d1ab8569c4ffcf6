"""How files are split across ranks and DataLoader workers, and what a resume position means.

Pure functions, property-tested over file counts, world sizes, worker counts and batch sizes; the real
worker processes and the 2-process torchrun run are in test_loader_resume.py and test_data_distributed.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.data.dataset import VolumeConfig, epoch_order, rank_order, samples_per_rank, worker_positions
from runtime.data.loader import rank_length

sizes = st.integers(min_value=1, max_value=300)
worlds = st.integers(min_value=1, max_value=8)
workers = st.integers(min_value=1, max_value=6)
blocks = st.integers(min_value=1, max_value=9)


def collected(length: int, block: int, num_workers: int) -> list[int]:
    """Positions in the order torch's DataLoader yields them: one batch from each live worker in turn."""
    queues = [worker_positions(length, block, w, num_workers) for w in range(num_workers)]
    batches = [[q[i:i + block] for i in range(0, len(q), block)] for q in queues]
    out: list[int] = []
    turn = 0
    while any(batches):
        if batches[turn % num_workers]:
            out.extend(batches[turn % num_workers].pop(0))
        turn += 1
    return out


@settings(max_examples=300, deadline=None)
@given(n=sizes, world=worlds, nw=workers, block=blocks, drop_last=st.booleans(), seed=st.integers(0, 5))
def test_every_rank_worker_slice_is_disjoint_and_together_they_cover_the_epoch(n, world, nw, block, drop_last, seed):
    order = epoch_order(n, seed, epoch=3)
    per_rank = samples_per_rank(n, world, drop_last)
    slots = []  # (file index) for every sample any (rank, worker) delivers
    for rank in range(world):
        mine = rank_order(order, 0, rank, world, drop_last)
        assert len(mine) == per_rank, "every rank must get the same count, or DDP hangs on the tail"
        positions = [p for w in range(nw) for p in worker_positions(len(mine), block, w, nw)]
        assert sorted(positions) == list(range(len(mine))), "workers split a rank's order without overlap"
        slots.extend(mine[p] for p in positions)
    counts = Counter(slots)
    if drop_last:
        assert all(c == 1 for c in counts.values()), "drop_last never repeats a file"
        assert n - len(counts) == n % world, "drop_last skips only the remainder"
    else:
        assert set(counts) == set(range(n)), "padding keeps every file in the epoch"
        assert sum(counts.values()) - n == (-n) % world, "padding adds fewer than world_size repeats"


@settings(max_examples=300, deadline=None)
@given(n=sizes, nw=workers, block=blocks)
def test_the_loader_collects_a_ranks_order_exactly_whatever_the_worker_count(n, nw, block):
    assert collected(n, block, nw) == list(range(n))


@settings(max_examples=300, deadline=None)
@given(n=sizes, world=worlds, drop_last=st.booleans(), data=st.data())
def test_resuming_from_samples_consumed_continues_each_rank_where_it_stopped(n, world, drop_last, data):
    order = epoch_order(n, 7, epoch=1)
    per_rank = samples_per_rank(n, world, drop_last)
    done = data.draw(st.integers(0, per_rank), label="samples each rank consumed")
    for rank in range(world):
        full = rank_order(order, 0, rank, world, drop_last)
        assert rank_order(order, done * world, rank, world, drop_last) == full[done:]
        assert rank_length(n, done * world, rank, world, drop_last) == len(full) - done


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 300), seed=st.integers(0, 1000), epoch=st.integers(0, 1000))
def test_the_epoch_order_is_a_permutation_fixed_by_seed_and_epoch(n, seed, epoch):
    order = epoch_order(n, seed, epoch)
    assert sorted(order) == list(range(n))
    assert order == epoch_order(n, seed, epoch)
    assert epoch_order(n, seed, epoch, shuffle=False) == list(range(n))


def test_epochs_and_seeds_reshuffle():
    assert epoch_order(1000, 0, 0) != epoch_order(1000, 0, 1)
    assert epoch_order(1000, 0, 0) != epoch_order(1000, 1, 0)


@pytest.mark.parametrize("bad", [dict(source=""), dict(lookahead=-1), dict(copy_threads=0), dict(retries=0),
                                 dict(cache_limit_bytes=0), dict(pattern=""), dict(transform="not callable"),
                                 dict(retry_backoff_s=-1)])
def test_config_rejects_invalid_options(bad):
    with pytest.raises(ValueError):
        VolumeConfig(**{"source": "/data", **bad})


def test_config_is_frozen():
    cfg = VolumeConfig("/data")
    with pytest.raises(AttributeError):
        cfg.seed = 3


@settings(max_examples=300, deadline=None)
@given(n=sizes, world=worlds, drop_last=st.booleans(), data=st.data())
def test_rank_length_counts_the_rank_order_without_building_it(n, world, drop_last, data):
    consumed = data.draw(st.integers(0, n + world), label="samples consumed globally")
    order = epoch_order(n, 3, epoch=0)
    for rank in range(world):
        assert rank_length(n, consumed, rank, world, drop_last) == len(rank_order(order, consumed, rank, world, drop_last))
