"""The GPU sampler: every `gpu_sample_interval` seconds, on its own scheduler thread (never the dispatcher's),
each local GPU's utilisation, memory used and total and compute pids from NVML, integrated into the queue's
busy-share records (`orchestrator.queue.gpuuse`: one small write per device and per holding job).

It shares the device guard's long-lived NVML session (each call bounded by `nvml_timeout`), so a wedged driver
costs the sampler a sample, never the queue. cpu slots are never sampled. Once a job that held a GPU has ended
for good, its mean device utilisation (`runtime.protocol.UTILIZATION_METRIC`) and the peak device memory used
seen (`gpuuse.MEMORY_USED_METRIC`) go to its MLflow run through the tracking worker, from this thread too.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

from orchestrator.queue.gpuuse import GpuUse, Holder, Sample, integrate_host, metrics
from orchestrator.queue.states import HOLDING
from orchestrator.queue.store import JobStore

log = logging.getLogger(__name__)
LOG_RETRY_AFTER = 30.0  # seconds before asking a tracking store that failed again


def is_gpu(name: str) -> bool:
    """Whether a device name is a GPU (an index or a UUID), not a virtual cpu slot."""
    return not name.startswith("cpu:")


class GpuWatch:
    """Samples one host's GPUs. `session()` gives an open `runtime.nvml.Nvml` (or one not `available`: then
    nothing is sampled); `log_runs` sends `[{"run": id, "metrics": {...}}]` to MLflow (None: figures stay here)."""

    def __init__(self, store: JobStore, host: str, *, interval: float, session: Callable[[], Any],
                 log_runs: Optional[Callable[[Sequence[dict]], None]] = None):
        self.store, self.host, self.interval = store, host, interval
        self.records = GpuUse(store.db)
        self._session = session
        self._log_runs = log_runs
        # Nothing counts across a longer gap (a stalled sampler, a hung driver): an unknown stretch is not guessed.
        self.max_gap = max(5 * interval, 10.0)
        self._prev: dict[str, Sample] = {}
        self._log_after = 0.0
        self._closed = False
        self.samples = 0  # samples recorded (tests wait on it)
        self.logged = 0  # jobs whose figures were logged to MLflow

    def close(self) -> None:
        """Log nothing more (the service is stopping: its tracking worker is going)."""
        self._closed = True

    def tick(self) -> None:
        """The scheduler's job: one sample, then the figures of jobs that ended since."""
        try:
            self.sample_once()
        except Exception:
            log.exception("GPU sample failed")
        try:
            self.log_ended()
        except Exception:
            log.exception("logging ended jobs' GPU figures failed")

    def sample_once(self) -> int:
        """Sample every GPU of this host and record the step; returns the devices sampled."""
        gpus = [d.name for d in self.store.hosts.devices(self.host) if is_gpu(d.name)]
        if not gpus:
            return 0
        nv = self._session()
        if nv is None or not getattr(nv, "available", False):
            return 0
        cur: dict[str, Sample] = {}
        for name in gpus:
            try:
                util, used, total = nv.usage(name)
            except Exception as exc:  # a MIG slice without counters, a device gone, a hung call: no sample
                log.debug("no NVML sample of %s: %s", name, exc)
                continue
            try:
                pids = tuple(nv.processes(name))
            except Exception:
                pids = ()
            cur[name] = Sample(time.time(), float(util), int(used), int(total), pids)
        if not cur:
            return 0
        now = time.time()
        holders: dict[str, list[Holder]] = {}
        for job in self.store.list(HOLDING, host=self.host):
            share = job.gpu_share or 1.0
            for device in job.devices or ():
                holders.setdefault(device, []).append(Holder(job.id, share, now if job.started_at is None else job.started_at))
        devices, jobs = integrate_host(self._prev, cur, holders, max_gap=self.max_gap)
        self.records.record(self.host, cur, devices, jobs, now)
        self._prev.update(cur)  # a device that gave no sample keeps its older one: the gap rule judges it
        self.samples += 1
        return len(cur)

    def log_ended(self) -> int:
        """Log the figures of jobs that held a GPU and ended for good to their MLflow runs (jobs without a run:
        nothing to log); returns how many were settled. A failing tracking store is asked again later."""
        if self._closed or time.monotonic() < self._log_after:
            return 0
        rows = self.records.to_log()
        if not rows:
            return 0
        runs = [{"run": run_id, "metrics": metrics(held, busy, peak)} for _, run_id, held, busy, peak in rows if run_id]
        if runs and self._log_runs is not None:
            try:
                self._log_runs(runs)
            except Exception as exc:
                log.warning("could not log the GPU figures of %d ended jobs: %s", len(runs), exc)
                self._log_after = time.monotonic() + LOG_RETRY_AFTER
                return 0
            self.logged += len(runs)
        self.records.logged([row[0] for row in rows])
        return len(rows)
