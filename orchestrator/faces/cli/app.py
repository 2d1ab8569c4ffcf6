"""The typer application every command module registers its commands on (`orchestrator.faces.cli` imports
them all; they import `app` from here, so no command module imports the package that imports it)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="autoresearch",
    help="Autonomous research agents and a GPU job queue with priorities and preemption.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _settings_first() -> None:
    """Autonomous research agents and a GPU job queue with priorities and preemption."""
    from orchestrator.faces.cli.common import load_settings

    load_settings()  # every command: a bad config.toml or setting is one line, exit 2, before any work
