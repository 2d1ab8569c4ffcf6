"""Device health for the service: preflight before a start, re-checks of idle devices, a run-time monitor.

DCGM's rule: cheap checks (seconds) before each job, deeper ones on idle devices; a failure drains the device
(quarantine, with its reason) instead of crashing the job or the service. A quarantined device stays out of
scheduling until a person runs `autoresearch gpus enable`.

The checks themselves live in `runtime.preflight` (jobs and `autoresearch preflight` use the same code);
faults for drills come from AUTORESEARCH_FAULTS in the service's environment.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Sequence

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthConfig:
    """How the service checks devices.

    preflight: "quick" before every start, or "off". A device that passed less than `preflight_ttl` seconds
    ago is not checked again (a burst of short jobs should not pay a matmul each). Idle devices get the
    `recheck_level` checks every `recheck_every` seconds. A running job whose heartbeat is older than
    `hang_timeout` seconds is stopped and requeued (0 turns hang detection off). The run-time monitor samples
    every `monitor_every` seconds, each NVML call bounded by `nvml_timeout`; a throttle or a failed NVML query
    counts only after `monitor_hits` consecutive failing samples (ECC and row-remap faults count at once).
    """

    # The defaults are the settings' own (declared once, in `Settings`).
    preflight: str = Settings.preflight
    preflight_ttl: float = Settings.preflight_ttl
    recheck_level: str = Settings.recheck_level
    recheck_every: float = Settings.recheck_every
    monitor_every: float = Settings.monitor_every
    hang_timeout: float = Settings.hang_timeout
    monitor_hits: int = Settings.monitor_hits
    nvml_timeout: float = Settings.nvml_timeout

    def __post_init__(self) -> None:
        if self.preflight not in ("quick", "off"):
            raise ValueError(f"preflight must be quick or off, not {self.preflight!r}")
        if self.recheck_level not in ("quick", "full"):
            raise ValueError(f"recheck_level must be quick or full, not {self.recheck_level!r}")
        if min(self.preflight_ttl, self.recheck_every, self.monitor_every, self.hang_timeout) < 0:
            raise ValueError("health intervals must be >= 0")
        if self.monitor_hits < 1 or self.nvml_timeout <= 0:
            raise ValueError("monitor_hits must be >= 1 and nvml_timeout > 0")

    @classmethod
    def from_settings(cls, settings: Settings) -> "HealthConfig":
        """The health settings of `settings` (flags, `AUTORESEARCH_*`, config.toml); BadInput when one is bad."""
        try:
            return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})
        except ValueError as exc:
            raise BadInput(str(exc)) from None


@dataclass
class Verdict:
    """The outcome of checking some devices: which failed and why, and every result for the record."""

    failed: dict[str, str] = field(default_factory=dict)
    results: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def for_device(self, device: str) -> dict:
        rows = [r.to_dict() for r in self.results if r.device in (device, "host")]
        return {"at": time.time(), "status": "fail" if device in self.failed else "pass", "results": rows}


def _run(devices: Sequence[str], level: str, paths: Sequence[str] = ()) -> list:
    """Checks on GPUs run in a child process: the service must never hold a CUDA context (memory on every
    GPU it hands to jobs) nor hang in a driver call. Virtual cpu slots are checked in-process (cheap)."""
    from runtime import preflight

    if any(not preflight.is_cpu(d) for d in devices):
        return preflight.run_isolated(list(devices), level, paths=paths)
    # A cpu slot is a share of this host's CPU and RAM: a token allocation and matmul prove it works without
    # spending a GPU-sized 256 MiB per slot on every check.
    return preflight.run(list(devices), level, paths=paths,
                         config=preflight.PreflightConfig(alloc_mb=16, matmul_n=128))


def summarize(results: Sequence) -> Verdict:
    """Group failed checks by device; a failed host check (disk, volume) fails no device but is logged."""
    verdict = Verdict(results=list(results))
    for r in results:
        if r.status == "fail" and r.device != "host":
            msg = f"{r.check}: {r.message}" if r.message else r.check
            verdict.failed[r.device] = f"{verdict.failed[r.device]}; {msg}" if r.device in verdict.failed else msg
    return verdict


class Health:
    """Runs checks for one service and remembers recent passes."""

    def __init__(self, config: HealthConfig, paths: Sequence[Path] = ()):
        self.config = config
        self.paths = [str(p) for p in paths]
        self._passed_at: dict[str, float] = {}
        self._lock = threading.Lock()  # the start-up warm-up and the dispatcher may check at once

    def preflight(self, devices: Sequence[str]) -> Verdict:
        """Quick checks on the devices a job is about to get (recent passes are trusted for a while)."""
        if self.config.preflight == "off":
            return Verdict()
        with self._lock:
            return self._preflight(devices)

    def _preflight(self, devices: Sequence[str]) -> Verdict:
        from runtime import faults

        now = time.monotonic()
        due = [d for d in devices if now - self._passed_at.get(d, -1e18) >= self.config.preflight_ttl
               or any(f.target in (d, "*") for f in faults.active())]
        if not due:
            return Verdict()
        verdict = summarize(_run(due, "quick"))
        for d in due:
            if d not in verdict.failed:
                self._passed_at[d] = now
            else:
                self._passed_at.pop(d, None)
        return verdict

    def recheck(self, devices: Sequence[str]) -> Verdict:
        """The deeper checks on idle devices, plus disk and volume checks of the home."""
        if not devices:
            return Verdict()
        return summarize(_run(list(devices), self.config.recheck_level, paths=self.paths))

    def sample(self, devices: Sequence[str], nvml=None) -> Verdict:
        """The cheap run-time sample of a running job's devices (NVML where present; faults honoured).
        `nvml`: an open `runtime.nvml.Nvml` session to reuse (None opens one for this sample)."""
        from runtime import preflight

        return summarize(preflight.monitor_sample(list(devices), nvml=nvml))

    def hung(self, heartbeat_file: Path, started_at: Optional[float]) -> Optional[str]:
        """Why a job counts as hung (its heartbeat is older than the hang timeout), or None.

        Jobs that never wrote a heartbeat are not judged: plain commands need not use the runtime."""
        from runtime.context import read_heartbeat

        if not self.config.hang_timeout:
            return None
        beat = read_heartbeat(heartbeat_file)
        if beat is None:
            return None
        last = max(float(beat["time"]), started_at or 0.0)
        idle = time.time() - last
        if idle > self.config.hang_timeout:
            return f"no progress for {idle:.0f}s (last heartbeat at step {beat['step']})"
        return None
