"""The process an agent session runs in when it is started from outside (MCP `start_session`):
`python -m orchestrator.faces.detached CONFIG_JSON SESSION_ID [DEVICES]`, started by
`orchestrator.agent.background.start_session`. It prints what `autoresearch start` prints, into the session's log."""

from __future__ import annotations

import json
import signal
import sys


def main(argv: list[str]) -> None:
    """The detached session process: `python -m orchestrator.faces.detached CONFIG_JSON SESSION_ID [DEVICES]`."""
    from orchestrator.agent import runner
    from orchestrator.agent.session import SessionConfig
    from orchestrator.faces.cli.agent import progress as print_progress

    # Started from a background shell, SIGINT may be ignored (and that is inherited): make it Ctrl-C again.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    config = SessionConfig.from_dict(json.loads(argv[0]))
    summary = runner.start(config, session_id=argv[1], devices=argv[2] if len(argv) > 2 else None,
                           on_event=print_progress)
    print(json.dumps(summary, default=str), flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        print("session interrupted; resume it with `autoresearch resume`", file=sys.stderr)
        sys.exit(130)
