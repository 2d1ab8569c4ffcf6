"""The process a session runs in when it is started in the background (`orchestrator.start_session`, MCP's
`start_session`), started by `orchestrator.faces.pyapi.sessionapi`:

    python -m orchestrator.faces.detached CONFIG_JSON SESSION_ID [DEVICES]      a new session (either mode)
    python -m orchestrator.faces.detached --resume SESSION_ID [DEVICES] [BUDGET_JSON]   continue one

It prints what `autoresearch start` prints, into the session's log, and writes each event as one JSON line to
the session's event file (`sessionapi.events_path`) as well, for `Session.events()` to stream: machines read that
file, people read the log.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional


def _recorder(home: Path, session_id: str) -> tuple[Callable[[dict], None], Callable[[str], None]]:
    """(on_event for an experiment session, say for a program session): each prints as `start` does and
    appends the event to the session's event file."""
    from orchestrator.faces.cli.agent import progress as print_progress
    from orchestrator.faces.pyapi.sessionapi import events_path

    path = events_path(home, session_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()

    def write(event: dict) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps(event, default=str) + "\n")

    def on_event(event: dict) -> None:
        print_progress(event)
        write(event)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        write({"event": "message", "elapsed": round(time.monotonic() - began, 1), "message": text})

    return on_event, say


def _run(config: dict[str, Any], session_id: Optional[str], devices: Optional[str], resume: bool,
         budget: dict[str, Any]) -> dict:
    from orchestrator.core.config import Settings

    settings = Settings.load()
    on_event, say = _recorder(settings.home, session_id)
    if resume:
        from orchestrator.programs import session as programs

        if programs.is_program(session_id, settings):
            return programs.resume(session_id, devices=devices, say=say)
        from orchestrator.agent import runner

        return runner.resume(session_id, devices=devices, on_event=on_event, **budget)
    if "program" in config:
        from orchestrator.programs.session import ProgramConfig, start

        return start(ProgramConfig.from_dict(config), session_id=session_id, devices=devices, say=say)
    from orchestrator.agent import runner
    from orchestrator.agent.session import SessionConfig

    return runner.start(SessionConfig.from_dict(config), session_id=session_id, devices=devices,
                        on_event=on_event)


def main(argv: list[str]) -> None:
    """The background session process (see the module docstring for its arguments)."""
    # Started from a background shell, SIGINT may be ignored (and that is inherited): make it Ctrl-C again.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    resume = argv[0] == "--resume"
    if resume:
        config, session_id = {}, argv[1]
        devices = argv[2] if len(argv) > 2 and argv[2] else None
        budget = json.loads(argv[3]) if len(argv) > 3 else {}
    else:
        config, session_id = json.loads(argv[0]), argv[1]
        devices, budget = (argv[2] if len(argv) > 2 and argv[2] else None), {}
    summary = _run(config, session_id, devices, resume, budget)
    print(json.dumps(summary, default=str), flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        print("session interrupted; resume it with `autoresearch resume`", file=sys.stderr)
        sys.exit(130)
