"""The file cache: a size limit with LRU eviction that never takes a file in use, torn entries, clearing."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.data.dataset import VolumeDataset
from runtime.data.loader import DataLoader
from tests.support import checked_index, write_files

SIZE = 1000


def dataset(source: Path, cache: Path, limit: int | None = None, **opts) -> VolumeDataset:
    return VolumeDataset(source, cache_dir=cache, cache_limit_bytes=limit, shuffle=False, **opts)


def cached_files(cache: Path) -> list[Path]:
    return sorted((cache / "objects").rglob("*.bin"))


def test_eviction_under_a_tiny_limit_never_removes_a_file_in_use(data_dir, tmp_path):
    write_files(data_dir, 30, size=SIZE)
    cache = tmp_path / "cache"
    ds = dataset(data_dir, cache, limit=5 * SIZE, lookahead=2)
    held = [ds.fetch(info) for info in ds.files[:3]]  # a consumer still working on these
    assert sorted(checked_index(p) for p in ds) == list(range(30))
    for pin in held:
        assert os.path.exists(pin.path), "a file in use was evicted"
        checked_index(pin.path)
    on_disk = sum(p.stat().st_size for p in cached_files(cache))
    # In use at the last insert: the 3 held, lookahead + 1 in flight, and the current and previous file.
    assert on_disk <= 5 * SIZE + (3 + 3 + 2) * SIZE, "the limit holds, give or take the files in use"
    ds.cache.evict(0)
    assert cached_files(cache) == sorted(Path(pin.path) for pin in held), "only files in use survive"
    for pin in held:
        pin.release()
    ds.cache.evict(0)
    assert cached_files(cache) == [], "released files are evictable again"


def test_eviction_is_least_recently_used(data_dir, tmp_path):
    write_files(data_dir, 10, size=SIZE, subdirs=0)
    cache = tmp_path / "cache"
    ds = dataset(data_dir, cache)
    paths = list(ds)
    for age, path in enumerate(paths):  # file 0 oldest ... file 9 newest
        os.utime(path, ns=(10**18 + age * 10**9,) * 2)
    ds.fetch(ds.files[0]).release()  # a hit: file 0 is now the most recently used
    ds.cache.evict(5 * SIZE)
    left = {checked_index(str(p)) for p in cached_files(cache)}
    assert left == {0, 6, 7, 8, 9}


def test_loader_paths_stay_readable_under_eviction_pressure(data_dir, tmp_path):
    write_files(data_dir, 60, size=SIZE)
    ds = dataset(data_dir, tmp_path / "cache", limit=4 * SIZE, lookahead=2)
    # No transform: paths travel to this process and are read here, after the worker moved on.
    seen = [checked_index(p) for batch in DataLoader(ds, batch_size=4, num_workers=2) for p in batch]
    assert sorted(seen) == list(range(60))


def test_a_torn_entry_is_replaced_not_served(data_dir, tmp_path):
    write_files(data_dir, 2, size=SIZE)
    cache = tmp_path / "cache"
    (first, _) = list(dataset(data_dir, cache))
    os.truncate(first, 100)  # what a power loss can leave behind a rename that was not fsynced
    (again, _) = list(dataset(data_dir, cache))
    assert again == first and checked_index(again) == 0


def test_clear_removes_everything_but_files_in_use(data_dir, tmp_path):
    write_files(data_dir, 8, size=SIZE)
    ds = dataset(data_dir, tmp_path / "cache")
    list(ds)
    pin = ds.fetch(ds.files[0])
    assert ds.cache.clear() == (7, 1)
    assert cached_files(tmp_path / "cache") == [Path(pin.path)]
    pin.release()
    assert ds.cache.clear() == (1, 0)
    assert ds.cache.stats().files == 0
