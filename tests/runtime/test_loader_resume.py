"""The loader with real DataLoader worker processes: exact order, epochs, and exact resume, also when the
number of workers changes between the save and the resume."""

from __future__ import annotations

import json

import pytest
import torch
from tests.support import checked_index, sample_index, write_files

from runtime.data.dataset import VolumeDataset, epoch_order
from runtime.data.loader import DataLoader

N = 53  # not a multiple of the batch size: the last batch is partial


IDS: list[int] = []  # stored index of the file at each listing position (files sit in subdirectories)


@pytest.fixture
def files(data_dir):
    rels = write_files(data_dir, N, size=512)
    IDS[:] = [int(r.rsplit("/", 1)[1][:5]) for r in rels]
    return data_dir


def loader(source, cache, workers, batch=4, **opts):
    ds = VolumeDataset(source, cache_dir=cache, seed=11, transform=sample_index, **opts)
    return DataLoader(ds, batch_size=batch, num_workers=workers)


def flat(batches) -> list[int]:
    return [int(x) for b in batches for x in b]


def expected_order(epoch: int) -> list[int]:
    return [IDS[p] for p in epoch_order(N, 11, epoch)]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_loader_delivers_the_epoch_order_exactly(files, tmp_path, workers):
    dl = loader(files, tmp_path / "c", workers)
    assert flat(dl) == expected_order(0)
    assert len(dl) == -(-N // 4)


@pytest.mark.parametrize("before,after,stop", [(2, 1, 5), (2, 0, 1), (0, 2, 9), (1, 2, 13)])
def test_resume_yields_exactly_the_unseen_rest_even_with_other_worker_counts(files, tmp_path, before, after, stop):
    dl = loader(files, tmp_path / "c", before)
    dl.set_epoch(2)
    seen = []
    for i, batch in enumerate(dl):
        seen += [int(x) for x in batch]
        if i + 1 == stop:
            state = dl.state_dict()
            break
    assert state["epoch"] == 2 and state["samples_consumed"] == len(seen)
    saved = json.loads(json.dumps(state))  # what a checkpoint stores: plain ints

    resumed = loader(files, tmp_path / "c", after)
    resumed.load_state_dict(saved)
    resumed.set_epoch(2)  # a resumed training loop calls this for the epoch it resumes: it must not restart
    rest = flat(resumed)
    assert seen + rest == expected_order(2), "no sample twice, none skipped, same order"
    assert resumed.state_dict()["epoch"] == 3 and resumed.state_dict()["samples_consumed"] == 0


def test_epochs_advance_and_reshuffle_across_persistent_workers(files, tmp_path):
    dl = loader(files, tmp_path / "c", 2)
    first, second = flat(dl), flat(dl)  # iterating again moves to the next epoch
    assert first == expected_order(0) and second == expected_order(1)
    dl.set_epoch(7)
    assert flat(dl) == expected_order(7)
    assert dl.state_dict()["epoch"] == 8


def test_abandoned_iteration_continues_where_it_stopped(files, tmp_path):
    dl = loader(files, tmp_path / "c", 2)
    it = iter(dl)
    head = flat([next(it), next(it)])
    del it
    assert head + flat(dl) == expected_order(0)


def test_paths_without_transform_are_intact_cached_copies(files, tmp_path):
    ds = VolumeDataset(files, cache_dir=tmp_path / "c", shuffle=False)
    batches = list(DataLoader(ds, batch_size=8, num_workers=2))
    paths = [p for b in batches for p in b]
    assert all(p.startswith(str(tmp_path / "c")) for p in paths), "served from the cache, not the volume"
    assert [checked_index(p) for p in paths] == IDS
    # An unchanged file is served from the same entry next time: no second copy.
    again = [p for b in DataLoader(VolumeDataset(files, cache_dir=tmp_path / "c", shuffle=False),
                                   batch_size=8, num_workers=0) for p in b]
    assert again == paths


def test_a_changed_source_file_is_copied_again(files, tmp_path):
    ds = VolumeDataset(files, cache_dir=tmp_path / "c", shuffle=False, pattern="d0/*")
    old = list(ds)[0]
    target = files / "d0" / "00000.bin"
    target.write_bytes(b"00000099" + b"x" * 100)  # new size and mtime: a new cache key
    new = list(VolumeDataset(files, cache_dir=tmp_path / "c", shuffle=False, pattern="d0/*"))[0]
    assert new != old and open(new, "rb").read(8) == b"00000099"


def test_state_dict_of_dataset_alone_tracks_direct_iteration(files, tmp_path):
    ds = VolumeDataset(files, cache_dir=tmp_path / "c", seed=11, transform=sample_index)
    it = iter(ds)
    head = [next(it) for _ in range(10)]
    state = ds.state_dict()
    assert state["samples_consumed"] == 10
    fresh = VolumeDataset(files, cache_dir=tmp_path / "c", seed=11, transform=sample_index)
    fresh.load_state_dict(state)
    assert head + list(fresh) == expected_order(0)


def test_default_collate_stacks_transformed_tensors(files, tmp_path):
    ds = VolumeDataset(files, cache_dir=tmp_path / "c", transform=lambda p: torch.tensor(sample_index(p)))
    batch = next(iter(DataLoader(ds, batch_size=5, num_workers=1)))
    assert isinstance(batch, torch.Tensor) and batch.shape == (5,)


def tensors_of(path) -> dict:
    """Per sample: small tensors of awkward kinds (inlined in the worker's message) and a big one (shared memory)."""
    i = sample_index(path)
    g = torch.Generator().manual_seed(i)
    return {"label": torch.tensor(i), "half": torch.randn(3, generator=g).to(torch.bfloat16),
            "mask": torch.arange(5) % (i % 3 + 1) == 0, "view": torch.arange(12.0).view(3, 4).t()[1:] + i,
            "empty": torch.empty(0, 2), "big": torch.full((40_000,), float(i))}


def test_batches_cross_from_workers_intact_whatever_their_size(files, tmp_path):
    ds = VolumeDataset(files, cache_dir=tmp_path / "c", seed=11, transform=tensors_of)
    got = list(DataLoader(ds, batch_size=4, num_workers=2))
    paths = list(VolumeDataset(files, cache_dir=tmp_path / "c2", seed=11))
    want = [torch.utils.data.default_collate([tensors_of(p) for p in paths[k:k + 4]]) for k in range(0, N, 4)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key in w:
            assert g[key].dtype == w[key].dtype and g[key].shape == w[key].shape and torch.equal(g[key], w[key]), key
    assert got[0]["big"].is_shared() and not got[0]["label"].is_shared()  # the two paths were both taken


def test_spawned_persistent_workers_follow_resume_and_epochs(files, tmp_path):
    # Spawned workers get the dataset pickled once; the per-epoch position must still reach them.
    ds = VolumeDataset(files, cache_dir=tmp_path / "c", seed=11, transform=sample_index)
    dl = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    it = iter(dl)
    head = flat([next(it), next(it)])
    del it
    assert head + flat(dl) == expected_order(0)
    assert flat(dl) == expected_order(1)
