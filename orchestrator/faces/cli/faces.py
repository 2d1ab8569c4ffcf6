"""`mcp` and `top`: the faces for outside agents (an MCP server) and for people at a terminal (a live view)."""

from __future__ import annotations

from typing import Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import settings
from orchestrator.core.errors import BadInput


@app.command()
def mcp(
    http: Optional[int] = typer.Option(None, "--http", metavar="PORT",
                                       help="Serve streamable HTTP on this port instead of stdio."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address for --http (default: loopback only)."),
    max_priority: int = typer.Option(5, "--max-priority",
                                     help="Highest priority an outside agent may ask for (people's default is 10)."),
    project: Optional[str] = typer.Option(None, "--project", help="Charge every job and session of the "
                                          "server's clients to this project (they may not name another)."),
    allow_cancel_any: bool = typer.Option(False, "--allow-cancel-any",
                                          help="Let clients cancel any job (default: only jobs they own)."),
) -> None:
    """The MCP server for outside agents (stdio; --http PORT for streamable HTTP)."""
    from orchestrator.queue.models import check_priority

    if http is not None and not 0 < http < 65536:
        raise BadInput(f"--http must be a port in 1..65535, got {http}")
    check_priority(max_priority)
    from orchestrator.faces.cli.common import info
    from orchestrator.faces.mcp_server import serve

    if http is not None and host not in ("127.0.0.1", "localhost", "::1"):
        info(f"note: the MCP server has no authentication and listens on {host}:{http}")

    if project is not None:
        from orchestrator.api import jobs as api
        from orchestrator.api.sharing import resolve_project

        project = resolve_project(project, settings(), api.open_store(settings()))
    serve(settings(), http_port=http, host=host, max_priority=max_priority, project=project,
          allow_cancel_any=allow_cancel_any)


@app.command()
def top(
    once: bool = typer.Option(False, "--once", help="Print one frame and exit (for scripts)."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between refreshes."),
    width: Optional[int] = typer.Option(None, "--width", help="Columns of --once output (default: the terminal's)."),
    preempt_after: Optional[float] = typer.Option(None, "--preempt-after", help="As given to `serve`, if it was "
                                                  "given there (the plan shown uses it; default: the setting)."),
) -> None:
    """Live view of devices, the queue (and the next plan), recent events and agent sessions; q quits."""
    if not 0.1 <= interval <= 3600:
        raise BadInput(f"--interval must be between 0.1 and 3600 seconds, got {interval}")
    if width is not None and not 20 <= width <= 1000:
        raise BadInput(f"--width must be between 20 and 1000, got {width}")
    from orchestrator.faces.views import top as view

    config = settings(preempt_after=preempt_after)
    if once:
        view.print_once(config, width=width)
    else:
        view.run(config, interval=interval)
