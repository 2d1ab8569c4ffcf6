"""Listing Parquet sources for ParquetDataset: an export directory (its manifest), a glob, a file, or a list
of files, on a local/FUSE path or any fsspec URL; and the export manifest's name and format."""

from __future__ import annotations

import glob as globlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from runtime.data.dataset import FileInfo, VolumeDataset
from runtime.errors import VolumeError

__all__ = ["EXPORT_FORMAT", "MANIFEST", "Listing", "list_parquet", "read_manifest"]

MANIFEST = "MANIFEST.json"
EXPORT_FORMAT = "autoresearch.parquet-export/1"


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The manifest of a complete export at `directory` (a path or fsspec URL), or None if it has none."""
    try:
        if "://" in directory:
            import fsspec

            with fsspec.open(f"{directory.rstrip('/')}/{MANIFEST}", "rb") as fh:
                raw = fh.read()
        else:
            with open(os.path.join(directory, MANIFEST), "rb") as fh:
                raw = fh.read()
        manifest = json.loads(raw)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == EXPORT_FORMAT else None


def _isdir(path: str) -> bool:
    if "://" not in path:
        return os.path.isdir(path)
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    return fs.isdir(root)


@dataclass(frozen=True)
class Listing:
    """What a Parquet source holds: the volume (its cache and retrying copies), the files in reading order,
    the schema, and every non-empty row group as (file index, group index) with its row count."""

    volume: VolumeDataset
    files: list[FileInfo]
    schema: pa.Schema
    unit_rows: list[int]
    units: list[tuple[int, int]]
    manifest: dict[str, Any] | None


def list_parquet(paths: str | Sequence[str], *, cache_dir: str | None, cache_limit_bytes: int | None,
                 threads: int) -> Listing:
    """List `paths`; raises VolumeError naming what is missing, torn or inconsistent."""
    volume, files, footers, manifest = _resolve(paths, cache_dir, cache_limit_bytes, threads)
    schema, unit_rows, units = _row_groups(volume, files, footers, manifest)
    return Listing(volume, files, schema, unit_rows, units, manifest)


def _volume(root: str, pattern: str, cache_dir: str | None, cache_limit_bytes: int | None,
            threads: int) -> VolumeDataset:
    return VolumeDataset(root, pattern=pattern, shuffle=False, cache_dir=cache_dir,
                         cache_limit_bytes=cache_limit_bytes, copy_threads=threads)

def _resolve(paths: str | Sequence[str], cache_dir: str | None, cache_limit_bytes: int | None,
             threads: int) -> tuple[VolumeDataset, list[FileInfo], list[Any], dict[str, Any] | None]:
    """The volume, the files in reading order, their footers (row-group sizes from the manifest when there
    is one: no file is opened on the volume to list it), and the manifest."""
    if isinstance(paths, str) and not globlib.has_magic(paths) and _isdir(paths):
        manifest = read_manifest(paths)
        if manifest is None:
            raise VolumeError(f"{paths} is not a complete Parquet export (no {MANIFEST}): an export "
                              "still running or one that died; export it again, or pass a glob "
                              "such as DIR/*.parquet to read plain files")
        volume = _volume(paths, "*.parquet", cache_dir, cache_limit_bytes, threads)
        listed = {f.rel: f for f in volume.files}
        files = []
        for entry in manifest["files"]:
            info = listed.get(entry["path"])
            if info is None or info.size != entry["bytes"]:
                raise VolumeError(f"export {paths} is damaged: {entry['path']} is "
                                  f"{'missing' if info is None else 'not the size its manifest says'}")
            files.append(info)
        return volume, files, [entry["row_groups"] for entry in manifest["files"]], manifest
    if isinstance(paths, str):
        if globlib.has_magic(paths):
            head = paths[:min(paths.find(c) for c in "*?[" if c in paths)]
            root = head.rsplit("/", 1)[0] if "/" in head else "."
        else:
            if "://" not in paths and not os.path.exists(paths):
                raise VolumeError(f"data volume not found: {paths}")
            root = os.path.dirname(paths) or "."
        rels = None
        pattern = paths[len(root):].lstrip("/") if root != "." else paths
    else:
        root = os.path.commonpath([os.path.dirname(p) or "." for p in paths])
        rels = [os.path.relpath(p, root) for p in paths]
        pattern = "*"
    volume = _volume(root, pattern if globlib.has_magic(pattern) else globlib.escape(pattern), cache_dir,
                     cache_limit_bytes, threads)
    files = volume.files
    if rels is None and "**" not in pattern:  # a glob's `*` stays within one directory level
        files = [f for f in files if f.rel.count("/") == pattern.count("/")]
        if not files:
            raise VolumeError(f"no files match {paths}")
    if rels is not None:
        listed = {f.rel: f for f in files}
        missing = [r for r in rels if r not in listed]
        if missing:
            raise VolumeError(f"no such file: {os.path.join(root, missing[0])}")
        files = [listed[r] for r in rels]
    with ThreadPoolExecutor(min(16, len(files))) as pool:  # one round trip each on network storage
        footers = list(pool.map(lambda f: _footer(volume, f), files))
    return volume, files, footers, None

def _footer(volume: VolumeDataset, info: FileInfo) -> pq.FileMetaData:
    uid = volume.source.uid(info.rel)
    try:
        if "://" in uid:
            import fsspec

            with fsspec.open(uid, "rb") as fh:
                return pq.read_metadata(fh)
        return pq.read_metadata(uid)
    except (OSError, pa.ArrowInvalid) as exc:
        raise VolumeError(f"cannot read the Parquet footer of {uid}: {exc}") from None

def _row_groups(volume: VolumeDataset, files: list[FileInfo], footers: list[Any],
                manifest: dict[str, Any] | None) -> tuple[pa.Schema, list[int], list[tuple[int, int]]]:
    if manifest is not None:
        schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(manifest["arrow_schema"])))
        sizes = footers  # lists of row-group row counts
    else:
        schema = footers[0].schema.to_arrow_schema()
        for info, meta in zip(files, footers):
            if not meta.schema.to_arrow_schema().equals(schema):
                raise VolumeError(f"{volume.source.uid(info.rel)} has another schema than "
                                  f"{volume.source.uid(files[0].rel)}")
        sizes = [[meta.row_group(i).num_rows for i in range(meta.num_row_groups)] for meta in footers]
    unit_rows, units = [], []
    for f, groups in enumerate(sizes):
        for g, n in enumerate(groups):
            if n:
                unit_rows.append(int(n))
                units.append((f, g))
    return schema, unit_rows, units
