"""Slurm jobs as the queue knows them: the Slurm commands (`sbatch`, `squeue`, `scontrol`, `scancel`, `sinfo`)
behind small functions, an attempt's Slurm job name, the handle recorded in the job's `proc_start`
(`slurm:SLURMID`) and the wrapper script every attempt runs under.

The wrapper (bash) runs the job in its own process group in the background and waits for it, so that:
- a SIGTERM to the batch shell (`scancel --batch --signal=TERM` for our stops, `--signal=B:TERM@GRACE`
  before Slurm's time limit) is forwarded to the job's whole process group, once;
- the job's exit code (75 included) is written to the attempt's exit file under the home before the
  wrapper exits: no slurmdbd is needed to learn it, and a restarted service reads it there;
- a batch job that Slurm requeued and starts again (`SLURM_RESTART_COUNT` > 0) does not run the job a
  second time under the same attempt: it exits 75 at once and the queue, not Slurm, gives it a new attempt.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from orchestrator.queue.models import Job

PREFIX = "slurm:"
NAME_PREFIX = "autoresearch-"
EXIT_VAR = "AUTORESEARCH_SLURM_EXIT"
# Slurm states after which the job never runs again (squeue %T); everything else may still run.
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
            "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"}
# Ended for reasons outside the job: requeued in our queue without spending an attempt.
NOT_THE_JOBS_FAULT = {"NODE_FAIL", "BOOT_FAIL", "PREEMPTED", "REVOKED"}

WRAPPER = f"""#!/bin/bash
# autoresearch: one attempt of a job as a Slurm batch job (orchestrator.executors.slurm.jobs)
ef=${EXIT_VAR}; unset {EXIT_VAR}
record() {{ printf '%s' "$1" > "$ef.tmp" && mv -f "$ef.tmp" "$ef"; }}
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then
  printf '\\n=== autoresearch: slurm started this attempt again (restart %s): back to the queue\\n' \\
    "$SLURM_RESTART_COUNT"
  record 75; exit 75
fi
cd -- "$1" 2>/dev/null || cd; shift
set -m  # the job gets a process group of its own, which the stop signals reach as one
"$@" < /dev/null &
child=$!
got=0
trap 'got=1; kill -TERM -- -$child 2>/dev/null || kill -TERM $child 2>/dev/null' TERM
trap 'got=1; kill -INT -- -$child 2>/dev/null || kill -INT $child 2>/dev/null' INT
wait $child; rc=$?
# A trap interrupts `wait` (status 128+N); wait again for the job's own code (127: it was reaped already).
while [ $got = 1 ]; do got=0; wait $child; again=$?; [ $again = 127 ] && break; rc=$again; done
record "$rc"
printf '\\n=== autoresearch: exit code %s\\n' "$rc"
exit $rc
"""


class SlurmError(RuntimeError):
    """A Slurm command failed (its first line of error), or Slurm is not installed."""


@dataclass(frozen=True)
class Row:
    """One Slurm job as `squeue` lists it."""

    slurm_id: str
    restarts: int
    state: str
    reason: str
    name: str

    @property
    def terminal(self) -> bool:
        """Whether this Slurm job will never run again."""
        return self.state in TERMINAL


def job_name(job: Job, attempt: Optional[int] = None) -> str:
    """The Slurm job name of an attempt: derived from the job alone, unique across queues sharing one
    cluster thanks to a tag of the job's id and submit time (how an unrecorded attempt is found again)."""
    tag = hashlib.sha1(f"{job.id}:{job.submitted_at!r}".encode()).hexdigest()[:8]
    return f"{NAME_PREFIX}{job.id}-{job.attempts if attempt is None else attempt}-{tag}"


def handle(slurm_id: str) -> str:
    """The `proc_start` recorded for an attempt running as Slurm job `slurm_id`."""
    return f"{PREFIX}{slurm_id}"


def parse_handle(proc_start: Optional[str]) -> Optional[str]:
    """The Slurm job id in a job's `proc_start` (`slurm:ID`), None if it is not Slurm's."""
    if not proc_start or not proc_start.startswith(PREFIX):
        return None
    return proc_start[len(PREFIX):] or None


def run(argv: Sequence[str], *, env: Optional[dict[str, str]] = None, timeout: float = 30.0) -> str:
    """Run a Slurm command; its stdout, or SlurmError with its first line of error."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"`{argv[0]}` is not installed: --executor slurm needs the Slurm client commands")
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{argv[0]}` did not answer within {timeout:.0f}s") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        raise SlurmError(lines[0] if lines else f"`{argv[0]}` exited {done.returncode}")
    return done.stdout


def write_wrapper(path: Path) -> Path:
    """Write the wrapper script at `path` (when it differs) and return it."""
    if not path.exists() or path.read_text() != WRAPPER:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(WRAPPER)
        tmp.chmod(0o755)
        os.replace(tmp, path)
    return path


def submit(options: Sequence[str], wrapper: Path, args: Sequence[str], env: dict[str, str]) -> str:
    """`sbatch` the wrapper with `args` under `options`; the Slurm job id. sbatch exports its own
    environment (`env`) to the job."""
    out = run(["sbatch", "--parsable", *options, str(wrapper), *args], env=env)
    return out.strip().split(";")[0]


def queue(slurm_ids: Sequence[str] = (), *, name: Optional[str] = None) -> dict[str, Row]:
    """The Slurm jobs with these ids (or this name) that the controller still knows, finished ones included."""
    argv = ["squeue", "-h", "-t", "all", "-O", "JobID:|,RestartCnt:|,State:|,Reason:|,Name:|"]
    if slurm_ids:
        argv += ["-j", ",".join(slurm_ids)]
    if name:
        argv += ["-n", name]
    try:
        out = run(argv)
    except SlurmError as exc:
        if "Invalid job id" in str(exc):  # every id asked for was purged already
            return {}
        raise
    rows = {}
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) < 5:
            continue
        rows[parts[0]] = Row(parts[0], int(parts[1] or 0), parts[2], parts[3], parts[4])
    return rows


def show(slurm_id: str) -> dict[str, str]:
    """`scontrol show job` of one Slurm job as a dict (empty when the controller forgot it)."""
    try:
        out = run(["scontrol", "-o", "show", "job", slurm_id])
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return {}
        raise
    fields = {}
    for word in out.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def exit_of_show(fields: dict[str, str]) -> Optional[int]:
    """The exit code in `scontrol show job`'s ExitCode=CODE:SIGNAL (negative: killed by that signal)."""
    code, _, sig = fields.get("ExitCode", "").partition(":")
    try:
        code_i, sig_i = int(code), int(sig or 0)
    except ValueError:
        return None
    return -sig_i if sig_i else code_i


def cancel(slurm_id: str, sig: Optional[int] = None, *, steps: bool = False) -> None:
    """`scancel`: with `sig`, that signal to the batch shell only (the wrapper forwards it to the job), or with
    `steps` to every job step on every node instead (a multi-node job's launchers and ranks); without `sig`,
    Slurm's own end of the job (SIGTERM to every process, SIGKILL after its KillWait)."""
    argv = ["scancel"]
    if sig is not None:
        argv += [] if steps else ["--batch"]
        argv += [f"--signal={signal.Signals(sig).name.removeprefix('SIG')}"]
    try:
        run([*argv, slurm_id])
    except SlurmError as exc:
        text = str(exc)
        if "already completing" in text or "Invalid job id" in text or "completed" in text.lower():
            return  # nothing left to signal
        raise


def partition_nodes(partition: Optional[str]) -> list[tuple[str, int, int]]:
    """(node, CPUs, GPUs) of each node of `partition` (default: the cluster's default partition)."""
    argv = ["sinfo", "-h", "-N", "-o", "%N|%c|%G|%P"]
    if partition:
        argv += ["-p", partition]
    nodes: dict[str, tuple[str, int, int]] = {}
    for line in run(argv).splitlines():
        node, cpus, gres, part = (line.split("|") + ["", "", "", ""])[:4]
        if not partition and not part.endswith("*"):
            continue  # the default partition is starred
        nodes[node] = (node, int(cpus or 0), gpus_in(gres))
    return list(nodes.values())


def gpus_in(gres: str) -> int:
    """GPUs in a node's gres string, e.g. `gpu:a100:4(S:0-1),shard:8` -> 4."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def check_submit(options: Sequence[str]) -> None:
    """Ask the controller whether a one-CPU job under `options` (partition, account, qos) would be
    accepted, without submitting it (`sbatch --test-only`)."""
    run(["sbatch", "--test-only", *options, "-n1", "--wrap", "true"])
