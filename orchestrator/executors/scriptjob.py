"""The job-side wrapper of a config-file experiment: fill in the command, run it, read its metric lines.

    python -m orchestrator.executors.scriptjob PLAN_JSON        (the argv `ExperimentSpec.argv()` writes)

When the attempt starts, the plan's `run` template gets the job's parameters (AUTORESEARCH_PARAMS plus the
plan's fixed ones, under the script's names), its checkpoint dir and its id (`experiments.command.render`);
`python` at its head is the interpreter running this wrapper. The command runs under `/bin/sh` in the job's
cwd (the toml's folder) and its output passes through unchanged.

Resuming: with a `resume` flag in the plan and a checkpoint dir that holds anything of the script's, the flag is
added and the report count continues. Without one, a second attempt (after a preemption) starts again from
scratch, and the log says so. This wrapper's own bookkeeping lives in `.autoresearch-*` files there.

The metric: every output line matching the pattern (default `^<metric>: <number>`; `orchestrator.core.metriclines`)
is a progress report at its step, logged to the job's MLflow run (MLFLOW_RUN_ID) as it comes, so ASHA sees it;
the last is the result. A script that logs the metric to MLflow itself (the runtime, or plain
`mlflow.log_metric` in the inherited run) is left to do so: nothing is logged for it. A run that exits 0 with
neither exits 1 with that reason: no result is ever made up. MLflow is imported only at the first report.
The wrapper shares the job's process group: the queue's SIGTERM reaches the script, and the wrapper waits for
it and exits with its code.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from experiments.command import render, script_params, with_interpreter
from orchestrator.core.metriclines import DEFAULT_PATTERN, LineReader, compile_pattern

STATE = ".autoresearch-attempts.json"  # attempts started and reports read, kept in the checkpoint dir
NO_RESULT_EXIT = 1
SOURCE_TAG = "autoresearch.metric_source"


def say(message: str) -> None:
    """A line of the wrapper's own in the job's log."""
    print(f"autoresearch: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m orchestrator.executors.scriptjob PLAN_JSON", file=sys.stderr)
        return 2
    plan = json.loads(args[0])
    params = json.loads(os.environ.get("AUTORESEARCH_PARAMS") or "{}")
    checkpoint_dir = Path(os.environ.get("AUTORESEARCH_CHECKPOINT_DIR") or tempfile.mkdtemp(prefix="autoresearch-"))
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    state = _read_state(checkpoint_dir)
    theirs = [p for p in checkpoint_dir.iterdir() if not p.name.startswith(".autoresearch")]
    values = script_params(params, plan.get("fixed") or {}, plan.get("seed"))
    command = render(plan["run"], plan.get("args") or "--{name}={value}", values, checkpoint_dir=str(checkpoint_dir),
                     job_id=os.environ.get("AUTORESEARCH_JOB_ID", "0"), seed_param=plan.get("seed"))
    start = 0
    if plan.get("resume") and theirs:
        command = f"{command} {plan['resume']}"
        start = int(state.get("reports", 0))
        say(f"resuming from the checkpoint dir ({len(theirs)} entries): added {plan['resume']!r}")
    elif state.get("attempts"):
        why = "it declares no resume flag" if not plan.get("resume") else "its checkpoint dir is empty"
        say(f"attempt {state['attempts'] + 1} starts again from scratch: {why}")
    _write_state(checkpoint_dir, attempts=int(state.get("attempts", 0)) + 1, reports=start)
    command = with_interpreter(command, sys.executable)
    say(f"running: {command}")
    reader = LineReader(compile_pattern(plan.get("pattern") or DEFAULT_PATTERN, plan["metric"]), start=start)
    logger = MetricLogger(plan["metric"]) if os.environ.get("MLFLOW_RUN_ID") else None
    # The queue signals the whole group; the command gets SIGTERM itself and decides how to stop.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    env = {**os.environ, "AUTORESEARCH_PARAMS": json.dumps(values)}
    proc = subprocess.Popen(["/bin/sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)
    out = sys.stdout.buffer
    for raw in iter(proc.stdout.readline, b""):
        out.write(raw)
        out.flush()
        report = reader.feed(raw.decode("utf-8", errors="replace"))
        if report is not None and logger is not None:
            logger.put(report)
    code = proc.wait()
    if logger is not None:
        logger.close()
    _write_state(checkpoint_dir, attempts=int(state.get("attempts", 0)) + 1, reports=reader.count)
    if code == 0 and not reader.values and not logged_by_script(plan["metric"]):
        say(f"no result: the run printed no line matching the metric pattern and logged no {plan['metric']} "
            "to MLflow")
        return NO_RESULT_EXIT
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


def _read_state(checkpoint_dir: Path) -> dict:
    try:
        data = json.loads((checkpoint_dir / STATE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_state(checkpoint_dir: Path, **state: int) -> None:
    tmp = checkpoint_dir / f"{STATE}.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, checkpoint_dir / STATE)


class MetricLogger:
    """Logs output-line reports to the job's MLflow run from a thread (the output never waits for MLflow)."""

    def __init__(self, metric: str):
        self.metric = metric
        self.run_id = os.environ["MLFLOW_RUN_ID"]
        self.items: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="metric-logger", daemon=True)
        self.thread.start()

    def put(self, report: tuple[int, float]) -> None:
        """Queue one (step, value) report."""
        self.items.put(report)

    def close(self) -> None:
        """Log what is queued, then stop."""
        self.items.put(None)
        self.thread.join()

    def _loop(self) -> None:
        client, ours = None, None
        while True:
            item = self.items.get()
            if item is None:
                return
            try:
                if client is None:
                    from mlflow.tracking import MlflowClient

                    client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
                    run = client.get_run(self.run_id)
                    # The script's own MLflow metric wins; an earlier attempt of ours tagged the run.
                    ours = run.data.tags.get(SOURCE_TAG) == "output" or self.metric not in run.data.metrics
                    if ours:
                        client.set_tag(self.run_id, SOURCE_TAG, "output")
                if ours:
                    step, value = item
                    client.log_metric(self.run_id, self.metric, value, timestamp=int(time.time() * 1000), step=step)
            except Exception as exc:  # a tracking hiccup must not kill the training it only observes
                say(f"could not log {self.metric} to MLflow: {str(exc).splitlines()[0] if str(exc) else exc!r}")


def logged_by_script(metric: str) -> bool:
    """Whether the job's MLflow run has `metric` (True when the job has no run to look in)."""
    run_id, uri = os.environ.get("MLFLOW_RUN_ID"), os.environ.get("MLFLOW_TRACKING_URI", "")
    if not run_id:
        return True
    if uri.startswith("sqlite:///"):  # the default store: one indexed read instead of seconds of MLflow import
        try:
            with sqlite3.connect(f"file:{uri[len('sqlite:///'):]}?mode=ro", uri=True, timeout=30) as db:
                return db.execute("SELECT 1 FROM metrics WHERE run_uuid = ? AND key = ? LIMIT 1",
                                  (run_id, metric)).fetchone() is not None
        except sqlite3.Error:
            pass
    try:
        from mlflow.tracking import MlflowClient

        return metric in MlflowClient(tracking_uri=uri or None).get_run(run_id).data.metrics
    except Exception:
        return True  # cannot tell: let the agent judge the run by what MLflow shows


if __name__ == "__main__":
    sys.exit(main())
