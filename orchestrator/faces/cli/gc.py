"""`autoresearch gc`: apply the checkpoint, log and event retention policy (`orchestrator.service.gc`) once."""

from __future__ import annotations

from typing import List, Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import print_json, settings


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@app.command()
def gc(
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be removed; change nothing."),
    keep: List[int] = typer.Option([], "--keep", metavar="ID", help="Mark a job's checkpoint to keep for good "
                                   "(repeatable), before the pass."),
    keep_mode: Optional[str] = typer.Option(None, "--keep-mode", help="With --keep: all (default), latest or none."),
    as_json: bool = typer.Option(False, "--json", help="The report as JSON."),
) -> None:
    """Apply the checkpoint and log retention policy, and say what it freed."""
    from orchestrator.api import jobs as api
    from orchestrator.service.gc import run_gc

    cfg = settings()
    if keep:
        store = api.open_store(cfg)
        for job_id in keep:
            store.keeping.set_keep(job_id, keep_mode or "all")
    report = run_gc(cfg, dry_run=dry_run)
    if as_json:
        print_json(report.to_dict())
        return
    verb = "would free" if dry_run else "freed"
    for item in report.checkpoints:
        print(f"job {item['id']:>6}: {item['action']:<6} {human_bytes(item['bytes']):>10}  {item['why']}")
    print(f"checkpoints: {len(report.checkpoints)} jobs, {verb} {human_bytes(report.checkpoint_bytes)}")
    print(f"logs: {report.logs_capped} capped, {report.logs_compressed} compressed, {report.logs_deleted} deleted, "
          f"{verb} {human_bytes(report.log_bytes)}")
    if report.forks:
        print(f"forks: {len(report.forks)} checkpoint copies of ended PBT sessions, {verb} "
              f"{human_bytes(report.fork_bytes)}")
    if report.events_dropped:
        print(f"events: {report.events_dropped} old event rows compacted")
