"""The Ray executor: each attempt is a Ray job (the Jobs API), so Ray places it on any node of the cluster.

Placement. The service still plans with slots (policy, priorities, preemption are the same as on one host);
Ray decides where a job runs:
- `--devices auto` (the default): the slots are the cluster's GPUs (`ray:0`, `ray:1`, ...; the total of every
  alive node, read at start), and a job asks for `entrypoint_num_gpus = --gpus`. Ray sets
  CUDA_VISIBLE_DEVICES on the node it picks. One entrypoint request lives on one node, so a multi-GPU job
  gets all its GPUs on one node or waits in Ray (PENDING) until a node has them: all-or-nothing.
- `--devices cpu:N`: N virtual slots, and each slot is one Ray CPU (`entrypoint_num_cpus = --gpus`). Real CPUs
  rather than a custom resource, so any stock cluster works and jobs spread by free cores; N above the
  cluster's CPU count only makes the extra jobs wait in Ray.

Environment. The runtime env carries the job protocol's variables and the job's own overrides, not the
service's whole environment (that belongs to another machine). The job's grace period is passed as
`RAY_JOB_STOP_WAIT_TIME_S`, which the job's supervisor reads when it stops it: stop = SIGTERM to every
process of the job, SIGKILL after the grace.

Exit codes: `ray_jobs.exit_of`.

Logs. A watcher thread follows each attempt's Ray log (a websocket tail) into the job's log file, so
`autoresearch logs` works as with local jobs; `ray_logs.stream_logs` reads Ray directly for hosts without
that file. After a service restart, `adopt()` finds the Ray job again by its submission id, which is derived
from the job (`autoresearch-ID-ATTEMPT-TAG`) and recorded as `ray:SID@ADDRESS` in the job's `proc_start`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orchestrator.core import devices as devspec
from orchestrator.core.errors import BadInput
from orchestrator.executors.base import (Executor, Exit, Launched, Liveness, OnExit, Probe, describe, job_argv,
                                         refuse_multinode)
from orchestrator.executors.ray.jobs import (PREFIX, WRAPPER, client_for, exit_of, normalize_address,
                                             parse_handle, submission_id)
from orchestrator.core.layout import Layout
from orchestrator.queue.models import Job
from orchestrator.core.config import Settings
from runtime import protocol

log = logging.getLogger(__name__)

PROTOCOL_KEYS = (protocol.JOB_ID, protocol.ATTEMPT, protocol.CHECKPOINT_DIR, protocol.PARAMS, protocol.HOME,
                 protocol.HEARTBEAT_FILE, protocol.TRACKING_URI, protocol.RUN_ID, protocol.VISIBLE_DEVICES,
                 protocol.DEVICE_ORDER)


@dataclass
class _Watch:
    job_id: int
    attempt: int
    sid: str
    log_path: Optional[Path]
    task: Any = None
    written: int = 0  # characters of the attempt's Ray log already in the log file

def runtime_env_of(job: Job, env_vars: dict[str, str]) -> dict[str, Any]:
    """The Ray runtime env of an attempt: its variables, and for an --image job Ray's container runtime env
    (`image_uri`: Ray runs the job in that image with podman on the node, which must have the image)."""
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if job.image:
        runtime_env["image_uri"] = job.image
    return runtime_env

class RayExecutor(Executor):
    """Runs attempts as Ray jobs on the cluster at `settings.extra["ray_address"]` (or RAY_ADDRESS)."""

    name = "ray"
    local_devices = False  # Ray places jobs on its nodes and watches them itself

    def __init__(self, settings: Any, on_exit: OnExit, *, address: Optional[str] = None, poll: float = 0.5):
        address = address or settings.extra.get("ray_address") or os.environ.get("RAY_ADDRESS")
        if not address:
            raise BadInput("--executor ray needs --ray-address http://HEAD:8265 (the Ray dashboard) or RAY_ADDRESS")
        self.address = normalize_address(str(address))
        self.client = client_for(self.address)
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # a line per log tail
        self.device_spec = str(settings.devices or "auto")
        self.cpu_slots = self.device_spec.startswith("cpu:")
        self.poll = poll
        self._on_exit = on_exit
        self._closed = False
        self._watches: dict[str, _Watch] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ray-executor-watch", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, settings: Settings, layout: Layout, on_exit: OnExit) -> "RayExecutor":
        return cls(settings, on_exit)

    # ---- the Executor interface ---------------------------------------------------------------------------

    def inventory(self) -> Optional[list[str]]:
        if self.cpu_slots:
            return devspec.parse(self.device_spec)
        if self.device_spec != "auto":
            raise BadInput(f"with --executor ray, --devices is auto (the cluster's GPUs) or cpu:N, not "
                           f"{self.device_spec!r}: Ray picks the GPUs itself")
        gpus = int(sum(node.get("GPU", 0.0) for node in self.cluster_resources()))
        if gpus < 1:
            raise BadInput(f"the Ray cluster at {self.address} has no GPUs; use --devices cpu:N for N "
                           "CPU slots")
        return [f"{PREFIX}{i}" for i in range(gpus)]

    def cluster_resources(self) -> list[dict[str, float]]:
        """The total resources of each alive node of the cluster."""
        from ray.util.state import list_nodes

        nodes = list_nodes(address=self.address, detail=True, raise_on_missing_output=False)
        return [dict(n.resources_total or {}) for n in nodes if str(n.state) in ("ALIVE", "NodeState.ALIVE")]

    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        refuse_multinode(job, self.name)
        sid = submission_id(job)
        argv = job_argv(job)
        log_path = Path(job.log_path) if job.log_path else None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as out:
                out.write(self._header(job, sid, argv).encode())
        if job.checkpoint_dir:
            os.makedirs(job.checkpoint_dir, exist_ok=True)  # visible to other nodes on a shared home
        resources = ({"entrypoint_num_cpus": job.gpus} if self.cpu_slots else {"entrypoint_num_gpus": job.gpus})
        entrypoint = describe(["/bin/sh", "-c", WRAPPER, "autoresearch-job", job.cwd or "", *argv])
        runtime_env = runtime_env_of(job, self._env_vars(job, env))
        try:
            self.client.submit_job(entrypoint=entrypoint, submission_id=sid, runtime_env=runtime_env,
                                   metadata={"autoresearch_job": str(job.id), "attempt": str(job.attempts)},
                                   **resources)
        except Exception:
            if self._info(sid) is None:  # an id already taken means an earlier try of this launch got through
                raise
        self._watch(_Watch(job.id, job.attempts, sid, log_path))
        return Launched(0, f"{PREFIX}{sid}@{self.address}")

    def signal(self, job: Job, sig: int, layout: Optional[Layout] = None) -> None:
        # Ray stops a job with SIGTERM and SIGKILLs it after RAY_JOB_STOP_WAIT_TIME_S (the job's grace); a
        # later SIGKILL from the service finds it stopping already, so both map to stop_job.
        if sig not in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
            log.debug("ray executor: signal %s not supported; ignored for job %s", sig, job.id)
            return
        sid, client = self._handle(job)
        try:
            client.stop_job(sid)
        except Exception as exc:  # already finished or gone: the watcher reports it
            log.debug("stop_job for job %s: %s", job.id, exc)

    def probe(self, job: Job, layout: Optional[Layout] = None) -> Probe:
        """Ask the cluster that runs the attempt (the one in its handle, which may be another service's)."""
        sid, client = self._handle(job)
        try:
            info = client.get_job_info(sid)
        except Exception as exc:
            if "does not exist" in str(exc) or "404" in str(exc):
                return Probe(Liveness.GONE)  # never submitted, or the cluster forgot it (restarted)
            # An unreachable cluster runs nothing new either: wait rather than risk a rerun.
            return Probe(Liveness.UNKNOWN, detail=f"cannot ask Ray about job {job.id}: {exc}")
        handle = parse_handle(job.proc_start)
        found = Launched(0, job.proc_start if handle is not None else f"{PREFIX}{sid}@{self.address}")
        if not info.status.is_terminal():
            return Probe(Liveness.RUNNING, found=found)
        if info.driver_exit_code is None:
            return Probe(Liveness.GONE, detail="ray recorded no exit code")
        code, detail = exit_of(info)
        return Probe(Liveness.ENDED, code, detail, found=found)

    def _handle(self, job: Job) -> tuple[str, Any]:
        """The attempt's submission id and a client for the cluster that runs it."""
        handle = parse_handle(job.proc_start)
        if handle is None or normalize_address(handle[1]) == self.address:
            return self._sid(job), self.client
        return handle[0], client_for(handle[1])

    def adopt(self, job: Job) -> bool:
        sid = self._sid(job)
        info = self._info(sid)
        log_path = Path(job.log_path) if job.log_path else None
        watch = _Watch(job.id, job.attempts, sid, log_path)
        if info is None:
            self._report(watch, -signal.SIGKILL, f"the Ray job {sid} is gone")
            return False
        if info.status.is_terminal():
            self._truncate_attempt(watch)
            self._report(watch, *self._finish(watch, info))
            return False
        self._truncate_attempt(watch)  # the tail restarts from the beginning of the attempt's output
        self._watch(watch)
        return True

    def find_attempt(self, job: Job) -> Optional[Launched]:
        sid = submission_id(job)
        return Launched(0, f"{PREFIX}{sid}@{self.address}") if self._info(sid) is not None else None

    def close(self) -> None:
        self._closed = True

        async def shutdown() -> None:
            # Cancel the watchers and their log tails and let them unwind (closing their HTTP sessions).
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
        except Exception as exc:
            log.debug("ray executor shutdown: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # ---- internals --------------------------------------------------------------------------------------

    def _sid(self, job: Job) -> str:
        handle = parse_handle(job.proc_start)
        return handle[0] if handle else submission_id(job)

    def _info(self, sid: str):
        try:
            return self.client.get_job_info(sid)
        except RuntimeError as exc:
            if "does not exist" in str(exc) or "404" in str(exc):
                return None
            raise

    @staticmethod
    def _header(job: Job, sid: str, argv: list[str]) -> str:
        return (f"=== autoresearch: attempt {job.attempts} of job {job.id} on ray ({sid}, "
                f"{','.join(job.devices) or '-'}): {describe(argv)}\n")

    def _env_vars(self, job: Job, env: dict[str, str]) -> dict[str, str]:
        keep = set(PROTOCOL_KEYS) | set(job.env or {})
        out = {k: str(v) for k, v in env.items() if k in keep or os.environ.get(k) != v}
        if not self.cpu_slots:
            out.pop(protocol.VISIBLE_DEVICES, None)  # Ray sets it for the GPUs it assigned on its node
        out["RAY_JOB_STOP_WAIT_TIME_S"] = str(int(math.ceil(job.grace)))
        return out

    def _watch(self, watch: _Watch) -> None:
        def start() -> None:
            watch.task = self._loop.create_task(self._follow(watch))
            self._watches[watch.sid] = watch

        self._loop.call_soon_threadsafe(start)

    async def _follow(self, watch: _Watch) -> None:
        """Mirror the attempt's log into its file while polling Ray for its end, then report its exit.

        The status is polled rather than inferred from the log tail ending: Ray closes a tail seconds after
        the job ends, and the slot should free at once."""
        tail = asyncio.ensure_future(self._tail(watch))
        info = None
        try:
            while not self._closed:
                try:
                    info = await asyncio.to_thread(self._info, watch.sid)
                except Exception as exc:  # the dashboard is briefly unreachable: keep watching
                    log.warning("ray: cannot read job %s: %s", watch.sid, exc)
                    await asyncio.sleep(self.poll)
                    continue
                if info is None or info.status.is_terminal():
                    break
                if tail.done():  # the connection dropped: follow again (it skips what was written)
                    tail = asyncio.ensure_future(self._tail(watch))
                await asyncio.sleep(self.poll)
            try:
                await asyncio.wait_for(asyncio.shield(tail), 0.5)
            except (asyncio.TimeoutError, Exception):
                tail.cancel()
        except asyncio.CancelledError:
            tail.cancel()
            return
        self._watches.pop(watch.sid, None)
        if self._closed:
            return
        if info is None:
            self._report(watch, -signal.SIGKILL, f"the Ray job {watch.sid} is gone")
            return
        code, detail = await asyncio.to_thread(self._finish, watch, info)
        self._report(watch, code, detail)

    async def _tail(self, watch: _Watch) -> None:
        seen = 0
        try:
            async for chunk in self.client.tail_job_logs(watch.sid):
                # After a reconnect the tail starts over: skip what the file already has.
                fresh = chunk[max(0, watch.written - seen):]
                seen += len(chunk)
                if fresh:
                    self._append(watch, fresh)
                    watch.written += len(fresh)
        except Exception as exc:
            log.debug("log tail of %s: %s", watch.sid, exc)

    def _finish(self, watch: _Watch, info: Any) -> tuple[int, str]:
        """Complete the mirrored log from Ray's full copy and work out the exit code."""
        text = ""
        try:
            text = self.client.get_job_logs(watch.sid)
        except Exception as exc:
            log.warning("ray: no log for %s: %s", watch.sid, exc)
        if len(text) > watch.written:
            self._append(watch, text[watch.written:])
            watch.written = len(text)
        return exit_of(info, text)

    def _append(self, watch: _Watch, text: str) -> None:
        if watch.log_path is not None:
            with open(watch.log_path, "ab") as out:
                out.write(text.encode(errors="replace"))

    def _truncate_attempt(self, watch: _Watch) -> None:
        """Drop what an earlier service mirrored of this attempt (it is streamed again from the start)."""
        if watch.log_path is None or not watch.log_path.exists():
            return
        data = watch.log_path.read_bytes()
        marker = f"=== autoresearch: attempt {watch.attempt} of job {watch.job_id} on ray ({watch.sid},".encode()
        at = data.rfind(marker)
        if at < 0:
            return
        end = data.find(b"\n", at)
        if end >= 0:
            with open(watch.log_path, "r+b") as fh:
                fh.truncate(end + 1)

    def _report(self, watch: _Watch, code: int, detail: str) -> None:
        try:
            self._on_exit(Exit(watch.job_id, watch.attempt, code, detail))
        except Exception:  # the service logs and recovers on its next reconcile
            log.exception("on_exit failed for job %s", watch.job_id)
