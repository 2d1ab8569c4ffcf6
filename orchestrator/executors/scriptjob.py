"""The job-side wrapper of a config-file experiment: fill in the command, run it, read its metric lines.

    python -m orchestrator.executors.scriptjob PLAN_JSON        (the argv `ExperimentSpec.argv()` writes)

When the attempt starts, the plan's `run` template gets the job's parameters (AUTORESEARCH_PARAMS plus the
plan's fixed ones, under the script's names), its checkpoint dir and its id (`experiments.command.render`);
`python` at its head is the interpreter running this wrapper. The command runs under `/bin/sh` in the job's
cwd (the toml's folder) and its output passes through unchanged.

Resuming: with a `resume` flag in the plan and a checkpoint dir that holds anything of the script's, the flag
(its placeholders filled in as in `run`) is added. A script may also resume by itself from what it left there
(the Trainer's `get_last_checkpoint(output_dir)`): either way the report count continues where the last attempt
left it, so progress steps never restart at 1. An empty checkpoint dir is a start from scratch, and the log says
so. This wrapper's own bookkeeping lives in `.autoresearch-*` files there.

The metric: every output line matching the pattern (default `^<metric>: <number>`; `orchestrator.core.metriclines`)
is a progress report at its step, recorded as it comes (`orchestrator.core.outputmetrics`, from where readers log it
to the job's MLflow run, so ASHA sees it); the last is the result. A script that logs the metric to MLflow
itself (the runtime, or plain `mlflow.log_metric` in the inherited MLFLOW_RUN_ID) keeps its own; one whose
logger made a run of its own has that run's metrics copied into the job's (`orchestrator.executors.ownruns`).
A run that exits 0 with neither exits 1 with that reason (what the job's run holds, and how to connect the
script's logger): no result is ever made up. Standard library only: a job pays no MLflow import for its metric
unless its script made runs of its own.
Population-based training: with a `steps` parameter and a resume flag in the plan, a PBT member or a replayed
schedule runs as a chain of resumed segments, each reported once, at its end (`orchestrator.executors.segments`).

Sharing a GPU: a script that runs out of GPU memory (torch's "CUDA out of memory" line in its output) while the
job holds a share of a GPU gets what the runtime gives its own jobs: the out-of-memory marker and exit 75, so the
service runs it again alone on a whole GPU without spending an attempt.

The wrapper shares the job's process group: the queue's SIGTERM reaches the script, and the wrapper waits for
it and exits with its code.

Warm: when this wrapper was itself forked from the local executor's warm pool (torch and the runtime are
imported here) and the command is this environment's Python running a file or a module plainly, the script is
forked from this process instead of started through `/bin/sh`, set up as a fresh interpreter would be
(`executors.local.warmpool.Become`); the log's `running:` line then ends with `(warm)`.
"""

from __future__ import annotations

import json
import os
import re
import time
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import common
from experiments.command import exec_form, expand, render, script_params, with_interpreter
from orchestrator.executors import ownruns, segments
from orchestrator.executors.local import warmpool
from orchestrator.executors.local.warmstart import first_path, python_target, shadowed
from orchestrator.core import outputmetrics
from orchestrator.core.metriclines import DEFAULT_PATTERN, LineReader, compile_pattern
from orchestrator.core.schemalock import sqlite_path
from runtime import gpushare, protocol
from runtime.errors import RuntimeJobError

STATE = ".autoresearch-attempts.json"  # attempts started and reports read, kept in the checkpoint dir
NO_RESULT_EXIT = 1
TEMPFAIL_EXIT = 75  # a segment cut short by SIGTERM although its script exited 0: not finished
TERMINATED: list[bool] = []  # SIGTERM reached the wrapper of a run in segments
OOM = re.compile(r"CUDA out of memory|OutOfMemoryError")  # how torch says a CUDA allocation failed
OOM_SEEN: list[str] = []  # the script's first line saying it ran out of GPU memory


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
    # The queue signals the whole group; the command gets SIGTERM itself and decides how to stop.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    if segments.wanted(plan, os.environ):
        signal.signal(signal.SIGTERM, lambda *_: TERMINATED.append(True))
        return _in_segments(plan, params, checkpoint_dir, state)
    theirs = [p for p in checkpoint_dir.iterdir() if not p.name.startswith(".autoresearch")]
    values = script_params(params, plan.get("fixed") or {}, plan.get("seed"))
    command = _command(plan, values, checkpoint_dir)
    start = int(state.get("reports", 0)) if theirs else 0  # progress continues where the last attempt's ended
    if plan.get("resume") and theirs:
        flag = _command({**plan, "run": plan["resume"]}, values, checkpoint_dir)
        command = f"{command} {flag}"
        say(f"resuming from the checkpoint dir ({len(theirs)} entries): added {flag!r}")
    elif state.get("attempts") and theirs:
        left = ", ".join(sorted(p.name for p in theirs)[:3]) + (", ..." if len(theirs) > 3 else "")
        say(f"attempt {state['attempts'] + 1}: no resume flag; the checkpoint dir holds what the script left there "
            f"({left}), which it resumes from if it does so by itself (progress reports continue after {start})")
    elif state.get("attempts"):
        say(f"attempt {state['attempts'] + 1} starts again from scratch: its checkpoint dir is empty")
    _write_state(checkpoint_dir, attempts=int(state.get("attempts", 0)) + 1, reports=start)
    reader = LineReader(compile_pattern(plan.get("pattern") or DEFAULT_PATTERN, plan["metric"]), start=start)
    code = _run(command, values, reader, checkpoint_dir)
    _write_state(checkpoint_dir, attempts=int(state.get("attempts", 0)) + 1, reports=reader.count)
    adopted = ownruns.adopt(dict(os.environ))
    if adopted.runs:
        say(f"the script made MLflow runs of its own ({', '.join(f'{r} in {e!r}' for r, e in adopted.runs)}): "
            f"copied {', '.join(adopted.copied) or 'no new metric'} into the job's run and deleted them; "
            "a logger given the job's run (MLFLOW_RUN_ID) logs there directly")
    if code != 0 and OOM_SEEN and _sharing():
        return _out_of_shared_memory(checkpoint_dir)
    if code == 0 and not reader.values and not logged_by_script(plan["metric"]):
        has = ownruns.job_metrics(dict(os.environ))
        say(f"no result: the run printed no line matching the metric pattern and logged no {plan['metric']} to "
            f"MLflow (the job's run {os.environ.get('MLFLOW_RUN_ID')} has {', '.join(has) or 'no metric'}"
            + (f"; the runs it made had {', '.join(adopted.copied) or 'none'}" if adopted.runs else "")
            + f"); log {plan['metric']} to the run in MLFLOW_RUN_ID (Lightning: MLFlowLogger(run_id=...); the "
            "Trainer: report_to=mlflow), or set pattern to the line the script prints")
        return NO_RESULT_EXIT
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


def _sharing() -> bool:
    """Whether this job holds a share of a GPU (the runtime's reading of GPU_SHARE; a bad value: no)."""
    try:
        share, _ = gpushare.read_env()
    except RuntimeJobError:
        return False
    return share is not None and share < 1


def _out_of_shared_memory(checkpoint_dir: Path) -> int:
    """A script that knows nothing of the runtime ran out of GPU memory beside other jobs: what the runtime's
    `JobContext` does for its own jobs (the marker, then exit 75), so the service runs it again alone."""
    attempt = int(os.environ.get(protocol.ATTEMPT) or 0)
    tmp = checkpoint_dir / f".{protocol.OOM_FILE}.tmp"
    tmp.write_text(json.dumps({"attempt": attempt, "at": time.time(), "error": OOM_SEEN[0][:500]}))
    os.replace(tmp, checkpoint_dir / protocol.OOM_FILE)
    say(f"out of GPU memory on a shared GPU (share {os.environ.get(protocol.GPU_SHARE)}); asking to run alone")
    return protocol.EX_TEMPFAIL


def _command(plan: dict, values: dict, checkpoint_dir: Path) -> str:
    return render(plan["run"], plan.get("args") or "--{name}={value}", values, checkpoint_dir=str(checkpoint_dir),
                  job_id=os.environ.get("AUTORESEARCH_JOB_ID", "0"), seed_param=plan.get("seed"),
                  bools=tuple(plan.get("bools") or ("True", "False")))


def _run(command: str, values: dict, reader: LineReader, checkpoint_dir: Path, record: bool = True) -> int:
    """Run one command (forked warm when it can be), its output passed through and its metric lines read (each
    recorded as a report, with `record`); its exit code."""
    command = with_interpreter(command, sys.executable)
    env = {**os.environ, "AUTORESEARCH_PARAMS": json.dumps(values), **ownruns.context_env(dict(os.environ))}
    warm = warm_target(command, env)
    say(f"running: {command}" + (" (warm)" if warm else ""))
    if warm is not None:
        proc: subprocess.Popen | Forked = Forked(*warm)
    else:
        proc = subprocess.Popen(["/bin/sh", "-c", exec_form(command)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    out = sys.stdout.buffer
    for raw in iter(proc.stdout.readline, b""):
        out.write(raw)
        out.flush()
        line = raw.decode("utf-8", errors="replace")
        if not OOM_SEEN and OOM.search(line):
            OOM_SEEN.append(line.strip())
        report = reader.feed(line)
        if report is not None and record:
            outputmetrics.append(checkpoint_dir, *report)
    return proc.wait()


def _in_segments(plan: dict, params: dict, checkpoint_dir: Path, state: dict) -> int:
    """A PBT member or a schedule's replay as a chain of resumed segments (`orchestrator.executors.segments`)."""
    steps, fixed, seed = plan["steps"], plan.get("fixed") or {}, plan.get("seed")
    total = int(script_params(params, fixed, seed)[steps])
    every = int(os.environ.get(common.CHECKPOINT_EVERY_ENV) or 0) or None
    schedule = common.schedule()
    run_dir = checkpoint_dir / segments.RUN
    at = state.get("at")
    if at is None:
        at = segments.seed_from_fork(run_dir, os.environ.get(common.INIT_CHECKPOINT_ENV)) or 0
        if at:
            say(f"starting from the fork's checkpoint at step {at}")
    attempts = int(state.get("attempts", 0)) + 1
    _write_state(checkpoint_dir, attempts=attempts, at=at, **({"last": state["last"]} if "last" in state else {}))
    run_dir.mkdir(exist_ok=True)
    done = dict(outputmetrics.read(checkpoint_dir))
    for end in [b for b in segments.boundaries(total, every, schedule) if b > at]:
        values = script_params(common.params_at(params, schedule, at), fixed, seed)
        values[steps] = end
        command = _command(plan, values, run_dir)
        if any(run_dir.iterdir()):
            command = f"{command} {plan['resume']}"
        say(f"segment to step {end} of {total}" + (f", resuming from step {at}" if at else ", from scratch"))
        reader = LineReader(compile_pattern(plan.get("pattern") or DEFAULT_PATTERN, plan["metric"]))
        code = _run(command, values, reader, checkpoint_dir, record=False)  # one report, at the segment's end
        # The segment's last value so far: a script resumed at its stop may train no step and print nothing.
        last = reader.values[-1][1] if reader.values else state.get("last") if state.get("at") == at else None
        state = {"at": at, "last": last} if last is not None else {"at": at}
        _write_state(checkpoint_dir, attempts=attempts, **state)
        if TERMINATED:  # stopped (a cancel, a preemption) even if the script exited 0: not done
            say(f"the segment to step {end} was stopped; a next attempt resumes it from the script's checkpoint")
            # The stop's own signal ended the script (it came before the script's handler, while it started):
            # its last checkpoint stands, so this is a stop like any other, not a failure.
            killed = code < 0 or code == 128 + signal.SIGTERM
            return TEMPFAIL_EXIT if killed or code == 0 else code
        if code != 0:
            return 128 - code if code < 0 else code
        if last is not None and end not in done:
            outputmetrics.append(checkpoint_dir, end, last)
        elif last is None and end not in done and not logged_by_script(plan["metric"]):
            say(f"no result: the segment to step {end} printed no line matching the metric pattern")
            return NO_RESULT_EXIT
        if not any(run_dir.iterdir()):
            say(f"no checkpoint: the script left nothing in {run_dir} at step {end}; under PBT it must save one "
                f"when it stops at {steps} (and resume from it with {plan['resume']!r})")
            return NO_RESULT_EXIT
        if every and end < total and end % every == 0:
            segments.snapshot(checkpoint_dir, end)
        at = end
        state = {"at": at}
        _write_state(checkpoint_dir, attempts=attempts, at=at)
    return 0


def warm_target(command: str, env: dict[str, str]) -> tuple[dict, dict[str, str]] | None:
    """What to fork for `command`, and its environment, when this wrapper runs warm and the command is a simple
    run of this environment's Python (no pipeline or list, no interpreter options, no other copy of a module
    imported here first on its path), else None: it runs through /bin/sh. Its words and leading assignments
    are expanded as /bin/sh would (`$MLFLOW_RUN_ID`, quotes, `OMP_NUM_THREADS=1 python ...`), so a job sees
    the same argv and environment warm or cold."""
    if not warmpool.STARTED_WARM:
        return None
    try:
        argv, assigned = expand(command, env)
    except (ValueError, OSError, subprocess.SubprocessError):
        return None
    env = {**env, **assigned}
    target, _ = python_target(argv, env)
    if target is None or shadowed(first_path(target, os.getcwd()), warmpool.imported()):
        return None
    return target, env


class Forked:
    """The command forked from this (warm) process, its output on a pipe: what `subprocess.Popen` offers."""

    def __init__(self, target: dict, env: dict[str, str]):
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(write, 1)
            os.dup2(write, 2)
            os.close(devnull)
            os.close(read)
            os.close(write)
            raise warmpool.Become({"warm": target}, env)  # (caught at this module's top level: it runs there)
        os.close(write)
        self.stdout = os.fdopen(read, "rb")

    def wait(self) -> int:
        """Its exit code (negative: the signal that killed it), as Popen's."""
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


def _read_state(checkpoint_dir: Path) -> dict:
    try:
        data = json.loads((checkpoint_dir / STATE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_state(checkpoint_dir: Path, **state: float) -> None:
    tmp = checkpoint_dir / f"{STATE}.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, checkpoint_dir / STATE)


def logged_by_script(metric: str) -> bool:
    """Whether the job's MLflow run has `metric` (True when the job has no run to look in)."""
    run_id, uri = os.environ.get("MLFLOW_RUN_ID"), os.environ.get("MLFLOW_TRACKING_URI", "")
    if not run_id:
        return True
    path = sqlite_path(uri)
    if path is not None:  # the default store: one indexed read instead of seconds of MLflow import
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30) as db:
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
    _script: warmpool.Become | None = None
    try:
        _code = main()
    except warmpool.Become as become:  # the forked script's process: it runs here, outside the handler
        _script = become.with_traceback(None)
    if _script is None:
        sys.exit(_code)
    _script.run()
