"""The typer application every command module registers its commands on (`orchestrator.faces.cli` imports
them all; they import `app` from here, so no command module imports the package that imports it)."""

from __future__ import annotations

import click
import typer
import typer.core

# `--help` lists commands in the order a new user meets them: run the service, queue work and watch it, then
# the agent, then results and the other faces. Commands not named here follow, in registration order.
COMMAND_ORDER = ("serve", "submit", "queue", "show", "logs", "cancel", "gpus", "top", "preflight",
                 "init", "start", "sessions", "resume", "tree", "leaderboard", "ui", "projects", "usage", "gc",
                 "notify", "mcp", "cache", "data")


class _OrderedGroup(typer.core.TyperGroup):
    """The command group, listing its commands in `COMMAND_ORDER`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = list(super().list_commands(ctx))
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda n: (rank.get(n, len(rank)), names.index(n)))


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"autoresearch {version('autoresearch')}")
        except PackageNotFoundError:  # a checkout that was never installed
            print("autoresearch (not installed)")
        raise typer.Exit(0)


app = typer.Typer(
    cls=_OrderedGroup,
    name="autoresearch",
    help="Autonomous research agents and a GPU job queue with priorities and preemption.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _settings_first(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                 help="Print the version and exit."),
) -> None:
    """Autonomous research agents and a GPU job queue with priorities and preemption."""
    from orchestrator.faces.cli.common import load_settings

    load_settings()  # every command: a bad config.toml or setting is one line, exit 2, before any work
