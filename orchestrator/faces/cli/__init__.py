"""The `autoresearch` command: a thin layer that parses, calls one library function, and prints.

Each sub-module registers its commands on `app`. Sub-modules import nothing heavy (torch, mlflow,
langgraph) at module level: `submit` must stay fast. Errors are turned into one line on stderr here:
`BadInput` (and the experiment space's validation errors) exit 2, other orchestrator errors exit 1.
"""

from __future__ import annotations

import sys

import click
import typer

try:  # typer >= 0.16 vendors its own click; its exceptions are not click's
    from typer._click import exceptions as _tclick
except ImportError:  # pragma: no cover - older typer uses click itself
    _tclick = click.exceptions

_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_HELP = tuple(c for c in (getattr(_tclick, "NoArgsIsHelpError", None),
                          getattr(click.exceptions, "NoArgsIsHelpError", None)) if c is not None)
_CLICK_ERROR = (click.ClickException, _tclick.ClickException)
_USAGE_ERROR = (click.UsageError, _tclick.UsageError)

from orchestrator.core.errors import BadInput, OrchestratorError

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


# Imported for their side effect of adding commands to `app`.
from orchestrator.faces.cli import agent, cache, data, faces, gpus, jobs, preflight, programs, serve  # noqa: E402,F401
from orchestrator.faces.cli import gc, notify  # noqa: E402,F401


def _is_input_error(exc: BaseException) -> bool:
    from experiments.registry import UnknownExperiment
    from experiments.space import SpaceError

    return isinstance(exc, (BadInput, SpaceError, UnknownExperiment))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        rv = app(args=argv, prog_name="autoresearch", standalone_mode=False)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except _ABORT:
        print("autoresearch: aborted", file=sys.stderr)
        sys.exit(130)
    except _HELP as exc:
        print(exc.ctx.get_help())
        sys.exit(0)
    except _CLICK_ERROR as exc:
        message = " ".join(exc.format_message().split())
        param = getattr(exc, "param", None)
        hint = f" (option {param.opts[0]})" if param is not None and param.opts and param.opts[0] not in message else ""
        print(f"autoresearch: {message}{hint}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, _USAGE_ERROR) else exc.exit_code)
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
