"""`autoresearch cache warm PATH | stats | clear`: the local data cache that VolumeDataset fills.

torch and the runtime are imported inside the commands, so registering these keeps `submit` fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, print_json, print_table
from orchestrator.core.errors import BadInput, OrchestratorError

cache_app = typer.Typer(help="The local cache of files copied from slow shared volumes.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")

_CACHE_DIR = typer.Option(None, "--cache-dir", help="Cache directory (default: $AUTORESEARCH_HOME/cache).")


def _cache_dir(cache_dir: Optional[Path]) -> str:
    if cache_dir is not None:
        return str(cache_dir.expanduser().resolve())
    from orchestrator.faces.cli.common import settings

    return str(settings().cache_dir)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@cache_app.command("warm")
def warm_cmd(
    path: str = typer.Argument(..., help="A local/FUSE directory or an fsspec URL (s3://bucket/prefix)."),
    pattern: str = typer.Option("*", "--pattern", help="Only files whose relative path matches this glob."),
    threads: int = typer.Option(64, "--threads", min=1, help="Parallel copies."),
    cache_dir: Optional[Path] = _CACHE_DIR,
    json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Copy every file under PATH into the cache, in parallel, with a progress bar."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from runtime.data.dataset import VolumeDataset, warm
    from runtime.errors import VolumeError

    root = _cache_dir(cache_dir)
    try:
        dataset = VolumeDataset(path, pattern=pattern, cache_dir=root, shuffle=False, copy_threads=threads)
    except (VolumeError, ValueError) as exc:
        raise BadInput(str(exc)) from None
    columns = (TextColumn("warming"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    from rich.console import Console

    with Progress(*columns, console=Console(stderr=True), transient=json) as bar:
        task = bar.add_task("warm", total=sum(f.size for f in dataset.files))
        try:
            report = warm(dataset, threads=threads, progress=lambda n: bar.advance(task, n))
        except VolumeError as exc:
            raise OrchestratorError(str(exc)) from None  # the volume failed mid-way: not the user's input
    if json:
        print_json({"source": path, "cache_dir": root, "files": report.files, "bytes": report.bytes,
                    "copied_files": report.copied_files, "copied_bytes": report.copied_bytes,
                    "seconds": round(report.seconds, 3)})
    else:
        info(f"{report.files} files ({_human(report.bytes)}) cached in {root}; copied {report.copied_files} "
             f"({_human(report.copied_bytes)}) in {report.seconds:.1f}s")


@cache_app.command("stats")
def stats_cmd(cache_dir: Optional[Path] = _CACHE_DIR,
              json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Files and bytes in the cache (every job on this host together)."""
    from runtime.data.cache import FileCache

    stats = FileCache(_cache_dir(cache_dir)).stats()
    data = {"cache_dir": stats.root, "files": stats.files, "bytes": stats.bytes,
            "partial_files": stats.partial_files}
    if json:
        print_json(data)
    else:
        print_table("cache", ["directory", "files", "size", "partial copies"],
                    [[stats.root, stats.files, _human(stats.bytes), stats.partial_files]])


@cache_app.command("clear")
def clear_cmd(cache_dir: Optional[Path] = _CACHE_DIR,
              json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Delete every cached file not in use by a running job (files in use are kept)."""
    from runtime.data.cache import FileCache

    root = _cache_dir(cache_dir)
    removed, kept = FileCache(root).clear()
    if json:
        print_json({"cache_dir": root, "removed": removed, "kept_in_use": kept})
    else:
        info(f"removed {removed} files from {root}" + (f"; kept {kept} in use" if kept else ""))
