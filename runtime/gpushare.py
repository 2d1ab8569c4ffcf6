"""Sharing a GPU, the job's side: its share and memory limit, the CUDA memory cap, out-of-memory, peak memory.

A job that shares a device (`submit --gpus 0.25 [--gpu-memory 10GiB]`) gets ``AUTORESEARCH_GPU_SHARE`` (its
share, a float in (0, 1]) and maybe ``AUTORESEARCH_GPU_MEMORY`` (bytes). `JobContext` uses this module to cap
the process's CUDA caching allocator at ``min(share, memory / device total)`` of the device, to turn a CUDA
out-of-memory error on a shared device into "run me alone", and to report the job's peak CUDA memory.

Import-light on purpose: nothing here imports torch. Functions that talk to CUDA take the `torch.cuda` module
as an argument (`loaded_cuda()` finds it only when the job imported torch itself), so a job that never uses
torch never pays for it, a process that never touched CUDA never initialises it, and tests pass a stand-in.

Megabytes are MLflow's (10**6 bytes), as in its `system/gpu_*_megabytes` system metrics, so the runtime's
figures and MLflow's own sit on one scale.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from runtime import protocol
from runtime.errors import RuntimeJobError

MEGABYTE = 1_000_000  # MLflow's system metrics divide bytes by 1e6


def read_env(environ: Mapping[str, str] | None = None) -> tuple[float | None, int | None]:
    """(share, memory bytes) from GPU_SHARE and GPU_MEMORY (None where unset or empty). A bad value raises
    RuntimeJobError with a one-line reason: a share must be a number in (0, 1], memory a positive integer."""
    env = os.environ if environ is None else environ
    share = memory = None
    raw = (env.get(protocol.GPU_SHARE) or "").strip()
    if raw:
        try:
            share = float(raw)
        except ValueError:
            share = math.nan
        if not 0 < share <= 1:  # also false for nan
            raise RuntimeJobError(f"{protocol.GPU_SHARE}={raw!r} is not a share of a GPU in (0, 1]")
    raw = (env.get(protocol.GPU_MEMORY) or "").strip()
    if raw:
        try:
            memory = int(raw)
        except ValueError:
            memory = 0
        if memory <= 0:
            raise RuntimeJobError(f"{protocol.GPU_MEMORY}={raw!r} is not a positive number of bytes")
    return share, memory


def memory_fraction(share: float | None, memory: int | None, total: int | None) -> float | None:
    """The fraction of a device's memory a job may use: ``min(share, memory / total)``, only the share or only
    memory/total when one is missing, at most 1. None when neither is given (no cap). `total` (the device's
    bytes) is only read when `memory` is given."""
    parts = []
    if share is not None:
        parts.append(float(share))
    if memory is not None:
        if not total or total <= 0:
            raise ValueError("the device's total memory is needed to turn a memory limit into a fraction")
        parts.append(memory / total)
    return min(1.0, *parts) if parts else None


def loaded_cuda() -> Any | None:
    """`torch.cuda` if this process has imported torch already, else None. Never imports torch."""
    torch = sys.modules.get("torch")
    return getattr(torch, "cuda", None) if torch is not None else None


def cuda_index(device: str) -> int | None:
    """The CUDA index of a torch device string ("cuda:1" -> 1, "cuda" -> 0), None for a non-CUDA device."""
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def apply_cap(cuda: Any, index: int, share: float | None, memory: int | None) -> bool:
    """Cap the caching allocator of CUDA device `index` at the job's fraction (`memory_fraction`), through
    ``cuda.set_per_process_memory_fraction``. `cuda` is the `torch.cuda` module (a stand-in in tests).

    Never initialises CUDA itself: the cap goes through ``cuda._lazy_call``, which runs it at once when CUDA
    is initialised and otherwise queues it to run inside CUDA's own lazy initialisation, before the first
    allocation (how `torch.cuda.manual_seed` defers itself). Without `_lazy_call` (a future torch) it applies
    the cap only once CUDA is initialised; the caller tries again later. Returns whether the cap was applied
    or queued (True also when there is nothing to cap)."""
    if share is None and memory is None:
        return True

    def cap() -> None:
        total = cuda.get_device_properties(index).total_memory if memory is not None else None
        fraction = memory_fraction(share, memory, total)
        if fraction is not None:
            cuda.set_per_process_memory_fraction(float(fraction), index)

    lazy = getattr(cuda, "_lazy_call", None)
    if lazy is not None:
        lazy(cap)
        return True
    if cuda.is_initialized():
        cap()
        return True
    return False


def peak_memory(cuda: Any, index: int) -> dict[str, float] | None:
    """{PEAK_MEMORY_METRIC: the most CUDA memory this process's allocator reserved on device `index`,
    DEVICE_MEMORY_METRIC: the device's total memory}, in megabytes (10**6 bytes); None when this process never
    initialised CUDA (asking would initialise it)."""
    if not cuda.is_initialized():
        return None
    return {protocol.PEAK_MEMORY_METRIC: cuda.max_memory_reserved(index) / MEGABYTE,
            protocol.DEVICE_MEMORY_METRIC: cuda.get_device_properties(index).total_memory / MEGABYTE}


def is_oom(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from or while handling, is a CUDA out-of-memory error:
    `torch.OutOfMemoryError` (torch.cuda.OutOfMemoryError) or a RuntimeError saying "CUDA out of memory"
    (what older torch and some extensions raise)."""
    seen = 0
    while exc is not None and seen < 16:
        kind = type(exc)
        if kind.__name__ == "OutOfMemoryError" and kind.__module__.split(".")[0] == "torch":
            return True
        if isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def oom_record(attempt: int, exc: BaseException) -> dict[str, Any]:
    """The `protocol.OOM_FILE` content: {"attempt", "at", "error": the error's first line}."""
    lines = str(exc).strip().splitlines()
    first = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return {"attempt": attempt, "at": time.time(), "error": first[:500]}

