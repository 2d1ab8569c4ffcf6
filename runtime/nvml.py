"""NVML health checks (nvidia-ml-py's ``pynvml``): ECC, retired/remapped memory, throttling, foreign processes.

Cheap (no CUDA context, no torch import), so `runtime.preflight.monitor_sample` can call them every few
seconds while a job runs. Every function returns ``(status, value, threshold, message)``; a counter the GPU
does not support is "skipped", never "pass".
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

Outcome = tuple[str, Any, Any, str]

# Reasons that mean the hardware is protecting itself, not a policy choice (idle, app clocks, power cap).
_CRITICAL_THROTTLE = {
    "hw_slowdown": 0x8,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
}


class Nvml:
    """An NVML session; use as a context manager. `available` is False on hosts without a driver."""

    def __init__(self) -> None:
        self.available = False
        self.error = ""
        self._nvml: Any = None

    def __enter__(self) -> "Nvml":
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self.available = pynvml, True
        except Exception as exc:  # no library, no driver, no permission: all mean "no NVML here"
            self.error = str(exc) or type(exc).__name__
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def count(self) -> int:
        """Number of GPUs NVML sees (0 without NVML)."""
        return self._nvml.nvmlDeviceGetCount() if self.available else 0

    def handle(self, index: int) -> Any:
        """The NVML handle of physical GPU `index` (PCI bus order)."""
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    def name(self, index: int) -> str:
        """The GPU's marketing name, e.g. 'NVIDIA H100 80GB HBM3'."""
        name = self._nvml.nvmlDeviceGetName(self.handle(index))
        return name.decode() if isinstance(name, bytes) else str(name)

    def _call(self, fn, *args) -> Any:
        return getattr(self._nvml, fn)(*args)

    def _unsupported(self, exc: Exception) -> bool:
        return isinstance(exc, getattr(self._nvml, "NVMLError_NotSupported", ()))

    def ecc(self, index: int) -> Outcome:
        """Uncorrected (volatile) ECC errors since the driver loaded; any is a fault."""
        try:
            n = self._call("nvmlDeviceGetTotalEccErrors", self.handle(index),
                           self._nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self._nvml.NVML_VOLATILE_ECC)
        except Exception as exc:
            if self._unsupported(exc):
                return "skipped", None, 0, "ECC not supported or disabled"
            return "fail", None, 0, f"NVML ECC query failed: {exc}"
        return ("pass" if n == 0 else "fail"), int(n), 0, f"{n} uncorrected ECC errors"

    def retired_pages(self, index: int) -> Outcome:
        """Row remapping (Ampere+) or page retirement (older): a pending remap or a failed one is a fault."""
        h = self.handle(index)
        try:
            _corr, unc, pending, failed = self._call("nvmlDeviceGetRemappedRows", h)
            bad = bool(pending) or bool(failed)
            msg = f"remapped rows: {unc} uncorrectable, pending={bool(pending)}, failure={bool(failed)}"
            return ("fail" if bad else "pass"), int(unc), 0, msg
        except Exception as exc:
            if not self._unsupported(exc):
                return "fail", None, 0, f"NVML row-remap query failed: {exc}"
        try:
            pending = self._call("nvmlDeviceGetRetiredPagesPendingStatus", h)
        except Exception as exc:
            if self._unsupported(exc):
                return "skipped", None, 0, "neither row remapping nor page retirement supported"
            return "fail", None, 0, f"NVML retired-pages query failed: {exc}"
        return ("fail" if pending else "pass"), int(bool(pending)), 0, f"retired pages pending={bool(pending)}"

    def throttle(self, index: int) -> Outcome:
        """Clock event reasons; hardware/thermal slowdowns are faults, power caps and idle are not."""
        try:
            fn = ("nvmlDeviceGetCurrentClocksEventReasons" if hasattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons")
                  else "nvmlDeviceGetCurrentClocksThrottleReasons")
            mask = int(self._call(fn, self.handle(index)))
        except Exception as exc:
            if self._unsupported(exc):
                return "skipped", None, None, "clock event reasons not supported"
            return "fail", None, None, f"NVML clock-reason query failed: {exc}"
        hits = [name for name, bit in _CRITICAL_THROTTLE.items() if mask & bit]
        return ("fail" if hits else "pass"), hex(mask), "no hw/thermal slowdown", ", ".join(hits) or "clocks ok"

    def foreign_processes(self, index: int, allowed: Iterable[int] = ()) -> Outcome:
        """Compute processes on the GPU other than this process and `allowed` pids (another job's memory)."""
        ok = {os.getpid(), *allowed}
        try:
            procs = self._call("nvmlDeviceGetComputeRunningProcesses", self.handle(index))
        except Exception as exc:
            if self._unsupported(exc):
                return "skipped", None, 0, "process listing not supported"
            return "fail", None, 0, f"NVML process query failed: {exc}"
        foreign = sorted(p.pid for p in procs if p.pid not in ok)
        msg = f"foreign processes: {foreign}" if foreign else "no foreign processes"
        return ("fail" if foreign else "pass"), len(foreign), 0, msg
