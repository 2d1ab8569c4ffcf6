"""The `autoresearch` command: a thin layer that parses, calls one library function, and prints.

Each sub-module registers its commands on `app`. Sub-modules import nothing heavy (torch, mlflow,
langgraph) at module level: `submit` must stay fast. Errors are turned into one line on stderr here:
`BadInput` (and the experiment space's validation errors) exit 2, other orchestrator errors exit 1.
"""

from __future__ import annotations

import sys

import click
import typer
import typer.core

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

from orchestrator.faces.cli.app import app  # noqa: E402

# Imported for their side effect of adding commands to `app`.
from orchestrator.faces.cli import agent, cache, data, faces, gpus, init, jobs, preflight, programs, projects, serve  # noqa: E402,F401,E501
from orchestrator.faces.cli import gc, notify  # noqa: E402,F401


def _is_input_error(exc: BaseException) -> bool:
    from experiments.registry import UnknownExperiment
    from experiments.space import SpaceError

    return isinstance(exc, (BadInput, SpaceError, UnknownExperiment))


def _given(argv: list[str], param) -> str | None:
    """The value the user gave an option that was refused (`--priority abc` -> 'abc'), to echo it back."""
    opts = set(getattr(param, "opts", None) or ()) if param is not None else set()
    if not opts or getattr(param, "is_flag", False):
        return None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if name in opts:
            if eq:
                return value
            if i + 1 < len(argv):
                return argv[i + 1]
    return None


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    from orchestrator.faces.cli.helpfmt import command

    try:
        rv = command(app).main(args=argv, prog_name="autoresearch", standalone_mode=False)
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
        given = _given(sys.argv[1:] if argv is None else argv, param)
        if given is not None and repr(given) not in message:
            hint += f" (got {given!r})"
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
