"""`autoresearch data export-delta TABLE DEST`: a Delta table to Parquet files on a volume, for ParquetDataset.

The work is runtime.data.parquet_export.export_delta; this parses, shows a progress bar on stderr, and prints.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, print_json
from orchestrator.core.errors import BadInput, OrchestratorError

data_app = typer.Typer(help="Tabular data: export Delta tables to Parquet files on a volume.", no_args_is_help=True)
app.add_typer(data_app, name="data")


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
        task = bar.add_task("export", total=None, start=False)

        def progress(done: int, total: int) -> None:
            # Shown from the first row written: a rejected input prints its one line and nothing else.
            if not bar.live.is_started:
                bar.start()
                bar.start_task(task)
            bar.update(task, completed=done, total=total)

        try:
            manifest = export_delta(cfg, progress=progress)
        finally:
            if bar.live.is_started:
                bar.stop()
    except ExportInputError as exc:
        raise BadInput(str(exc)) from None
    except ExportError as exc:
        raise OrchestratorError(str(exc)) from None
    if json:
        print_json({k: v for k, v in manifest.items() if k != "arrow_schema"} | {"dest": dest})
    else:
        info(f"exported {manifest['rows']:,} rows of {table} (version {manifest['table_version']}) to "
             f"{len(manifest['files'])} files in {dest}")
