"""The `autoresearch` console script: `submit` of a command, `queue --json` and `show ID --json` go straight to
the running service (standard library only, `orchestrator.api.intake`); everything else, and any submit this does
not fully understand or that no service takes, goes through the full CLI (`orchestrator.faces.cli`, typer) with
exactly its behaviour. Submit's flags are read as `orchestrator.api.submitflags` declares them, for both paths.

`python -m orchestrator.faces.fastcli ARGS` is the same as `autoresearch ARGS`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

def _home() -> Path:
    from runtime.protocol import home_dir  # the one rule for where the home is (standard library only)

    return home_dir()


def _config_parses(home: Path) -> bool:
    """Whether config.toml (if any) parses and holds only known keys; if not, the full CLI says why."""
    import tomllib

    try:
        with open(home / "config.toml", "rb") as fh:
            file = tomllib.load(fh)
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    from orchestrator.core.config import known_keys  # standard library only, like this module

    return set(file) <= known_keys()  # an unknown key: the full CLI names it (exit 2)


def fast_submit(args: list[str]) -> Optional[int]:
    """Submit through the running service; the exit code, or None when the full CLI must handle it."""
    from orchestrator.api import submitflags  # the flags' one declaration (standard library only)

    parsed = submitflags.scan(args)
    if parsed is None:
        return None
    argv, options = parsed
    as_json = options.pop("as_json", False)
    if not _config_parses(_home()):
        return None  # the full CLI names the malformed file (exit 2)
    from orchestrator.api import intake

    reply = intake.submit(_home(), argv, options)
    if reply is None:
        return None
    if not reply.get("ok"):
        print(f"autoresearch: {reply.get('error')}", file=sys.stderr)
        return int(reply.get("code", 1))
    job = reply["job"]
    if as_json:  # the same shape and format as the full CLI (orchestrator.faces.cli.common.print_json)
        sys.stdout.write(json.dumps({**job, "service_running": True}, default=str, indent=2) + "\n")
    else:
        print(job["id"])
    return 0


def parse_queue(args: list[str]) -> Optional[dict[str, Any]]:
    """The service request of `queue [--all] [--limit N] --json` (the full CLI's flags and default), or None to
    leave it to the full CLI (anything else, or a --limit it must refuse with its one-line message)."""
    request: dict[str, Any] = {"op": "queue", "all": False}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--all":
            request["all"] = True
        elif arg == "--limit" and i + 1 < len(args) or arg.startswith("--limit="):
            value = arg.partition("=")[2] if "=" in arg else args[i + 1]
            if not (value.isascii() and value.isdigit()):
                return None
            request["limit"] = int(value)
            i += 0 if "=" in arg else 1
        else:
            return None
        i += 1
    return request


def fast_read(command: str, args: list[str]) -> Optional[int]:
    """`queue [--all] [--limit N] --json` and `show ID --json` answered by the running service; None: the full
    CLI."""
    if "--json" not in args or not _config_parses(_home()):
        return None
    rest = [a for a in args if a != "--json"]
    if command == "queue":
        request = parse_queue(rest)
        if request is None:
            return None
    elif command == "show" and len(rest) == 1 and rest[0].lstrip("-").isdigit():
        request = {"op": "show", "id": int(rest[0])}
    else:
        return None
    from orchestrator.api import intake

    reply = intake.ask(_home(), request)
    if reply is None:
        return None
    if not reply.get("ok"):
        print(f"autoresearch: {reply.get('error')}", file=sys.stderr)
        return int(reply.get("code", 1))
    sys.stdout.write(json.dumps(reply["data"], default=str, indent=2) + "\n")
    if reply.get("note"):
        print(reply["note"], file=sys.stderr)  # "... and N more", as the full CLI says it
    return 0


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point."""
    args = sys.argv[1:] if argv is None else argv
    code = None
    if args and args[0] == "submit":
        code = fast_submit(args[1:])
    elif args and args[0] in ("queue", "show"):
        code = fast_read(args[0], args[1:])
    if code is not None:
        sys.exit(code)
    from orchestrator.faces.cli import main as full_main

    full_main(args)


if __name__ == "__main__":
    main()
