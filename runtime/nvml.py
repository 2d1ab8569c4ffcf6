"""NVML health checks (nvidia-ml-py's ``pynvml``): ECC, retired/remapped memory, throttling, foreign processes.

Cheap (no CUDA context, no torch import), so the service can sample them every few seconds while a job runs.
Every check returns ``(status, value, threshold, message)``; a counter the GPU does not support is "skipped",
never "pass". Devices are named as `runtime.devices` names them: a physical index ("3", PCI bus order, as
NVML numbers GPUs) or a UUID ("GPU-...", "MIG-...", a unique prefix is enough, as for CUDA_VISIBLE_DEVICES).

A session is either short (``with Nvml() as nv``: preflight) or long-lived (`open()` once, `close()` at the
end: the service's monitor, so NVML is not initialised and shut down every few seconds). With `timeout_s`,
every call runs on one worker thread and gives up after that long (a wedged driver must not wedge the caller);
while a timed-out call is still stuck, later calls fail at once instead of queueing behind it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

Outcome = tuple[str, Any, Any, str]

# Reasons that mean the hardware is protecting itself, not a policy choice (idle, app clocks, power cap).
_CRITICAL_THROTTLE = {
    "hw_slowdown": 0x8,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
}
# Newer drivers and nvidia-ml-py name it "clocks event reasons"; older drivers only have the throttle call
# (the newer Python binding may still define the function and then fail with FunctionNotFound).
CLOCK_REASON_CALLS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")


MPS_SERVER = "nvidia-cuda-mps-server"  # the process name of an MPS server: it holds its clients' contexts


def is_mps_server(pid: int) -> bool:
    """Whether `pid` is an NVIDIA MPS server (what NVML lists as a compute process for a device under MPS)."""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip() == MPS_SERVER[:15]  # comm keeps the first 15 characters
    except OSError:
        return False


class NvmlTimeout(Exception):
    """An NVML call did not return within the session's timeout."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """An NVML session. `available` is False on hosts without a driver (or without nvidia-ml-py).

    `lib` is a pynvml-shaped module (tests pass a fake; None imports pynvml). `timeout_s` bounds each call.
    """

    def __init__(self, lib: Any = None, *, timeout_s: float | None = None) -> None:
        self.available = False
        self.error = ""
        self._lib = lib
        self._nvml: Any = None
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._stuck: Future | None = None
        self._lock = threading.Lock()

    # -- session -----------------------------------------------------------------------------------------

    def open(self) -> "Nvml":
        """Initialise NVML (idempotent); on failure `available` stays False and `error` says why."""
        if self.available:
            return self
        try:
            lib = self._lib
            if lib is None:
                import pynvml as lib
            if self.timeout_s is not None and self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
            self._nvml = lib
            self._bounded(lib.nvmlInit)
            self.available, self.error = True, ""
        except Exception as exc:  # no library, no driver, no permission, a hung init: all mean "no NVML here"
            self.error = str(exc) or type(exc).__name__
        return self

    def close(self) -> None:
        """Shut NVML down (errors ignored) and stop the worker thread."""
        if self.available:
            self.available = False
            try:
                self._bounded(self._nvml.nvmlShutdown)
            except Exception:
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __enter__(self) -> "Nvml":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _bounded(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            return fn(*args)
        with self._lock:
            if self._stuck is not None and not self._stuck.done():
                raise NvmlTimeout("an earlier NVML call is still hung")
            future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._stuck = future
            raise NvmlTimeout(f"NVML call {getattr(fn, '__name__', fn)} took over {self.timeout_s:g}s") from None

    def _call(self, fn: str, *args: Any) -> Any:
        return self._bounded(getattr(self._nvml, fn), *args)

    def _is(self, exc: Exception, name: str) -> bool:
        return isinstance(exc, getattr(self._nvml, name, ()))

    def _unsupported(self, exc: Exception) -> bool:
        return self._is(exc, "NVMLError_NotSupported")

    # -- identity ----------------------------------------------------------------------------------------

    def count(self) -> int:
        """Number of GPUs NVML sees (0 without NVML)."""
        return int(self._call("nvmlDeviceGetCount")) if self.available else 0

    def _mig_handles(self, parent: Any) -> list[Any]:
        try:
            n = int(self._call("nvmlDeviceGetMaxMigDeviceCount", parent))
        except Exception:
            return []  # not MIG-capable, or an NVML without MIG calls
        out = []
        for i in range(n):
            try:
                out.append(self._call("nvmlDeviceGetMigDeviceHandleByIndex", parent, i))
            except Exception:
                continue  # a slot without an instance
        return out

    def inventory(self) -> list[tuple[str, str]]:
        """(name, UUID) of every GPU NVML sees, by index, followed by the MIG instances of each (by UUID)."""
        gpus, migs = [], []
        for i in range(self.count()):
            h = self._call("nvmlDeviceGetHandleByIndex", i)
            gpus.append((str(i), _text(self._call("nvmlDeviceGetUUID", h))))
            for m in self._mig_handles(h):
                uuid = _text(self._call("nvmlDeviceGetUUID", m))
                migs.append((uuid, uuid))
        return gpus + migs

    def handle(self, name: str | int) -> Any:
        """The NVML handle of device `name`: a physical index, or a (prefix of a) GPU-/MIG- UUID."""
        name = str(name)
        if name.isdigit():
            return self._call("nvmlDeviceGetHandleByIndex", int(name))
        matches = [uuid for _, uuid in self.inventory() if uuid.startswith(name)]
        if len(matches) != 1:
            raise LookupError(f"{name} matches {len(matches)} devices NVML sees (need exactly one)")
        return self._call("nvmlDeviceGetHandleByUUID", matches[0])

    def uuid(self, name: str | int) -> str:
        """The full UUID ("GPU-..." or "MIG-...") of device `name`."""
        return _text(self._call("nvmlDeviceGetUUID", self.handle(name)))

    def name(self, index: str | int) -> str:
        """The GPU's marketing name, e.g. 'NVIDIA H100 80GB HBM3'."""
        return _text(self._call("nvmlDeviceGetName", self.handle(index)))

    def usage(self, name: str | int) -> tuple[int, int, int]:
        """(GPU utilisation %, memory used, memory total in bytes) of device `name`, for live views."""
        h = self.handle(name)
        util = self._call("nvmlDeviceGetUtilizationRates", h)
        mem = self._call("nvmlDeviceGetMemoryInfo", h)
        return int(util.gpu), int(mem.used), int(mem.total)

    # -- checks ------------------------------------------------------------------------------------------

    def ecc(self, index: str | int) -> Outcome:
        """Uncorrected (volatile) ECC errors since the driver loaded; any is a fault."""
        try:
            n = self._call("nvmlDeviceGetTotalEccErrors", self.handle(index),
                           self._nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self._nvml.NVML_VOLATILE_ECC)
        except Exception as exc:
            if self._unsupported(exc):
                return "skipped", None, 0, "ECC not supported or disabled"
            return "fail", None, 0, f"NVML ECC query failed: {exc}"
        return ("pass" if n == 0 else "fail"), int(n), 0, f"{n} uncorrected ECC errors"

    def retired_pages(self, index: str | int) -> Outcome:
        """Row remapping (Ampere+) or page retirement (older): a pending remap or a failed one is a fault."""
        try:
            h = self.handle(index)
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

    def clock_reasons(self, index: str | int) -> tuple[int, str]:
        """The clock event (throttle) reason bitmask and the NVML call that answered: the newer call first,
        the older one on drivers without it. Raises what NVML raised (NotSupported included)."""
        h = self.handle(index)
        last: Exception | None = None
        for fn in CLOCK_REASON_CALLS:
            if not hasattr(self._nvml, fn):
                continue
            try:
                return int(self._call(fn, h)), fn
            except Exception as exc:
                if not self._is(exc, "NVMLError_FunctionNotFound"):
                    raise
                last = exc  # the binding has it, the driver does not: try the older call
        raise last or LookupError("this NVML has no clock-event-reasons call")

    def throttle(self, index: str | int) -> Outcome:
        """Clock event reasons; hardware/thermal slowdowns are faults, power caps and idle are not."""
        try:
            mask, _ = self.clock_reasons(index)
        except Exception as exc:
            if self._unsupported(exc):
                return "skipped", None, None, "clock event reasons not supported"
            return "fail", None, None, f"NVML clock-reason query failed: {exc}"
        hits = [name for name, bit in _CRITICAL_THROTTLE.items() if mask & bit]
        return ("fail" if hits else "pass"), hex(mask), "no hw/thermal slowdown", ", ".join(hits) or "clocks ok"

    def processes(self, index: str | int) -> list[int]:
        """Pids of the compute processes on the device."""
        return sorted(p.pid for p in self._call("nvmlDeviceGetComputeRunningProcesses", self.handle(index)))

    def foreign_processes(self, index: str | int, allowed: Iterable[int] = ()) -> Outcome:
        """Compute processes on the GPU other than this process and `allowed` pids (another job's memory). An
        MPS server (`serve --mps`: the device's clients run inside it) is the service's own, never foreign."""
        ok = {os.getpid(), *allowed}
        try:
            pids = self.processes(index)
        except Exception as exc:
            if self._unsupported(exc):
                return "skipped", None, 0, "process listing not supported"
            return "fail", None, 0, f"NVML process query failed: {exc}"
        foreign = [p for p in pids if p not in ok and not is_mps_server(p)]
        msg = f"foreign processes: {foreign}" if foreign else "no foreign processes"
        return ("fail" if foreign else "pass"), len(foreign), 0, msg
