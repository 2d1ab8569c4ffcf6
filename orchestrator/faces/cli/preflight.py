"""`autoresearch preflight`: run the device checks now and print them (exit 1 when any check fails)."""

from __future__ import annotations

from typing import List, Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import print_json, print_table


@app.command()
def preflight(
    devices: Optional[str] = typer.Option(None, "--devices", help="auto, cpu:N or GPU indices like 0,1,3"),
    level: str = typer.Option("quick", "--level", help="quick (seconds) or full (throughput, all-reduce)"),
    path: Optional[List[str]] = typer.Option(None, "--path", help="dir for the disk/volume checks "
                                             "(default: this home's checkpoints and cache dirs)"),
    as_json: bool = typer.Option(False, "--json"),
) -> int:
    """Check devices (and the checkpoint/cache dirs): pass, fail or skipped for each check."""
    from orchestrator.core import devices as device_specs
    from orchestrator.faces.cli.common import settings as command_settings
    from orchestrator.core.errors import BadInput

    if level not in ("quick", "full"):
        raise BadInput(f"bad --level {level!r}: expected quick or full")
    settings = command_settings(devices=devices)
    names = device_specs.parse(settings.devices)  # BadInput (exit 2) for a bad spec or auto without GPUs
    paths = path or [str(settings.checkpoints_dir), str(settings.cache_dir)]

    from runtime import preflight as pf  # imports torch lazily, only when checks run

    results = pf.run(names, level, paths=paths)
    if as_json:
        print_json({"healthy": pf.healthy(results), "results": [r.to_dict() for r in results]})
    else:
        print_table(f"preflight ({level})", ["device", "check", "status", "value", "threshold", "message"],
                    [(r.device, r.check, r.status, _fmt(r.value), _fmt(r.threshold), r.message) for r in results])
    return 0 if pf.healthy(results) else 1


def _fmt(value: object) -> object:
    return f"{value:.3g}" if isinstance(value, float) else value
