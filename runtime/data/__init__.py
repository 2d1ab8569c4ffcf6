"""Data for training jobs: a cached, partitioned dataset over a slow volume (`dataset`: VolumeDataset,
`warm`), its file sources (`sources`: local and fsspec volumes) and cache (`cache`), the resumable loader
(`loader`: DataLoader), and Parquet tables (`parquet`: ParquetDataset; `parquet_export`: Delta tables to Parquet
files), and packs of tar shards (`packing`: pack, small files into shards with an index; `shards`:
ShardDataset). `from runtime.data import VolumeDataset, DataLoader, ParquetDataset` works; each name is imported on
first use, so importing one part does not load torch or pyarrow for another."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "VolumeConfig": "dataset", "VolumeDataset": "dataset", "WarmReport": "dataset", "warm": "dataset",
    "STATE_VERSION": "position",
    "DataLoader": "loader",
    "ParquetConfig": "parquet", "ParquetDataset": "parquet", "read_manifest": "parquet_files",
    "FileInfo": "sources", "open_source": "sources",
    "FileCache": "cache", "CacheStats": "cache",
    "ShardConfig": "shards", "ShardDataset": "shards", "read_index": "shardindex",
    "PackConfig": "packing", "pack": "packing",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"runtime.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
