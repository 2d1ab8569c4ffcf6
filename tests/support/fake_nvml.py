"""A pynvml-shaped fake for the NVML edge (no driver exists on the test machines).

Only what `runtime.nvml.Nvml` calls is here. Knobs: the GPUs' UUIDs (and MIG instances), which
clock-reason calls exist (newer drivers: both; older: only the throttle call; a new binding on an old driver:
the new call raises FunctionNotFound), a throttle mask per sample, a call that hangs, and each GPU's utilisation
and memory (set `util[i]` and `used[i]` between samples, as a load would change them).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace


class NVMLError(Exception):
    """Base of the fake's NVML errors, as in pynvml."""


class NVMLError_NotSupported(NVMLError):  # noqa: N801 (pynvml's spelling)
    """The device does not support the query."""


class NVMLError_FunctionNotFound(NVMLError):  # noqa: N801
    """The driver library lacks the symbol."""


class FakeNvml:
    """GPUs with the given UUIDs. `clock_events`: "new" (both calls), "old" (only the throttle call),
    "missing-symbol" (the new call exists but raises FunctionNotFound). `masks`: throttle masks returned in
    turn (the last repeats). `hang`: an Event; while it is not set, GetTotalEccErrors blocks. `util`/`used`:
    utilisation (percent) and memory used (bytes) by GPU index (0 when unset), of `total` bytes each."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, uuids: list[str], *, migs: dict[int, list[str]] | None = None, clock_events: str = "new",
                 masks: list[int] | None = None, hang: threading.Event | None = None, pids: list[int] | None = None,
                 total: int = 80 * 2**30):
        self.uuids, self.migs = list(uuids), dict(migs or {})
        self.masks = list(masks or [0])
        self.hang = hang
        self.pids = list(pids or [])
        self.util: dict[int, int] = {}
        self.used: dict[int, int] = {}
        self.total = total
        self.inits = self.shutdowns = 0
        self.calls: list[str] = []
        if clock_events in ("new", "missing-symbol"):
            self.nvmlDeviceGetCurrentClocksEventReasons = self._events if clock_events == "new" else self._missing

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.uuids):
            raise NVMLError(f"invalid index {i}")
        return SimpleNamespace(uuid=self.uuids[i], index=i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for i, u in enumerate(self.uuids):
            if u == uuid:
                return SimpleNamespace(uuid=u, index=i)
        for parent, children in self.migs.items():
            if uuid in children:
                return SimpleNamespace(uuid=uuid, index=parent)
        raise NVMLError(f"no device {uuid}")

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        if h.index not in self.migs:
            raise NVMLError_NotSupported()
        return len(self.migs[h.index])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        return SimpleNamespace(uuid=self.migs[h.index][i], index=h.index)

    def nvmlDeviceGetUUID(self, h):
        return h.uuid

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA Fake GPU"

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        self.calls.append("ecc")
        if self.hang is not None:
            self.hang.wait()
        return 0

    def nvmlDeviceGetRemappedRows(self, h):
        return 0, 0, 0, 0

    def nvmlDeviceGetUtilizationRates(self, h):
        self.calls.append("util")
        return SimpleNamespace(gpu=self.util.get(h.index, 0), memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        used = self.used.get(h.index, 0)
        return SimpleNamespace(used=used, total=self.total, free=self.total - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=0) for p in self.pids]

    def _mask(self):
        return self.masks.pop(0) if len(self.masks) > 1 else self.masks[0]

    def _events(self, h):
        self.calls.append("events")
        return self._mask()

    def _missing(self, h):
        self.calls.append("events-missing")
        raise NVMLError_FunctionNotFound()

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        self.calls.append("throttle")
        return self._mask()
