"""The job context: who and where a training process is (the job protocol), and cooperative preemption.

A training script starts with::

    with JobContext.from_env() as ctx:
        ...
        for step in range(start, total):
            ...
            ctx.heartbeat(step)
            if ctx.should_stop():          # same call pattern on every rank
                manager.save_now(step + 1, state)
                ctx.exit_preempted()
        ctx.complete()                     # the last step is done: this job has finished

Completion: a job that is preempted goes back in line whatever its exit code (a plain SIGTERM handler that
saves and exits 0 has not finished its training). Only `complete()` tells the queue that this attempt did its
last step, so that ending while being preempted counts as SUCCEEDED and the job is not run again. Leaving the
`with` block without an exception and without a stop request also completes the job (a job that never saw
its SIGTERM did finish); a job that saw one and finished anyway calls `complete()` itself.

Inside a queued job the executor's environment fills every field. Run by hand (no AUTORESEARCH_JOB_ID) the
context still works: job id None, attempt 0, params {}, and a checkpoint dir under
``$AUTORESEARCH_HOME/checkpoints/standalone/<script name>`` so a second run by hand resumes the first.

SIGTERM and SIGINT set a flag instead of killing the process (a second SIGINT interrupts as usual, so a
person can still force-quit). `should_stop()` turns the per-rank flags into one decision: with several ranks it
all-reduces the flag with MAX over a small gloo group, so a signal that reached one rank stops all of them at
the same step, and every rank checkpoints that step and exits together.

MLflow: `log_metrics`/`log_params` write from rank 0 only, to ``MLFLOW_RUN_ID`` on ``MLFLOW_TRACKING_URI``.
Without a run id but with a tracking URI, a new run is created on first use (experiment
``params["experiment"]`` or "standalone"); with neither, logging is skipped (once noted on stderr).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import gpushare, protocol
from runtime.errors import RuntimeJobError


@dataclass(frozen=True)
class ContextConfig:
    """Knobs of a `JobContext`: heartbeat throttle and whether to take over SIGTERM/SIGINT."""

    heartbeat_interval_s: float = 5.0
    handle_signals: bool = True

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s < 0:
            raise ValueError("heartbeat_interval_s must be >= 0")


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        return int(raw) if raw not in (None, "") else default
    except ValueError:
        raise RuntimeJobError(f"{name}={raw!r} is not an integer") from None


def _standalone_dir() -> Path:
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else "interactive"
    return protocol.home_dir() / "checkpoints" / "standalone" / script


def read_heartbeat(path: str | os.PathLike) -> dict[str, Any] | None:
    """The last heartbeat {"step", "time", "pid"} written at `path`, or None if absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and {"step", "time", "pid"} <= data.keys() else None


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so readers see the old or the new file, never a torn one (tmp in the same dir + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class JobContext:
    """One training process's view of its job: identity, params, devices, stop flag, logging, heartbeat.

    Sharing a GPU (``AUTORESEARCH_GPU_SHARE``, maybe ``AUTORESEARCH_GPU_MEMORY``; `gpu_share`/`gpu_memory`):
    - Memory cap: the process's CUDA caching allocator is capped at ``min(share, memory / device total)`` of its
      device (`torch.cuda.set_per_process_memory_fraction`), set up by `from_env`/``__enter__`` (on a GPU,
      picking the device has imported torch by then; else at the first `heartbeat`/`should_stop` after the job
      imported it). It never initialises CUDA: the cap is queued to run inside CUDA's lazy initialisation,
      before the first allocation (`runtime.gpushare.apply_cap`). A job on a CPU slot is never capped.
    - Out of memory: a CUDA out-of-memory error that leaves the ``with`` block of a job with a share below 1
      writes `protocol.OOM_FILE` into the checkpoint dir, prints one line, and exits 75, so the service requeues
      the job to run alone without spending an attempt. Without a share the error propagates as any other.
    - Peak memory: when the context closes (or on `complete()`), rank 0 logs `protocol.PEAK_MEMORY_METRIC` (the
      most memory its allocator reserved) and `protocol.DEVICE_MEMORY_METRIC` (the device's total), in MLflow's
      megabytes (10**6 bytes), at the last heartbeat step; only when CUDA was initialised in this process.
    """

    def __init__(
        self,
        *,
        job_id: int | None,
        attempt: int,
        params: dict[str, Any],
        checkpoint_dir: Path,
        rank: int = 0,
        local_rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        heartbeat_file: Path | None = None,
        tracking_uri: str | None = None,
        run_id: str | None = None,
        gpu_share: float | None = None,
        gpu_memory: int | None = None,
        config: ContextConfig = ContextConfig(),
    ) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.params = params
        self.checkpoint_dir = Path(checkpoint_dir)
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.device = device
        self.heartbeat_file = Path(heartbeat_file) if heartbeat_file else self.checkpoint_dir / "heartbeat.json"
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self.config = config
        self.gpu_share, self.gpu_memory = gpu_share, gpu_memory  # None: the job has its devices to itself
        limited = gpu_share is not None or gpu_memory is not None
        self._cap_pending = limited and gpushare.cuda_index(device) is not None  # no cap to set on a CPU
        self._last_step = 0
        self._gpu_reported = False
        self._stop = threading.Event()
        self._sigint_seen = False
        self._old_handlers: dict[int, Any] = {}
        self._group = None  # small gloo group for the stop vote, created by init_distributed
        self._last_beat = float("-inf")
        self._mlflow = None
        self._mlflow_off = False
        self._completed = False
        if config.handle_signals:
            self._install_signals()

    @classmethod
    def from_env(cls, config: ContextConfig = ContextConfig()) -> "JobContext":
        """Build the context from the job protocol's environment (and torchrun's RANK/LOCAL_RANK/WORLD_SIZE)."""
        raw_job = os.environ.get(protocol.JOB_ID)
        job_id = _int_env(protocol.JOB_ID, 0) if raw_job else None
        try:
            params = json.loads(os.environ.get(protocol.PARAMS) or "{}")
        except ValueError as exc:
            raise RuntimeJobError(f"{protocol.PARAMS} is not valid JSON: {exc}") from None
        if not isinstance(params, dict):
            raise RuntimeJobError(f"{protocol.PARAMS} must be a JSON object")
        ckpt = os.environ.get(protocol.CHECKPOINT_DIR)
        local_rank = _int_env("LOCAL_RANK", 0)
        hb = os.environ.get(protocol.HEARTBEAT_FILE)
        gpu_share, gpu_memory = gpushare.read_env()
        ctx = cls(
            job_id=job_id,
            attempt=_int_env(protocol.ATTEMPT, 0),
            params=params,
            checkpoint_dir=Path(ckpt) if ckpt else _standalone_dir(),
            rank=_int_env("RANK", 0),
            local_rank=local_rank,
            world_size=_int_env("WORLD_SIZE", 1),
            device=_pick_device(local_rank),
            heartbeat_file=Path(hb) if hb else None,
            tracking_uri=os.environ.get(protocol.TRACKING_URI) or None,
            run_id=os.environ.get(protocol.RUN_ID) or None,
            gpu_share=gpu_share,
            gpu_memory=gpu_memory,
            config=config,
        )
        ctx._cap_memory()
        return ctx

    @property
    def sharing(self) -> bool:
        """Whether this job shares its GPU with others (a share below 1)."""
        return self.gpu_share is not None and self.gpu_share < 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs and writes shared files."""
        return self.rank == 0

    # -- distributed -------------------------------------------------------------------------------------

    def init_distributed(self) -> None:
        """Join the process group when WORLD_SIZE > 1 (NCCL for CUDA tensors, gloo for CPU ones).

        Also creates the small gloo group `should_stop` votes on, so the vote never queues behind NCCL work.
        """
        if self.world_size <= 1:
            return
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            if self.device.startswith("cuda"):
                torch.cuda.set_device(self.device)
                dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=torch.device(self.device))
            else:
                dist.init_process_group(backend="gloo")
        self._group = dist.new_group(backend="gloo")

    # -- preemption --------------------------------------------------------------------------------------

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; the caller polls nothing then
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self._sigint_seen:
                raise KeyboardInterrupt  # a second Ctrl-C means "now", not "at the next checkpoint"
            self._sigint_seen = True
        self._stop.set()

    def request_stop(self) -> None:
        """Ask this rank to stop at the next `should_stop()` (what SIGTERM does)."""
        self._stop.set()

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop. Collective when world_size > 1: call it at the same steps on
        every rank (every step, or every n steps), and all ranks get the same answer at the same step."""
        if self._cap_pending:
            self._cap_memory()
        local = self._stop.is_set()
        if self.world_size <= 1 or self._group is None:
            return local
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def complete(self) -> None:
        """Tell the queue this attempt has done its last step: if a preemption arrives now, the job still
        ends SUCCEEDED instead of running again. Rank 0 writes the marker (atomically) into the checkpoint
        dir; call it on every rank after training. Idempotent. Outside a queued job it does nothing."""
        self._report_gpu_memory()
        if self.job_id is None or not self.is_main or self._completed:
            return
        write_json_atomic(self.checkpoint_dir / protocol.COMPLETE_FILE, {"attempt": self.attempt, "at": time.time()})
        self._completed = True

    def exit_preempted(self) -> None:
        """Exit with EX_TEMPFAIL (75): stopped on request after checkpointing; requeue without an attempt."""
        self.close()
        sys.exit(protocol.EX_TEMPFAIL)

    # -- heartbeat ---------------------------------------------------------------------------------------

    def heartbeat(self, step: int, *, force: bool = False) -> bool:
        """Record progress for the service's hang detector; throttled to one write per
        `config.heartbeat_interval_s` unless `force`. Rank 0 only. Returns whether it wrote."""
        if self._cap_pending:
            self._cap_memory()
        self._last_step = int(step)
        now = time.monotonic()
        if not self.is_main or (not force and now - self._last_beat < self.config.heartbeat_interval_s):
            return False
        self._last_beat = now
        write_json_atomic(self.heartbeat_file, {"step": int(step), "time": time.time(), "pid": os.getpid()})
        return True

    # -- MLflow ------------------------------------------------------------------------------------------

    def _client(self):
        if self._mlflow_off or not self.is_main:
            return None
        if self._mlflow is None:
            if not self.run_id and not self.tracking_uri:
                print("autoresearch: no MLFLOW_RUN_ID or MLFLOW_TRACKING_URI; metrics are not logged", file=sys.stderr)
                self._mlflow_off = True
                return None
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=self.tracking_uri)
            if not self.run_id:
                name = str(self.params.get("experiment") or "standalone")
                exp = client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp else client.create_experiment(name)
                self.run_id = client.create_run(exp_id).info.run_id
            self._mlflow = client
        return self._mlflow

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log numeric metrics at `step` to the job's MLflow run (rank 0 only; others return at once)."""
        client = self._client()
        if client is None or not metrics:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, int(step)) for k, v in metrics.items()])

    def log_params(self, params: dict[str, Any]) -> None:
        """Log parameters to the job's MLflow run (rank 0 only). Re-logging the same value is harmless, so a
        resumed attempt may call it again."""
        client = self._client()
        if client is None or not params:
            return
        from mlflow.entities import Param

        existing = client.get_run(self.run_id).data.params
        fresh = [Param(k, str(v)) for k, v in params.items() if existing.get(k) != str(v)]
        if fresh:
            client.log_batch(self.run_id, params=fresh)

    # -- sharing a GPU ----------------------------------------------------------------------------------

    def _cap_memory(self) -> None:
        # Called on entry and from heartbeat/should_stop until it succeeds: a job that imports torch after
        # entering the context is capped at its next step (a sys.modules look-up per call until then).
        if not self._cap_pending:
            return
        cuda = gpushare.loaded_cuda()
        if cuda is not None and gpushare.apply_cap(cuda, gpushare.cuda_index(self.device), self.gpu_share,
                                                   self.gpu_memory):
            self._cap_pending = False

    def _report_gpu_memory(self) -> None:
        """Log this process's peak CUDA memory and its device's total to MLflow (rank 0, once, and only if CUDA
        was initialised here: asking an uninitialised CUDA would initialise it)."""
        index = gpushare.cuda_index(self.device)
        if self._gpu_reported or not self.is_main or index is None:
            return
        cuda = gpushare.loaded_cuda()
        figures = gpushare.peak_memory(cuda, index) if cuda is not None else None
        if figures is None:
            return
        self._gpu_reported = True
        try:
            self.log_metrics(figures, step=self._last_step)
        except Exception as exc:  # the job's own work is done; a tracking hiccup must not fail it now
            print(f"autoresearch: could not log GPU memory to MLflow: {exc}", file=sys.stderr)

    def _exit_out_of_memory(self, exc: BaseException) -> None:
        write_json_atomic(self.checkpoint_dir / protocol.OOM_FILE, gpushare.oom_record(self.attempt, exc))
        print(f"autoresearch: out of GPU memory on a shared GPU (share {self.gpu_share:g}); asking to run alone",
              file=sys.stderr, flush=True)
        self.close()
        sys.exit(protocol.EX_TEMPFAIL)

    # -- lifecycle ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Report GPU memory (see the class docstring), restore signal handlers and leave the process group.
        Safe to call twice."""
        self._report_gpu_memory()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self._group = None

    def __enter__(self) -> "JobContext":
        self._cap_memory()
        self.init_distributed()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # Out of memory on a shared GPU: not the job's fault, most likely its neighbours'. Ask to run alone.
        if exc is not None and self.sharing and gpushare.is_oom(exc):
            self._exit_out_of_memory(exc)
        # Finished the block normally and never asked to stop: the job did its last step.
        if exc_type is None and not self._stop.is_set():
            self.complete()
        self.close()


def _pick_device(local_rank: int) -> str:
    # One rule for which GPU a rank gets, and a loud error for a rank without one (runtime.devices).
    from runtime.devices import job_device

    return job_device(local_rank)
