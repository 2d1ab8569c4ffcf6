"""The `autoresearch` command: a thin layer that parses, calls one library function, and prints.

Each sub-module registers its commands on `app`. Sub-modules import nothing heavy (torch, mlflow,
langgraph) at module level: `submit` must stay fast. Errors are turned into one line on stderr here:
`BadInput` (and the experiment space's validation errors) exit 2, other orchestrator errors exit 1.
"""

from __future__ import annotations

import sys

import click
import typer

from orchestrator.errors import BadInput, OrchestratorError

app = typer.Typer(
    name="autoresearch",
    help="Autonomous research agents and a GPU job queue with priorities and preemption.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Imported for their side effect of adding commands to `app`; a missing module is a feature not built yet.
    import importlib

    for name in ("jobs", "serve", "gpus", "cache", "preflight", "agent"):
        try:
            importlib.import_module(f"orchestrator.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"orchestrator.cli.{name}":
                raise


_register()


def _is_input_error(exc: BaseException) -> bool:
    from experiments.registry import UnknownExperiment
    from experiments.space import SpaceError

    return isinstance(exc, (BadInput, SpaceError, UnknownExperiment))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        rv = app(args=argv, prog_name="autoresearch", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        print("autoresearch: aborted", file=sys.stderr)
        sys.exit(130)
    except click.ClickException as exc:
        print(f"autoresearch: {exc.format_message()}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, click.UsageError) else exc.exit_code)
    except (OrchestratorError, ValueError) as exc:
        if _is_input_error(exc):
            print(f"autoresearch: {exc}", file=sys.stderr)
            sys.exit(2)
        if isinstance(exc, OrchestratorError):
            print(f"autoresearch: error: {exc}", file=sys.stderr)
            sys.exit(1)
        raise
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
