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
import threading
from pathlib import Path

from orchestrator.programs.spec import DEFAULT_PATTERN

TIME_LIMIT_EXIT = 124  # as timeout(1)
TIME_LIMIT_MESSAGE = "time limit exceeded"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metric", required=True)
    parser.add_argument("--pattern", default=DEFAULT_PATTERN)
    parser.add_argument("--sandbox", metavar="WORKTREE", default=None,
                        help="run under bubblewrap with this worktree writable")
    parser.add_argument("--protect", action="append", default=[], help="a file bound read-only (repeatable)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds before the run is stopped")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
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
    # MLflow's import and store set-up take seconds; doing them while the command runs keeps them off the
    # time the job holds its device.
    client: list = []
    warm = threading.Thread(target=lambda: client.append(_client()), daemon=True)
    if os.environ.get("MLFLOW_RUN_ID"):
        warm.start()
    timed_out = threading.Event()
    if args.time_limit:
        threading.Thread(target=_limit, args=(proc, args.time_limit, args.grace, timed_out), daemon=True).start()
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
    if timed_out.is_set():
        print(f"autoresearch: {TIME_LIMIT_MESSAGE} ({args.time_limit:g} s); the run was stopped", flush=True)
        return TIME_LIMIT_EXIT
    if code == 0 and values and os.environ.get("MLFLOW_RUN_ID"):
        warm.join()
        _log(client[0] if client else _client(), args.metric, values)
    if code < 0:  # killed by a signal: report it the way a shell would
        return 128 - code
    return code


def _limit(proc: subprocess.Popen, limit: float, grace: float, flag: threading.Event) -> None:
    """SIGTERM the job's process group once `limit` has passed, SIGKILL the command after `grace`."""
    try:
        proc.wait(timeout=limit)
        return
    except subprocess.TimeoutExpired:
        pass
    flag.set()
    try:
        os.killpg(os.getpgid(0), signal.SIGTERM)  # the wrapper ignores it; the command and its children get it
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()


def _client():
    from mlflow.entities import Metric  # noqa: F401  (imported here so that _log finds it loaded)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
    client.get_run(os.environ["MLFLOW_RUN_ID"])  # opens the store now, not after the command
    return client


def _log(client, metric: str, values: list[float]) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(os.environ["MLFLOW_RUN_ID"],
                     metrics=[Metric(metric, v, now, i) for i, v in enumerate(values)])


if __name__ == "__main__":
    sys.exit(main())
