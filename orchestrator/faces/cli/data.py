"""`autoresearch data export-delta TABLE DEST`: a Delta table to Parquet files on a volume, for ParquetDataset;
`autoresearch data pack SRC DEST`: small files into tar shards with an index, for ShardDataset.

The work is runtime.data.parquet_export.export_delta and runtime.data.packing.pack; this parses, shows a
progress bar on stderr, and prints.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, print_json
from orchestrator.core.errors import BadInput, OrchestratorError

data_app = typer.Typer(help="Data on volumes: export Delta tables to Parquet files, pack small files into shards.",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")


@contextmanager
def _lazy_bar(bar: Any, **fields: Any) -> Iterator[Callable[..., None]]:
    """`update(**progress)` for `bar` (a rich Progress), shown from its first call only (a rejected input prints
    its one line and no bar), and stopped when the block ends, however it ends."""
    task = bar.add_task("work", total=None, start=False, **fields)

    def update(**progress: Any) -> None:
        if not bar.live.is_started:
            bar.start()
            bar.start_task(task)
        bar.update(task, **progress)

    try:
        yield update
    finally:
        if bar.live.is_started:
            bar.stop()


def _split(values: Optional[List[str]]) -> Optional[List[str]]:
    # `--columns a,b --columns c` and `--columns a --columns b` both work.
    if not values:
        return None
    return [c.strip() for v in values for c in v.split(",") if c.strip()]


@data_app.command("export-delta")
def export_delta_cmd(
    table: str = typer.Argument(..., help="The Delta table: a local path or any URI delta-rs reads."),
    dest: str = typer.Argument(..., help="A new directory on the volume (local or mounted path)."),
    files: int = typer.Option(8, "--files", help="Parquet files to spread the row groups over."),
    columns: Optional[List[str]] = typer.Option(None, "--columns", help="Columns to keep (comma-separated "
                                                                        "or repeated); default: all."),
    where: Optional[str] = typer.Option(None, "--where", help="SQL filter on the rows, e.g. \"split = 'train'\"."),
    row_group_rows: int = typer.Option(65536, "--row-group-rows", help="Rows per row group (the last may be "
                                                                       "smaller): the unit ranks split by."),
    version: Optional[int] = typer.Option(None, "--version", help="Table version to export (default: latest)."),
    json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Export TABLE to Parquet files in DEST, atomically: DEST appears only once complete."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from runtime.errors import ExportError, ExportInputError
    from runtime.data.parquet_export import ExportConfig, export_delta

    try:
        cfg = ExportConfig(table, dest, files=files, columns=_split(columns), where=where,
                           row_group_rows=row_group_rows, version=version)
        bar = Progress(TextColumn("exporting rows"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                       console=Console(stderr=True), transient=json)
        with _lazy_bar(bar) as update:
            manifest = export_delta(cfg, progress=lambda done, total: update(completed=done, total=total))
    except ExportInputError as exc:
        raise BadInput(str(exc)) from None
    except ExportError as exc:
        raise OrchestratorError(str(exc)) from None
    if json:
        print_json({k: v for k, v in manifest.items() if k != "arrow_schema"} | {"dest": dest})
    else:
        info(f"exported {manifest['rows']:,} rows of {table} (version {manifest['table_version']}) to "
             f"{len(manifest['files'])} files in {dest}")


@data_app.command("pack")
def pack_cmd(
    src: str = typer.Argument(..., help="The files to pack: a local/mounted directory or an fsspec URL."),
    dest: str = typer.Argument(..., help="A directory for the shards and index.json (new, or an earlier pack to "
                                         "resume or replace)."),
    shard_size: str = typer.Option("1GiB", "--shard-size", help="About this many bytes per shard (1GiB, 256MiB)."),
    split_by: Optional[str] = typer.Option(None, "--split-by", help="Shards per split: 'dir' (the top-level "
                                                                    "folder) or a regex whose first group names "
                                                                    "the split, e.g. '^(train|val)-'."),
    pattern: str = typer.Option("*", "--pattern", help="Only files whose relative path matches this glob."),
    threads: int = typer.Option(64, "--threads", min=1, help="Parallel reads of SRC."),
    json: bool = typer.Option(False, "--json", help="Print a summary as JSON."),
) -> None:
    """Pack the files under SRC into WebDataset-style tar shards in DEST, with index.json written last.

    Run again, a killed pack resumes from its complete shards; a pack of changed files replaces those shards.
    """
    import time

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from runtime.data.packing import PackConfig, pack
    from runtime.errors import PackError, PackInputError

    t0 = time.perf_counter()
    try:
        cfg = PackConfig(src, dest, shard_size=shard_size, split_by=split_by, pattern=pattern, threads=threads)
        bar = Progress(TextColumn("packing"), BarColumn(), TextColumn("{task.fields[files]} files"), DownloadColumn(),
                       TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=json)
        with _lazy_bar(bar, files="0") as update:
            index = pack(cfg, progress=lambda files_done, files_total, bytes_done, bytes_total: update(
                completed=bytes_done, total=bytes_total, files=f"{files_done:,}/{files_total:,}"))
    except PackInputError as exc:
        raise BadInput(str(exc)) from None
    except PackError as exc:
        raise OrchestratorError(str(exc)) from None
    summary = {"source": src, "dest": dest, "files": index["files"], "bytes": index["bytes"],
               "samples": index["samples"], "shards": len(index["shards"]),
               "seconds": round(time.perf_counter() - t0, 3)}
    if json:
        print_json(summary)
    else:
        info(f"packed {index['files']:,} files ({index['samples']:,} samples, {index['bytes'] / 2**20:,.1f} MiB) "
             f"into {len(index['shards'])} shards in {dest}")
