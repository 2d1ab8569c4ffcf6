"""The executor: the only code that knows a job's processes (pids, process trees, exit records, Ray handles).

The service and the dead-host reaper ask an executor and never look at processes themselves:
- `launch` starts an attempt; its end comes back as an `Exit` through the `on_exit` callback (from the
  executor's own watcher thread), and `forget` drops the attempt's records once the store has the exit;
- `probe` says whether an attempt lives or how it ended, also for another host's attempts (the reaper);
- `stop` is SIGTERM on the first call and SIGKILL once the job's grace has passed since then, to every
  process of the attempt;
- `adopt`/`find_attempt` pick up running attempts after a restart, and `stop_strays` stops attempts still
  running here that the queue no longer gives to this host.
Executors never touch the store: the service owns every state change.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import shlex
import signal
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence, Union

from orchestrator.core.devices import cuda_visible, is_cpu_slot
from orchestrator.core.layout import Layout
from orchestrator.queue.models import Job
from runtime import protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exit:
    """The end of one attempt: exit code (negative: killed by that signal) and a human detail."""

    job_id: int
    attempt: int
    code: int
    detail: str = ""
    failed_nodes: tuple[tuple[str, str], ...] = ()  # (node, why) of a multi-node attempt's failed nodes


@dataclass(frozen=True)
class Launched:
    """What the store records about a started attempt, enough to find it again after a restart."""

    pid: int
    proc_start: Optional[str] = None
    how: str = ""  # how it started, for its RUNNING event (the local executor's `warm` or `cold: why`)


class StartLost(OSError):
    """An attempt the executor lost before it began (its starter died under it): nothing of the job ran, so
    the job goes back in line without spending an attempt."""


class Liveness(str, enum.Enum):
    """What a probe found out about an attempt."""

    RUNNING = "running"   # some process of the attempt lives
    ENDED = "ended"       # it ended and left an exit code
    GONE = "gone"         # no trace of it here (never spawned, another machine, or killed without a record)
    UNKNOWN = "unknown"   # cannot tell now (a cluster that does not answer): ask again later


@dataclass(frozen=True)
class Probe:
    """An attempt's liveness; `code`/`detail` when it ENDED; `found` is its handle when it was spawned but
    the store has none recorded (the service died in between)."""

    state: Liveness
    code: Optional[int] = None
    detail: str = ""
    found: Optional[Launched] = None


OnExit = Callable[[Exit], None]


class Executor(ABC):
    """Starts attempts somewhere (this host, a Ray cluster), watches them and reports how each ended."""

    name: ClassVar[str]
    #: whether attempts run on this host's devices (so the service's device checks and monitor apply)
    local_devices: ClassVar[bool] = True

    #: whether `inventory` may change while the service runs (and is cheap to ask each second: a cached value)
    refreshes_inventory: ClassVar[bool] = False

    def inventory(self) -> Optional[list[str]]:
        """Devices the backend itself knows (Ray: the cluster's GPUs), or None to use the --devices spec."""
        return None

    @classmethod
    @abstractmethod
    def create(cls, settings, layout: Layout, on_exit: OnExit) -> "Executor":
        """The executor a service with `settings` on `layout`'s home uses; exits go to `on_exit`."""

    @abstractmethod
    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        """Start an attempt of `job` (already STARTING with devices) with the job protocol's `env`."""

    def launch_many(self, batch: Sequence[tuple[Job, dict[str, str]]], pool=None) -> list[Union[Launched, Exception]]:
        """Start several attempts; each outcome is the attempt's handle or the exception that stopped it, in
        order. By default one `launch` each, side by side on `pool` (a `concurrent.futures` executor) if given."""
        def one(item: tuple[Job, dict[str, str]]) -> Union[Launched, Exception]:
            try:
                return self.launch(*item)
            except Exception as exc:  # reported by the caller as a failed start
                return exc

        return list(pool.map(one, batch)) if pool is not None and len(batch) > 1 else [one(i) for i in batch]

    @abstractmethod
    def probe(self, job: Job, layout: Optional[Layout] = None) -> Probe:
        """Whether the job's current attempt lives, or how it ended. `layout`: the home of the service that
        started it, when that is another service's (the reaper); default this executor's own."""

    @abstractmethod
    def signal(self, job: Job, sig: int, layout: Optional[Layout] = None) -> None:
        """Send `sig` to every process of the job's current attempt (no error when none is left)."""

    def stop(self, job: Job, *, since: Optional[float] = None,
             layout: Optional[Layout] = None) -> Optional[signal.Signals]:
        """Stop the attempt: SIGTERM when no stop was sent yet (`since` None), SIGKILL once `job.grace` has
        passed since `since`; nothing in between. Returns the signal sent, if any."""
        sig = owed_signal(since, job.grace)
        if sig is not None:
            self.signal(job, sig, layout)
        return sig

    @abstractmethod
    def adopt(self, job: Job) -> bool:
        """After a service restart: watch a job that was running; False when it is gone (its exit is then
        reported through on_exit right away, from what the attempt recorded)."""

    def find_attempt(self, job: Job) -> Optional[Launched]:
        """The handle of the job's current attempt when the service died between spawning it and
        recording it (None: it was never spawned)."""
        return self.probe(job).found

    def stop_strays(self, current: set[tuple[int, int]], grace: float = 10.0) -> list[int]:
        """Stop attempts running here that are not in `current` (job id, attempt): the queue gave them
        to another host meanwhile. SIGTERM, SIGKILL after `grace`. Returns the job ids stopped."""
        return []

    def forget(self, job_id: int, attempt: int) -> None:
        """The store has recorded how this attempt ended: its records here are no longer needed."""

    @abstractmethod
    def close(self) -> None:
        """Stop watching (running jobs keep running; a restarted service adopts them)."""


def owed_signal(since: Optional[float], grace: float) -> Optional[signal.Signals]:
    """What a stopping attempt is owed now: SIGTERM when no stop was sent yet (`since` None), SIGKILL once
    `grace` seconds have passed since the SIGTERM, nothing in between."""
    if since is None:
        return signal.SIGTERM
    return signal.SIGKILL if time.time() - since >= grace else None


def cpu_threads(job: Job, devices: list[str], cores: int) -> int:
    """The CPU threads of a job: its part of the host's `cores` by what it holds of the service's `devices`.

    On GPUs that is its GPUs' part, times its share of one (a quarter of the only GPU of a 16-core box: 4), so
    that jobs packed onto one GPU do not each start a thread per core. On cpu slots a job's work is its threads,
    and its numbers depend on how many: a share of a slot gets the whole slot's, so that a trial computes the
    same packed or alone."""
    per_device = cores / max(1, len(devices))
    if job.shares_gpu and not all(is_cpu_slot(d) for d in job.devices or ()):
        return max(1, int(per_device * job.gpu_share))
    return max(1, int(per_device * job.gpus))


def job_env(job: Job, *, base: dict[str, str], layout: Layout, tracking_uri: str,
            threads: Optional[int] = None) -> dict[str, str]:
    """The job protocol's environment of an attempt: the service's env, the job's overrides, then the protocol.
    `threads`: the job's CPU threads (`cpu_threads`), set in `protocol.THREAD_VARS` unless the service or the
    job sets OMP_NUM_THREADS itself."""
    env = dict(base)
    if threads and "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in (job.env or {}):
        env.update(dict.fromkeys(protocol.THREAD_VARS, str(threads)))
    env.update(job.env or {})
    env.update({
        protocol.JOB_ID: str(job.id),
        protocol.ATTEMPT: str(job.attempts),
        protocol.CHECKPOINT_DIR: job.checkpoint_dir or "",
        protocol.PARAMS: json.dumps(job.params or {}, sort_keys=True),
        protocol.HOME: str(layout.home),
        protocol.HEARTBEAT_FILE: str(layout.heartbeat_file(job.id)),
        protocol.TRACKING_URI: tracking_uri,
        protocol.VISIBLE_DEVICES: cuda_visible(list(job.devices or [])),
        protocol.DEVICE_ORDER: "PCI_BUS_ID",
    })
    if job.mlflow_run_id:
        env[protocol.RUN_ID] = job.mlflow_run_id
    else:
        env.pop(protocol.RUN_ID, None)
    # A job on a share of a GPU: its neighbours see the same CUDA_VISIBLE_DEVICES; the runtime caps its CUDA
    # memory to these (JobContext). Inherited values never leak into a job on whole devices.
    env.pop(protocol.GPU_SHARE, None)
    env.pop(protocol.GPU_MEMORY, None)
    if job.shares_gpu:
        env[protocol.GPU_SHARE] = repr(float(job.gpu_share))
        if job.gpu_memory:
            env[protocol.GPU_MEMORY] = str(int(job.gpu_memory))
    # An API key of the agent's LLM has no business inside a training job.
    env.pop("OPENAI_API_KEY", None)
    return env


def torchrun_shutdown_timeout(grace: float) -> int:
    """Seconds torchrun waits for its workers after forwarding a SIGTERM before it SIGKILLs them: below the
    job's grace (the service's SIGKILL comes at the grace), but most of it, so a long save is not cut by
    torchrun's default of 30 s."""
    return max(1, math.floor(grace - min(5.0, 0.2 * grace)))


def job_argv(job: Job) -> list[str]:
    """The argv to run: multi-device jobs go through torchrun, one process per device."""
    argv = [str(a) for a in job.argv]
    if job.gpus > 1:
        return [sys.executable, "-m", "orchestrator.executors.torchrun", "--standalone",
                f"--nproc-per-node={job.gpus}", f"--shutdown-timeout={torchrun_shutdown_timeout(job.grace)}",
                "--no-python", *argv]
    return argv


def refuse_multinode(job: Job, executor: str) -> None:
    """BadInput (one line, naming the executor that can) for a job across several nodes on an executor that
    places each attempt on one machine."""
    if job.node_count > 1:
        from orchestrator.core.errors import BadInput

        raise BadInput(f"job {job.id} asks for {job.node_count} nodes: the {executor} executor runs each job on "
                       "one machine; a job across nodes needs --executor slurm")


def describe(argv: list[str]) -> str:
    """A shell-quoted command line, for logs."""
    return " ".join(shlex.quote(a) for a in argv)
