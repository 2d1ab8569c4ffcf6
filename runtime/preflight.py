"""Device preflight: structured pass/fail/skipped checks before a job (quick) and on idle devices (full).

Devices are names as `runtime.devices` defines them: GPU indices "0", "1" (physical, PCI bus order, as NVML
numbers them), GPU-/MIG- UUIDs, or virtual CPU slots "cpu:0". Checks, per device:

- quick: ``visible``, ``cuda_init``, ``alloc``, ``matmul`` (device result vs CPU), and through NVML ``ecc``,
  ``retired_pages``, ``throttle``, ``foreign_procs``; per path (device "host"): ``disk`` (free space) and
  ``volume`` (write, fsync, read back, delete).
- full adds: ``matmul_tflops`` (bf16 throughput vs the GPU model's expectation), ``mem_bandwidth``
  (device copy), ``allreduce`` across all the devices (one real process each: NCCL on GPUs, gloo on CPU).

On a cpu slot the GPU-only checks are "skipped", never "pass"; ``visible``/``alloc``/``matmul`` and the
all-reduce run for real on the CPU. On a GPU shared with running jobs (AUTORESEARCH_GPU_SHARE and/or
AUTORESEARCH_GPU_MEMORY in the checking process's environment, as a sharing job gets them) the checks stay
within that share: the process's CUDA allocator is capped at it and the test tensors shrink to fit (the
bf16 throughput check keeps its size: an overrun fails that check, it never takes a neighbour's memory).
Faults from AUTORESEARCH_FAULTS (see `runtime.faults`) replace a check's result with "fail" on the named
device only. `healthy()` and `reason()` summarise for the service;
`run_isolated()` runs the checks in a child process (so the service never holds a CUDA context on a GPU it
hands out); `monitor_sample()` is the cheap NVML-only sample it takes while a job runs.
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from runtime import gpushare
from runtime.checks import STATUSES, CheckResult, healthy, outcome, reason
from runtime.devices import DeviceSpecError, cuda_index, is_cpu, parse_devices
from runtime.nvml import Nvml

__all__ = ["CHECKS", "FULL", "GPU_ONLY", "HOST", "QUICK", "STATUSES", "CheckResult", "DeviceSpecError", "Nvml",
           "PreflightConfig", "healthy", "is_cpu", "monitor_sample", "parse_devices", "reason", "run",
           "run_isolated"]

QUICK = ("visible", "cuda_init", "alloc", "matmul", "ecc", "retired_pages", "throttle", "foreign_procs")
FULL = QUICK + ("matmul_tflops", "mem_bandwidth")
HOST = ("disk", "volume")
CHECKS = FULL + ("allreduce",) + HOST
GPU_ONLY = {"cuda_init", "ecc", "retired_pages", "throttle", "foreign_procs", "matmul_tflops", "mem_bandwidth"}
MONITOR = ("ecc", "retired_pages", "throttle")

# Sustained dense bf16 TFLOPS and device-copy GB/s a healthy card reaches in a plain torch loop (about 70-80%
# of the datasheet); a card below `PreflightConfig.expect_fraction` of these is flagged.
EXPECTED = {
    "H200": (700.0, 3600.0), "H100 PCIe": (480.0, 1600.0), "H100": (650.0, 2600.0), "A100": (250.0, 1500.0),
    "L40S": (250.0, 700.0), "L4": (90.0, 240.0), "A10": (100.0, 480.0), "V100": (90.0, 750.0),
}


@dataclass(frozen=True)
class PreflightConfig:
    """Thresholds and sizes of the checks."""

    min_free_gb: float = 5.0
    alloc_mb: int = 256
    copy_mb: int = 1024
    matmul_n: int = 512
    matmul_rtol: float = 1e-3
    expect_fraction: float = 0.6
    allreduce_timeout_s: float = 120.0
    allowed_pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.min_free_gb < 0 or self.alloc_mb <= 0 or self.copy_mb <= 0 or self.matmul_n <= 0:
            raise ValueError("min_free_gb must be >= 0, alloc_mb, copy_mb and matmul_n > 0")
        if not 0 < self.expect_fraction <= 1:
            raise ValueError("expect_fraction must be in (0, 1]")


def shared_budget(total: int, environ: Mapping[str, str] | None = None) -> int | None:
    """The bytes a check may use on a GPU of `total` bytes that it shares with running jobs, per GPU_SHARE and
    GPU_MEMORY in `environ` (default: this process's), or None on a GPU of its own."""
    share, memory = gpushare.read_env(environ)
    fraction = gpushare.memory_fraction(share, memory, total)
    return None if fraction is None else int(fraction * total)


def within_budget(cfg: PreflightConfig, budget: int) -> PreflightConfig:
    """`cfg` with its test tensors (alloc, and the device copy's two buffers) cut to half of `budget` bytes at
    most: the allocator rounds blocks up and the CUDA context is not counted in the cap."""
    half_mb = max(1, budget // 2 >> 20)
    return replace(cfg, alloc_mb=min(cfg.alloc_mb, half_mb), copy_mb=min(cfg.copy_mb, max(1, half_mb // 2)))


def _matmul_check(dev: str, cfg: PreflightConfig) -> tuple:
    import torch

    g = torch.Generator().manual_seed(1234)
    a, b = (torch.randn(cfg.matmul_n, cfg.matmul_n, generator=g) for _ in range(2))
    want = (a.double() @ b.double())
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # compare IEEE fp32 with fp32, not TF32's 10-bit mantissa
    try:
        got = (a.to(dev) @ b.to(dev)).cpu().double()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    err = ((got - want).abs().max() / want.abs().max()).item()
    return ("pass" if err <= cfg.matmul_rtol else "fail"), err, cfg.matmul_rtol, f"max relative error {err:.2e}"


def _alloc_check(dev: str, cfg: PreflightConfig) -> tuple:
    import torch

    n = cfg.alloc_mb * (1 << 20) // 4
    t = torch.full((n,), 3.0, device=dev)
    total = t.sum().item()
    del t
    ok = total == 3.0 * n
    return ("pass" if ok else "fail"), cfg.alloc_mb, cfg.alloc_mb, f"allocated and summed {cfg.alloc_mb} MiB"


def _cpu_alloc_check(cfg: PreflightConfig) -> tuple:
    """A cpu slot's memory: allocate, fill and count `alloc_mb` MiB. The standard library, not torch: the
    service checks its cpu slots in its own process, which must not carry torch (hundreds of MB)."""
    n, step = cfg.alloc_mb << 20, 1 << 20
    fill = b"\x03" * step
    counted = 0
    # A mapping of its own, unmapped at the end: a heap block of this size stayed resident after it was freed
    # (glibc raises its mmap threshold to the size of the last block it unmapped, so the next check's block
    # came from the heap), and the service grew by 17 MB at its first re-check (benchmarks/queue_soak.py).
    with mmap.mmap(-1, n) as block:
        for start in range(0, n, step):
            block[start:start + step] = fill[:min(step, n - start)]
        for start in range(0, n, step):
            counted += block[start:start + step].count(3)
    ok = counted == n
    return ("pass" if ok else "fail"), cfg.alloc_mb, cfg.alloc_mb, f"allocated and counted {cfg.alloc_mb} MiB"


def _cpu_matmul_check(cfg: PreflightConfig) -> tuple:
    """A cpu slot's arithmetic: an n x n matrix times a vector in floating point against the exact integer
    result (entries small enough that every float operation is exact). Standard library, O(n^2)."""
    import operator
    import random

    rng = random.Random(1234)
    n, bound = cfg.matmul_n, 1 << 20
    rows = [[rng.getrandbits(21) - bound for _ in range(n)] for _ in range(n)]
    vec = [rng.getrandbits(21) - bound for _ in range(n)]
    fvec = [float(v) for v in vec]
    want = [sum(map(operator.mul, row, vec)) for row in rows]
    got = [sum(map(operator.mul, map(float, row), fvec)) for row in rows]
    err = max(abs(g - w) for g, w in zip(got, want)) / max(1, max(abs(w) for w in want))
    return ("pass" if err <= cfg.matmul_rtol else "fail"), err, cfg.matmul_rtol, f"max relative error {err:.2e}"


def _cuda_init(dev: str) -> tuple:
    import torch

    torch.zeros(1, device=dev).add_(1)
    torch.cuda.synchronize(dev)
    return "pass", torch.cuda.get_device_name(dev), None, "CUDA context created"


def _expectation(name: str) -> tuple[float, float] | None:
    for key, value in EXPECTED.items():  # ordered: "H100 PCIe" before "H100"
        if key in name:
            return value
    return None


def _timed(fn: Callable[[], None], dev: str, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) / iters


def _throughput(dev: str, name: str, cfg: PreflightConfig) -> tuple:
    import torch

    n = 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    tflops = 2 * n**3 / _timed(lambda: a @ b, dev, 20) / 1e12
    exp = _expectation(name)
    if exp is None:
        return "pass", round(tflops, 1), None, f"{tflops:.0f} TFLOPS bf16; no expectation for {name}"
    need = exp[0] * cfg.expect_fraction
    return ("pass" if tflops >= need else "fail"), round(tflops, 1), round(need, 1), f"{tflops:.0f} TFLOPS bf16 ({name})"


def _bandwidth(dev: str, name: str, cfg: PreflightConfig) -> tuple:
    import torch

    src = torch.empty(cfg.copy_mb << 18, device=dev)  # copy_mb MiB of fp32 (1 GiB by default)
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src), dev, 10) / 1e9  # read + write
    exp = _expectation(name)
    if exp is None:
        return "pass", round(gbs), None, f"{gbs:.0f} GB/s device copy; no expectation for {name}"
    need = exp[1] * cfg.expect_fraction
    return ("pass" if gbs >= need else "fail"), round(gbs), round(need), f"{gbs:.0f} GB/s device copy ({name})"


def _device_checks(device: str, level: str, cfg: PreflightConfig, nv: Nvml) -> list[CheckResult]:
    names = FULL if level == "full" else QUICK
    if is_cpu(device):
        cpu_runs = {"visible": lambda: ("pass", "cpu", None, "cpu slot"),
                    "alloc": lambda: _cpu_alloc_check(cfg), "matmul": lambda: _cpu_matmul_check(cfg)}
        return [outcome(c, device, cpu_runs.get(c, lambda: ()), None if c in cpu_runs else "cpu slot: no GPU")
                for c in names]
    import torch

    out: list[CheckResult] = []
    try:
        idx = cuda_index(device, nv)  # by UUID: NVML's device and CUDA's must be the same card
        vis = ("pass", idx, torch.cuda.device_count(), f"torch index {idx}")
    except DeviceSpecError as exc:
        idx, vis = -1, ("fail", None, None, str(exc))
    out.append(outcome("visible", device, lambda: vis))
    down = None if out[0].status == "pass" else "device not visible"
    dev = f"cuda:{idx}"
    if not down:
        torch.cuda.set_device(dev)  # later CUDA calls (and their context) land on this card, never on cuda:0
    out.append(outcome("cuda_init", device, lambda: _cuda_init(dev), down))
    down = down or (None if out[-1].status == "pass" else "CUDA did not initialise")
    if not down:
        total = torch.cuda.get_device_properties(dev).total_memory
        budget = shared_budget(total)
        if budget is not None:  # neighbours run on this GPU: stay inside the share a job would get
            torch.cuda.set_per_process_memory_fraction(budget / total, idx)
            cfg = within_budget(cfg, budget)
    gpu_name = torch.cuda.get_device_name(dev) if not down else ""
    nvml_skip = None if nv.available else f"NVML unavailable: {nv.error}"
    phys = device
    runs = {
        "alloc": lambda: _alloc_check(dev, cfg), "matmul": lambda: _matmul_check(dev, cfg),
        "matmul_tflops": lambda: _throughput(dev, gpu_name, cfg), "mem_bandwidth": lambda: _bandwidth(dev, gpu_name, cfg),
    }
    nvml_runs = {
        "ecc": lambda: nv.ecc(phys), "retired_pages": lambda: nv.retired_pages(phys),
        "throttle": lambda: nv.throttle(phys), "foreign_procs": lambda: nv.foreign_processes(phys, cfg.allowed_pids),
    }
    for c in names[2:]:
        if c in nvml_runs:
            out.append(outcome(c, device, nvml_runs[c], nvml_skip))
        else:
            out.append(outcome(c, device, runs[c], down))
    return out


def _path_checks(path: Path, cfg: PreflightConfig) -> list[CheckResult]:
    def disk() -> tuple:
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free / 1e9
        ok = free >= cfg.min_free_gb
        return ("pass" if ok else "fail"), round(free, 2), cfg.min_free_gb, f"{free:.1f} GB free at {path}"

    def volume() -> tuple:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".preflight-{uuid.uuid4().hex[:8]}"
        payload = os.urandom(4096)
        t0 = time.perf_counter()
        try:
            with open(probe, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            ok = probe.read_bytes() == payload
        finally:
            probe.unlink(missing_ok=True)
        ms = (time.perf_counter() - t0) * 1000
        return ("pass" if ok else "fail"), round(ms, 1), None, f"write+fsync+read at {path} in {ms:.0f} ms"

    return [outcome("disk", "host", disk), outcome("volume", "host", volume)]


def run(devices: Sequence[str], level: str = "quick", *, paths: Iterable[str | os.PathLike] = (),
        config: PreflightConfig = PreflightConfig()) -> list[CheckResult]:
    """Run the `level` checks ("quick" or "full") on `devices` and the disk/volume checks on `paths`."""
    if level not in ("quick", "full"):
        raise ValueError(f"level must be quick or full, not {level!r}")
    if os.environ.get("CUDA_DEVICE_ORDER") is None:
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so torch numbers GPUs the way NVML does
    results: list[CheckResult] = []
    with Nvml() as nv:
        for device in devices:
            results.extend(_device_checks(device, level, config, nv))
    if level == "full":
        from runtime.allreduce import allreduce_check

        results.extend(allreduce_check(list(devices), config.allreduce_timeout_s))
    for p in paths:
        results.extend(_path_checks(Path(p), config))
    return results


def monitor_sample(devices: Sequence[str], *, allowed_pids: Iterable[int] | None = None,
                   nvml: Nvml | None = None) -> list[CheckResult]:
    """The cheap run-time sample (NVML only, no CUDA context): ecc, retired_pages, throttle, and
    foreign_procs when `allowed_pids` (the job's processes) is given. Faults are honoured on cpu slots too.
    `nvml`: an open long-lived session to use (the service's monitor); None opens one for this call."""
    names = list(MONITOR) + (["foreign_procs"] if allowed_pids is not None else [])
    allowed = tuple(allowed_pids or ())
    if nvml is None:
        with Nvml() as nv:
            return monitor_sample(devices, allowed_pids=allowed_pids, nvml=nv)
    nv = nvml
    out = []
    for device in devices:
        for c in names:
            if is_cpu(device) or not nv.available:
                out.append(outcome(c, device, lambda: (), "cpu slot: no GPU" if is_cpu(device) else nv.error))
                continue
            fn = {"ecc": lambda: nv.ecc(device), "retired_pages": lambda: nv.retired_pages(device),
                  "throttle": lambda: nv.throttle(device),
                  "foreign_procs": lambda: nv.foreign_processes(device, allowed)}[c]
            out.append(outcome(c, device, fn))
    return out


def run_isolated(devices: Sequence[str], level: str = "quick", *, paths: Iterable[str | os.PathLike] = (),
                 timeout_s: float = 300.0, env: dict[str, str] | None = None) -> list[CheckResult]:
    """`run()` in a child process, so the caller (the service) never holds a CUDA context on a GPU it hands
    to jobs, and a hung driver call cannot hang it. A child that dies or times out fails every device.

    The results come back in a file of their own, not on stdout: the child's stdout is shared with NCCL,
    CUDA and library chatter (NCCL_DEBUG=INFO prints there), which must not turn into a failed device."""
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="autoresearch-preflight-") as tmp:
        result_file = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "runtime.preflight", "--level", level, "--names", ",".join(devices),
               "--result-file", str(result_file)]
        for p in paths:
            cmd += ["--path", str(p)]
        root = str(Path(__file__).resolve().parents[1])
        child_env = dict(env if env is not None else os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
        try:
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  timeout=timeout_s, env=child_env)
        except subprocess.TimeoutExpired:
            why = f"preflight did not finish within {timeout_s:.0f}s"
        else:
            try:
                return [CheckResult(**r) for r in json.loads(result_file.read_text())]
            except (OSError, ValueError, TypeError):
                tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-300:]
                why = f"preflight process failed (exit {proc.returncode}): {tail}"
    return [CheckResult("preflight", d, "fail", message=why) for d in devices]


def _main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m runtime.preflight", description="device preflight, JSON out")
    ap.add_argument("--names", default="", help="device names, comma-separated: cpu:0,cpu:1 or 0,1")
    ap.add_argument("--level", default="quick", choices=("quick", "full"))
    ap.add_argument("--path", action="append", default=[])
    ap.add_argument("--result-file", help="write the JSON results here (atomically) instead of to stdout")
    a = ap.parse_args()
    devices = [d for d in a.names.split(",") if d]
    text = json.dumps([r.to_dict() for r in run(devices, a.level, paths=a.path)])
    if not a.result_file:
        print(text)
        return
    tmp = f"{a.result_file}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, a.result_file)  # a child killed mid-write leaves no half a result behind


if __name__ == "__main__":
    _main()
