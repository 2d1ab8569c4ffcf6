"""The job-side wrapper of a program run: pass output through, read `<metric>: <number>` lines, report them.

    python -m orchestrator.programs.wrap --metric val_bpb [--pattern REGEX] [--log] -- python train.py

Unmodified scripts (karpathy/autoresearch prints `val_bpb: 0.9979`) then report like runtime jobs. Each matching
line of a queue job is recorded as it appears, in the one result format every job-side wrapper writes
(`orchestrator.core.outputmetrics`: `.autoresearch-metric.jsonl` in the job's checkpoint directory, as the
config-file wrapper `orchestrator.executors.scriptjob` does), from where the session logs them to the job's MLflow
run; a session takes them only from a job that SUCCEEDED (a crashed run's partial numbers are not its result).
`--log` logs them to the run (`MLFLOW_RUN_ID`) from here instead, after an exit 0. The default keeps MLflow's
seconds of import and store set-up off the time the job holds its device.
The wrapper shares the job's process group, so the queue's SIGTERM reaches the command directly; the wrapper
waits for it and exits with its code. `--time-limit` stops the command (SIGTERM, SIGKILL after `--grace`).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from orchestrator.core import outputmetrics
from orchestrator.core.metriclines import DEFAULT_PATTERN, LineReader, compile_pattern

TIME_LIMIT_EXIT = 124  # as timeout(1)
TIME_LIMIT_MESSAGE = "time limit exceeded"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metric", required=True)
    parser.add_argument("--pattern", default=DEFAULT_PATTERN)
    parser.add_argument("--sandbox", metavar="WORKTREE", default=None,
                        help="run under bubblewrap with this worktree writable")
    parser.add_argument("--protect", action="append", default=[], help="a file bound read-only (repeatable)")
    parser.add_argument("--hide", action="append", default=[], help="a holdout file or folder hidden (repeatable)")
    parser.add_argument("--log", action="store_true", help="log the values to MLFLOW_RUN_ID from here")
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
                                  protected=[Path(p) for p in args.protect], hidden=[Path(p) for p in args.hide])
    reader = LineReader(compile_pattern(args.pattern, args.metric))
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
    if args.log and os.environ.get("MLFLOW_RUN_ID"):
        warm.start()
    timed_out = threading.Event()
    if args.time_limit:
        threading.Thread(target=_limit, args=(proc, args.time_limit, args.grace, timed_out), daemon=True).start()
    out = sys.stdout.buffer
    record = os.environ.get("AUTORESEARCH_CHECKPOINT_DIR") if not args.log else None  # a queue job's reports
    for raw in iter(proc.stdout.readline, b""):
        out.write(raw)
        out.flush()
        report = reader.feed(raw.decode("utf-8", errors="replace"))
        if report is not None and record:
            outputmetrics.append(record, *report)
    values = [v for _, v in reader.values]
    code = proc.wait()
    if timed_out.is_set():
        print(f"autoresearch: {TIME_LIMIT_MESSAGE} ({args.time_limit:g} s); the run was stopped", flush=True)
        return TIME_LIMIT_EXIT
    if code == 0 and values and args.log and os.environ.get("MLFLOW_RUN_ID"):
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
        if os.environ.get("AUTORESEARCH_JOB_ID"):
            # A queue job: the group is the job's own, so its whole tree gets SIGTERM as from the queue (this
            # wrapper and the executor's shell ignore it).
            os.killpg(os.getpgid(0), signal.SIGTERM)
        else:  # run by hand: the group may be the caller's; signal the command only
            proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()


def log_tail(path: str | os.PathLike | None, chars: int = 3000) -> str:
    """The last `chars` characters of a job's log ("" when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - chars))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


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
