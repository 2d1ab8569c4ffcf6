"""The service's device guard: what the service does with device checks (the checks are `orchestrator.service.health`).

- Start-up and idle checks look only at devices no job holds (a restarted service must not check, or put a CUDA
  context on, the GPUs of the running jobs it adopted), and the devices under check are out of scheduling
  until the check ends: they are reserved under the placement lock from a fresh read of the queue, and the
  dispatcher holds that lock from reading the usable devices until its claim, so a check and a start never
  meet on one device (the start's own preflight would see the check as a foreign process, and vice versa).
- A job's devices get the quick checks before it starts; a failure quarantines the device and requeues the
  job without spending an attempt.
- The run-time monitor samples running jobs' devices through one long-lived NVML session with per-call
  timeouts, on its own scheduler thread (never on the heartbeat's). A hardware fault (ECC, row remapping) acts
  at once; a throttle or a failed/hung NVML query acts after `monitor_hits` consecutive samples.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Callable, Iterator

from orchestrator.service.health import Health, Verdict
from orchestrator.queue.models import Job
from orchestrator.queue.states import HOLDING, JobState
from orchestrator.queue.store import JobStore

log = logging.getLogger(__name__)
# Failures that may be a passing state (a thermal slowdown, a slow driver): acted on only when they persist.
_PERSISTENT_ONLY = ("throttle",)


def _transient(failure: str) -> bool:
    return failure.startswith(_PERSISTENT_ONLY) or "query failed" in failure


class DeviceGuard:
    """Device checks for one service on one host. `heartbeat_file(job_id)` is where a job's heartbeat is;
    `stop_job` preempts a running job (SIGTERM: it checkpoints); `wake` wakes the dispatcher."""

    def __init__(self, store: JobStore, host: str, health: Health, *, heartbeat_file: Callable[[int], Path],
                 stop_job: Callable[[Job], None], wake: Callable[[], None]):
        self.store, self.host, self.health = store, host, health
        self._heartbeat_file = heartbeat_file
        self._stop_job, self._wake = stop_job, wake
        self._placement = threading.RLock()
        self._checking: set[str] = set()
        self._hits: dict[str, int] = {}
        self._nvml = None  # the monitor's long-lived NVML session, opened on first use (shared with gpuwatch)
        self._nvml_lock = threading.Lock()
        self._totals: dict[str, int | None] = {}  # memory of each GPU (`memory_totals`), read once
        self.open_nvml: Callable[[], object] = self._open_nvml  # the NVML edge (tests give a fake)
        self.on_quarantine: Callable[[str, str], None] = lambda device, why: None  # the service's notifications

    # ---- placement ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def placing(self) -> Iterator[None]:
        """Held by the dispatcher from reading the usable devices until its claim is written."""
        with self._placement:
            yield

    def schedulable(self, names: list[str]) -> list[str]:
        """`names` without the devices under an idle or start-up check (call inside `placing()`)."""
        return [n for n in names if n not in self._checking]

    @property
    def checking(self) -> frozenset[str]:
        """Devices under an idle or start-up check right now."""
        return frozenset(self._checking)

    def _check_unheld(self, run: Callable[[list[str]], Verdict], origin: str) -> None:
        with self._placement:  # a fresh read: what is free now, not what a stale snapshot said
            held = {d for job in self.store.list(HOLDING, host=self.host) for d in job.devices or []}
            idle = [d.name for d in self.store.hosts.devices(self.host)
                    if d.state == "available" and d.name not in held and d.name not in self._checking]
            self._checking.update(idle)
        try:
            if idle:
                self.apply(idle, run(idle), origin)
        finally:
            with self._placement:
                self._checking.difference_update(idle)
            self._wake()

    # ---- checks -------------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """The first preflight after start-up, on the devices no (adopted) job holds."""
        if self.health.config.preflight == "off":
            return
        try:
            self._check_unheld(self.health.preflight, "preflight")
        except Exception:
            log.exception("start-up preflight failed")

    def recheck_idle(self) -> None:
        """The deeper checks on devices no job holds; failures are quarantined."""
        try:
            self._check_unheld(self.health.recheck, "idle check")
        except Exception:
            log.exception("idle device re-check failed")

    def preflight_ok(self, job: Job) -> bool:
        """Quick checks on the job's devices; on a failure quarantine them and put the job back in line
        without spending an attempt (the next pass places it on healthy devices)."""
        verdict = self.health.preflight(list(job.devices or []))
        self.apply(list(job.devices or []), verdict, "preflight")
        if verdict.ok:
            return True
        bad = ",".join(sorted(verdict.failed))
        self.store.requeue(job.id, f"preflight failed on {bad}; requeued without spending an attempt", self.host)
        self._wake()
        return False

    def apply(self, devices: list[str], verdict: Verdict, origin: str) -> None:
        """Record a check's outcome on each device: failures are quarantined with their reason, passes
        become the device's last check (nothing is recorded when nothing was checked)."""
        for device in devices:
            if device in verdict.failed:
                self.quarantine(device, f"{origin}: {verdict.failed[device]}", verdict)
            elif verdict.results:
                self.store.hosts.record_check(self.host, device, verdict.for_device(device))

    def quarantine(self, device: str, why: str, verdict: Verdict) -> None:
        """Take `device` out of scheduling until a person enables it again."""
        log.warning("quarantining %s: %s", device, why)
        self.store.hosts.set_device_state(self.host, device, "quarantined", why, verdict.for_device(device))
        self.on_quarantine(device, why)

    # ---- the run-time monitor -----------------------------------------------------------------------

    def _open_nvml(self):
        from runtime.nvml import Nvml

        return Nvml(timeout_s=self.health.config.nvml_timeout).open()

    def _session(self):
        with self._nvml_lock:  # the monitor and the GPU sampler run on different scheduler threads
            if self._nvml is None:
                self._nvml = self.open_nvml()
            return self._nvml

    def nvml_session(self):
        """The service's long-lived NVML session (opened on first use), for the GPU sampler too."""
        return self._session()

    def memory_totals(self, devices: list[str]) -> dict[str, int]:
        """Total memory in bytes of each GPU among `devices` (none for cpu slots, or where NVML cannot say):
        what the policy packs shares of a GPU against. Read once per device, through the monitor's session."""
        gpus = [d for d in devices if not d.startswith("cpu:") and d not in self._totals]
        if gpus:
            try:
                nvml = self._session()
                for device in gpus:
                    self._totals[device] = nvml.usage(device)[2] if nvml.available else None
            except Exception as exc:  # noqa: BLE001 - no memory figure: shares alone bound the packing
                log.warning("GPU memory totals unknown (%s): packing by shares alone", exc)
                self._totals.update(dict.fromkeys(gpus))
        return {d: self._totals[d] for d in devices if self._totals.get(d)}

    def monitor(self) -> None:
        """Run-time health: a device fault under a running job, or a job without progress, stops the job
        (SIGTERM: it checkpoints) and puts it back in line; a faulty device is quarantined first."""
        try:
            jobs = self.store.list([JobState.RUNNING], host=self.host)
            gpus = any(not d.startswith("cpu:") for job in jobs for d in job.devices or [])
            nvml = self._session() if gpus else None
            for job in jobs:
                self._watch(job, nvml)
        except Exception:
            log.exception("device monitor failed")

    def _watch(self, job: Job, nvml) -> None:
        devices = list(job.devices or [])
        verdict = self.health.sample(devices, nvml=nvml)
        faulty = {}
        for device in devices:
            failure = verdict.failed.get(device)
            self._hits[device] = self._hits.get(device, 0) + 1 if failure else 0
            if failure and (not _transient(failure) or self._hits[device] >= self.health.config.monitor_hits):
                faulty[device] = failure
        for device, fault in faulty.items():
            self.quarantine(device, f"monitor: {fault}", verdict)
            self._hits[device] = 0
        why = ("device fault: " + "; ".join(f"{d}: {f}" for d, f in sorted(faulty.items()))) if faulty else \
            self.health.hung(self._heartbeat_file(job.id), job.started_at)
        if why:
            for stopping in self.store.preempt([job.id], f"{why}; requeued", self.host):
                self._stop_job(stopping)
            self._wake()

    def close(self) -> None:
        """Close the monitor's NVML session."""
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def __repr__(self) -> str:
        return f"DeviceGuard({self.host}, checking={sorted(self._checking)})"

