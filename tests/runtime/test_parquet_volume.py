"""ParquetDataset over a real slow FUSE volume: an export is listed from its manifest without opening its
files, a cold epoch copies each file once with copies in flight in parallel, a warm epoch never reads the
volume, and a glob of plain files works there too."""

from __future__ import annotations

import pytest

from runtime.data.loader import DataLoader
from runtime.data.parquet import ParquetDataset
from runtime.data.parquet_export import ExportConfig, export_delta
from tests.support.tabular import write_delta, write_parquet

N = 2000


def ids(loader) -> list[int]:
    return [int(i) for b in loader for i in b["id"]]


@pytest.mark.slow
def test_cold_then_warm_epochs_from_a_slow_volume(data_dir, tmp_path, slow_volume):
    write_delta(tmp_path / "table", N)
    export_delta(ExportConfig(str(tmp_path / "table"), str(data_dir / "export"), files=8, row_group_rows=100))
    vol = slow_volume(data_dir, open_latency=0.05)
    ds = ParquetDataset(str(vol.mountpoint / "export"), batch_rows=64, shuffle_rows=256, lookahead=4,
                        copy_threads=4, columns=["id"], cache_dir=str(tmp_path / "cache"))
    parts = {p: n for p, n in vol.stats()["opens_by_path"].items() if p.endswith(".parquet")}
    assert parts == {}, "listing an export reads its manifest, not its files"

    cold = ids(DataLoader(ds, batch_size=None, num_workers=0))
    assert sorted(cold) == list(range(N))
    stats = vol.stats()
    opened = {p: n for p, n in stats["opens_by_path"].items() if p.endswith(".parquet")}
    assert len(opened) == 8 and set(opened.values()) == {1}, "each file is copied from the volume once"
    assert stats["max_inflight"] >= 2, "files are fetched ahead, several at once"

    again = ParquetDataset(str(vol.mountpoint / "export"), batch_rows=64, columns=["id"],
                           cache_dir=str(tmp_path / "cache"))
    warm = ids(DataLoader(again, batch_size=None, num_workers=2))
    assert sorted(warm) == list(range(N))
    after = {p: n for p, n in vol.stats()["opens_by_path"].items() if p.endswith(".parquet")}
    assert after == opened, "a warm epoch is served from the cache alone, by every worker process"


def test_a_glob_of_plain_files_on_a_slow_volume(data_dir, tmp_path, slow_volume):
    write_parquet(data_dir / "t", [300, 200], row_group_rows=50)
    vol = slow_volume(data_dir, open_latency=0.01)
    ds = ParquetDataset(str(vol.mountpoint / "t" / "*.parquet"), batch_rows=32, cache_dir=str(tmp_path / "c"))
    assert ds.num_rows == 500 and len(ds.unit_rows) == 10
    assert sorted(int(i) for b in ds for i in b["id"]) == list(range(500))
