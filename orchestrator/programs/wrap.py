"""The job-side wrapper of a program run: pass output through, read `<metric>: <number>` lines, log them.

    python -m orchestrator.programs.wrap --metric val_bpb [--pattern REGEX] -- python train.py

Unmodified scripts (karpathy/autoresearch prints `val_bpb: 0.9979`) then report to MLflow like runtime jobs:
each matching line becomes a point of the metric in the job's run (`MLFLOW_RUN_ID`), logged when the command
ends with exit 0 (a crashed run's partial numbers are not its result). The wrapper shares the job's process
group, so the queue's SIGTERM reaches the command directly; the wrapper waits for it and exits with its code.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from orchestrator.programs.spec import DEFAULT_PATTERN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metric", required=True)
    parser.add_argument("--pattern", default=DEFAULT_PATTERN)
    parser.add_argument("--sandbox", metavar="WORKTREE", default=None,
                        help="run under bubblewrap with this worktree writable")
    parser.add_argument("--protect", action="append", default=[], help="a file bound read-only (repeatable)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    if args.sandbox:
        from orchestrator.programs import sandbox

        command = sandbox.command(command, cwd=Path.cwd(), writable=sandbox.writable_dirs(Path(args.sandbox)),
                                  protected=[Path(p) for p in args.protect])
    regex = re.compile(args.pattern.replace("{metric}", re.escape(args.metric)))
    # The queue signals the whole group; the command gets SIGTERM itself and decides how to stop.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError as exc:
        print(f"autoresearch: cannot run {command[0]}: {exc}", flush=True)
        return 127
    values: list[float] = []
    out = sys.stdout.buffer
    for raw in iter(proc.stdout.readline, b""):
        out.write(raw)
        out.flush()
        m = regex.search(raw.decode("utf-8", errors="replace").rstrip("\n"))
        if m:
            try:
                values.append(float(m.group(1)))
            except (IndexError, ValueError):
                pass
    code = proc.wait()
    if code == 0 and values and os.environ.get("MLFLOW_RUN_ID"):
        _log(args.metric, values)
    if code < 0:  # killed by a signal: report it the way a shell would
        return 128 - code
    return code


def _log(metric: str, values: list[float]) -> None:
    import time

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
    now = int(time.time() * 1000)
    client.log_batch(os.environ["MLFLOW_RUN_ID"],
                     metrics=[Metric(metric, v, now, i) for i, v in enumerate(values)])


if __name__ == "__main__":
    sys.exit(main())
