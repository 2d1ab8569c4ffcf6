"""Export a Delta table to Parquet files on a volume, laid out for even splits and written atomically.

    manifest = export_delta("/data/events", "/mnt/vol/events", files=8, columns=["x", "y"],
                            where="split = 'train'", row_group_rows=65536)

delta-rs (`deltalake`) reads the table at one version, so the export is one consistent snapshot, and its
SQL engine (DataFusion) applies `where` and streams record batches: the table is never held in memory.
Every row group holds exactly `row_group_rows` rows except the very last one, and the row groups are spread
over `files` files whose counts differ by at most one, so ParquetDataset can split any row range evenly.

Atomic: everything is written into a hidden sibling directory, the manifest (row counts, schema, table
version, per-file row groups) last, then the directory is renamed to DEST. A reader therefore sees either no
DEST or a complete one; ParquetDataset refuses a directory without a manifest. On failure the temporary
directory is removed; one left by a killed export is removed by the next export to the same parent.
DEST must be a local or mounted path (a rename is not atomic on object stores).
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from runtime.errors import ExportError, ExportInputError
from runtime.data.parquet_files import EXPORT_FORMAT, MANIFEST

__all__ = ["ExportConfig", "export_delta"]

Progress = Callable[[int, int], None]  # (rows written so far, rows in total)


@dataclass(frozen=True)
class ExportConfig:
    """What to export and how to lay it out."""

    table_uri: str
    dest: str
    files: int = 1
    columns: tuple[str, ...] | None = None
    where: str | None = None
    row_group_rows: int = 65536
    version: int | None = None  # None: the latest version of the table
    compression: str = "snappy"

    def __post_init__(self) -> None:
        if self.files < 1:
            raise ExportInputError(f"--files must be >= 1, got {self.files}")
        if self.row_group_rows < 1:
            raise ExportInputError(f"row group size must be >= 1, got {self.row_group_rows}")
        if self.columns is not None:
            object.__setattr__(self, "columns", tuple(self.columns))
            if not self.columns:
                raise ExportInputError("--columns names no column")
        if "://" in str(self.dest):
            raise ExportInputError(f"DEST must be a local or mounted path, got {self.dest}")


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _open_table(cfg: ExportConfig):
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError, TableNotFoundError

    try:
        table = DeltaTable(cfg.table_uri, version=cfg.version)
    except TableNotFoundError:
        raise ExportInputError(f"no Delta table at {cfg.table_uri}") from None
    except (DeltaError, OSError, ValueError) as exc:
        raise ExportInputError(f"cannot open Delta table {cfg.table_uri}: {_first_line(exc)}") from None
    return table


def _sweep(parent: Path, name: str) -> None:
    """Remove temporary directories that killed exports to `name` left behind (their pid is gone)."""
    for entry in parent.glob(f".{name}.export-*"):
        try:
            pid = int(entry.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
            continue  # a live export (ours would have another uuid)
        except (ValueError, IndexError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _layout(rows: int, group: int, files: int) -> list[int]:
    """Row groups per file: ceil(rows / group) groups spread so counts differ by at most one."""
    groups = max(1, -(-rows // group))
    files = min(files, groups)
    q, rem = divmod(groups, files)
    return [q + (i < rem) for i in range(files)]


def export_delta(cfg: ExportConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Export `cfg.table_uri` to Parquet files in `cfg.dest`; returns the manifest written there.

    Raises ExportInputError (bad table, column, filter, or an existing DEST: nothing is written) or
    ExportError (e.g. the disk filled up: whatever was written is removed)."""
    from deltalake import QueryBuilder

    dest = Path(cfg.dest).expanduser().absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportInputError(f"{dest} already exists; export to a new directory")
    if not dest.parent.is_dir():
        raise ExportInputError(f"parent directory of DEST does not exist: {dest.parent}")
    table = _open_table(cfg)
    schema = pa.schema(table.schema())
    names = schema.names
    for col in cfg.columns or ():
        if col not in names:
            raise ExportInputError(f"no column {col!r} in {cfg.table_uri}; it has: {', '.join(names)}")
    columns = list(cfg.columns) if cfg.columns else names
    target = pa.schema([schema.field(c) for c in columns])
    query = QueryBuilder().register("t", table)
    where = f" WHERE {cfg.where}" if cfg.where else ""
    try:
        counted = pa.table(query.execute(f"SELECT count(*) AS n FROM t{where}").read_all())
        total = int(counted.column("n")[0].as_py())
        reader = pa.RecordBatchReader.from_stream(
            query.execute(f"SELECT {', '.join(map(_quote, columns))} FROM t{where}"))
    except Exception as exc:  # DataFusion's errors carry no useful type: a bad --where is the usual cause
        raise ExportInputError(f"bad --where {cfg.where!r}: {_first_line(exc)}") from None

    _sweep(dest.parent, dest.name)
    tmp = dest.parent / f".{dest.name}.export-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        files = _write(reader, target, tmp, cfg, total, progress)
        manifest = {
            "format": EXPORT_FORMAT, "table_uri": cfg.table_uri, "table_version": table.version(),
            "where": cfg.where, "columns": columns, "rows": sum(f["rows"] for f in files),
            "row_group_rows": cfg.row_group_rows,
            "schema": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in target],
            "arrow_schema": target.serialize().to_pybytes().hex(),
            "files": files, "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        if manifest["rows"] != total:
            raise ExportError(f"read {manifest['rows']} rows from {cfg.table_uri}, expected {total}")
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if dest.exists():
            dest.rmdir()  # an empty directory: replaced by the rename below
        os.rename(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ExportError(f"no space left on the device of {dest}; nothing was kept") from None
        if isinstance(exc, OSError):
            raise ExportError(f"exporting to {dest} failed: {exc.strerror or exc}; nothing was kept") from None
        raise
    return manifest


def _write(reader: pa.RecordBatchReader, target: pa.Schema, tmp: Path, cfg: ExportConfig, total: int,
           progress: Progress | None) -> list[dict[str, Any]]:
    """Stream `reader` into files of whole row groups as `_layout` says; returns the per-file entries."""
    layout = _layout(total, cfg.row_group_rows, cfg.files)
    out: list[dict[str, Any]] = []
    pending: list[pa.RecordBatch] = []
    buffered = written = 0
    writer: pq.ParquetWriter | None = None
    current: dict[str, Any] | None = None

    def emit(rows: int) -> None:
        nonlocal pending, buffered, writer, current, written
        chunk = pa.Table.from_batches(pending, schema=target)
        group, rest = chunk.slice(0, rows), chunk.slice(rows)
        if writer is None:
            index = len(out)
            current = {"path": f"part-{index:05d}.parquet", "rows": 0, "bytes": 0, "row_groups": []}
            writer = pq.ParquetWriter(tmp / current["path"], target, compression=cfg.compression)
        writer.write_table(group, row_group_size=rows)
        current["rows"] += rows
        current["row_groups"].append(rows)
        written += rows
        pending, buffered = rest.to_batches(), rest.num_rows
        if len(current["row_groups"]) == layout[len(out)]:
            writer.close()
            path = tmp / current["path"]
            _fsync_file(path)
            current["bytes"] = path.stat().st_size
            out.append(current)
            writer, current = None, None
        if progress is not None:
            progress(written, total)

    try:
        for batch in reader:
            if batch.num_rows == 0:
                continue
            pending.append(batch.cast(target))
            buffered += batch.num_rows
            while buffered >= cfg.row_group_rows:
                emit(cfg.row_group_rows)
        if buffered:
            emit(buffered)
        if writer is not None:  # fewer rows arrived than counted: close what we have
            writer.close()
            path = tmp / current["path"]
            current["bytes"] = path.stat().st_size
            out.append(current)
            writer = None
    finally:
        if writer is not None:
            writer.close()
    if total == 0 and not out:  # an empty selection still yields a readable (empty) export
        pq.write_table(target.empty_table(), tmp / "part-00000.parquet")
        out.append({"path": "part-00000.parquet", "rows": 0, "row_groups": [],
                    "bytes": (tmp / "part-00000.parquet").stat().st_size})
    return out


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:
        pass  # some filesystems (FUSE passthroughs) cannot fsync a directory; the rename still orders
