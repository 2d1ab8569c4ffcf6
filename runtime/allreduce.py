"""The `allreduce` preflight check: one real process per device joins a process group and all-reduces.

NCCL among the GPUs, gloo among the cpu slots (two separate groups if both are given). Each rank sums a known tensor and checks the
result; a rank that errors or hangs fails on its own device, the others report what they saw. One device
alone has nobody to talk to: the check is "skipped" there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
from typing import Any

from runtime import faults
from runtime.checks import CheckResult
from runtime.devices import DeviceSpecError, cuda_index, is_cpu
from runtime.nvml import Nvml

NUMEL = 1 << 20  # 4 MiB of fp32 per rank: large enough to exercise the transport, small enough for seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, device: str, backend: str, results: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: don't depend on hostname resolution
        kwargs = {}
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
            kwargs["device_id"] = torch.device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                **kwargs)
        t = torch.full((NUMEL,), float(rank + 1), device=device)
        dist.all_reduce(t)  # warm-up: connection setup is not bandwidth
        t.fill_(float(rank + 1))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        got = t[:16].cpu()
        dt = time.perf_counter() - t0
        want = world * (world + 1) / 2
        ok = bool((got == want).all()) and float(t.sum().item()) == want * NUMEL
        # bus bandwidth as nccl-tests defines it: 2(n-1)/n times the data size over the time
        busbw = 2 * (world - 1) / world * NUMEL * 4 / dt / 1e9
        dist.destroy_process_group()
        results.put((rank, ok, round(busbw, 2), f"sum {'ok' if ok else 'WRONG'}; {busbw:.2f} GB/s bus bandwidth"))
    except Exception as exc:  # reported as this rank's failure; the parent never sees a traceback
        results.put((rank, False, None, f"{type(exc).__name__}: {exc}"))


def allreduce_check(devices: list[str], timeout_s: float = 120.0) -> list[CheckResult]:
    """Run the all-reduce across `devices` and return one result per device, in order. GPUs and cpu slots
    form separate groups (NCCL and gloo): a CPU all-reduce says nothing about a GPU's links."""
    gpus = [d for d in devices if not is_cpu(d)]
    cpus = [d for d in devices if is_cpu(d)]
    by_device = {r.device: r for group in (gpus, cpus) if group for r in _group_check(group, timeout_s)}
    return [by_device[d] for d in devices]


def _group_check(devices: list[str], timeout_s: float) -> list[CheckResult]:
    if len(devices) < 2:
        return [_final(d, "skipped", None, "a single device has no peer to all-reduce with") for d in devices]
    gpus = not any(is_cpu(d) for d in devices)
    backend = "nccl" if gpus else "gloo"
    ctx = mp.get_context("spawn")  # fork after torch/CUDA init is unsafe
    results = ctx.Queue()
    port = _free_port()
    if gpus:
        try:
            with Nvml() as nv:
                targets = [f"cuda:{cuda_index(d, nv)}" for d in devices]
        except DeviceSpecError as exc:
            return [_final(d, "fail", None, f"{backend}: {exc}") for d in devices]
    else:
        targets = ["cpu"] * len(devices)
    procs = []
    for rank, dev in enumerate(targets):
        p = ctx.Process(target=_worker, args=(rank, len(devices), port, dev, backend, results), daemon=True)
        p.start()
        procs.append(p)
    seen: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < len(devices) and time.monotonic() < deadline:
        try:
            rank, ok, value, msg = results.get(timeout=0.2)
            seen[rank] = (ok, value, msg)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=1)
        if p.is_alive():
            p.kill()
            p.join()
    out = []
    for rank, d in enumerate(devices):
        ok, value, msg = seen.get(rank, (False, None, f"no answer within {timeout_s:.0f}s (hung or crashed)"))
        out.append(_final(d, "pass" if ok else "fail", value, f"{backend}: {msg}"))
    return out


def _final(device: str, status: str, value: Any, message: str) -> CheckResult:
    if faults.injected(device, "allreduce"):
        return CheckResult("allreduce", device, "fail", message=faults.INJECTED)
    return CheckResult("allreduce", device, status, value, None, message)
