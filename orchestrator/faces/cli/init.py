"""`autoresearch init -- python train.py ...`: write a starter `autoresearch.toml` from the script's own options.

Thin: parse, call `experiments.starter`, print. The script runs only until it builds its parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info
from orchestrator.core.errors import BadInput


@app.command(context_settings={"allow_interspersed_args": False})
def init(
    argv: Optional[List[str]] = typer.Argument(None, help="The training command, after `--`."),
    force: bool = typer.Option(False, "--force", help="Replace an existing autoresearch.toml."),
    to_stdout: bool = typer.Option(False, "--print", help="Print the starter instead of writing it."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds the script may take to build its parser."),
) -> None:
    """A starter autoresearch.toml next to the script, from its argparse, click or typer options."""
    from experiments import starter

    if timeout <= 0:
        raise BadInput(f"--timeout must be > 0, got {timeout:g}")
    try:
        if to_stdout:
            print(starter.starter_toml(list(argv or []), Path.cwd(), timeout), end="")
            return
        path = starter.write_starter(list(argv or []), Path.cwd(), force=force, timeout=timeout)
    except starter.StarterError as exc:
        raise BadInput(str(exc)) from None
    print(path)
    info("review the lines marked `# review`, uncomment metric and direction, then: "
         f"autoresearch start --experiment {path.parent} --goal \"...\"")
