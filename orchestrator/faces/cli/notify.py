"""`autoresearch notify test`: send one notification to every `[[notify]]` entry (`orchestrator.service.notify`)."""

from __future__ import annotations

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import print_json, settings
from orchestrator.core.errors import BadInput, OrchestratorError

notify_app = typer.Typer(help="Notifications ([[notify]] entries of config.toml).", no_args_is_help=True)
app.add_typer(notify_app, name="notify")


@notify_app.command("test")
def test(as_json: bool = typer.Option(False, "--json", help="The outcome per entry as JSON.")) -> None:
    """Send one test notification to every [[notify]] entry, now; exit 1 when one failed."""
    from orchestrator.service.notify import send_test

    results = send_test(settings())
    if not results:
        raise BadInput("no [[notify]] entries in config.toml")
    if as_json:
        print_json(results)
    else:
        for r in results:
            print(f"{r['target']}: {'delivered' if r['ok'] else 'FAILED: ' + r['error']}")
    if not all(r["ok"] for r in results):
        raise OrchestratorError("a notification was not delivered")
