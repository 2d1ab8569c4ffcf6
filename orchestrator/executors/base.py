"""The executor interface: how the service starts, signals, watches and adopts job processes.

An executor reports each ended attempt as an `Exit` through the `on_exit` callback given to it (from its own
watcher thread). The service owns every state change; executors never touch the store.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from orchestrator.devices import cuda_visible
from orchestrator.queue.models import Job
from runtime import protocol


@dataclass(frozen=True)
class Exit:
    """The end of one attempt: exit code (negative: killed by that signal) and a human detail."""

    job_id: int
    attempt: int
    code: int
    detail: str = ""


@dataclass(frozen=True)
class Launched:
    """What the store records about a started attempt, enough to find it again after a restart."""

    pid: int
    proc_start: Optional[str] = None


OnExit = Callable[[Exit], None]


class Executor(Protocol):
    """Starts jobs somewhere (this host, a Ray cluster) and reports how each attempt ended."""

    name: str

    def inventory(self) -> Optional[list[str]]:
        """Devices the backend itself knows (Ray: the cluster's GPUs), or None to use the --devices spec."""

    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        """Start an attempt of `job` (already STARTING with devices) with the Contract 3 `env`."""

    def signal(self, job: Job, sig: int) -> None:
        """Send `sig` to every process of the job's attempt (no error when it is already gone)."""

    def adopt(self, job: Job) -> bool:
        """After a service restart: watch a job that was running; False when its process is gone (its exit
        is then reported through on_exit right away, from what the attempt recorded)."""

    def close(self) -> None:
        """Stop watching (running jobs keep running; a restarted service adopts them)."""


def job_env(job: Job, *, base: dict[str, str], home: str, tracking_uri: str, heartbeat_file: str) -> dict[str, str]:
    """The Contract 3 environment of an attempt: the service's env, the job's overrides, then the protocol."""
    env = dict(base)
    env.update(job.env or {})
    env.update({
        protocol.JOB_ID: str(job.id),
        protocol.ATTEMPT: str(job.attempts),
        protocol.CHECKPOINT_DIR: job.checkpoint_dir or "",
        protocol.PARAMS: json.dumps(job.params or {}, sort_keys=True),
        protocol.HOME: home,
        protocol.HEARTBEAT_FILE: heartbeat_file,
        protocol.TRACKING_URI: tracking_uri,
        protocol.VISIBLE_DEVICES: cuda_visible(list(job.devices or [])),
        protocol.DEVICE_ORDER: "PCI_BUS_ID",
    })
    if job.mlflow_run_id:
        env[protocol.RUN_ID] = job.mlflow_run_id
    else:
        env.pop(protocol.RUN_ID, None)
    # An API key of the agent's LLM has no business inside a training job.
    env.pop("OPENAI_API_KEY", None)
    return env


def job_argv(job: Job) -> list[str]:
    """The argv to run: multi-device jobs go through torchrun, one process per device."""
    argv = [str(a) for a in job.argv]
    if job.gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={job.gpus}",
                "--no-python", *argv]
    return argv


def describe(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def proc_start_time(pid: int) -> Optional[str]:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat): tells our process from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode()
        return data.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def same_process(pid: Optional[int], start: Optional[str]) -> bool:
    """Whether `pid` still names the process that started at `start`."""
    if not pid:
        return False
    now = proc_start_time(pid)
    return now is not None and (start is None or now == start)


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().decode().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False
