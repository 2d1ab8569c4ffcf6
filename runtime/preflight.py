"""Device preflight: structured pass/fail/skipped checks before a job (quick) and on idle devices (full).

Devices are strings: GPU indices "0", "1" (physical, PCI bus order, as NVML numbers them) or virtual CPU
slots "cpu:0". Checks, per device:

- quick: ``visible``, ``cuda_init``, ``alloc``, ``matmul`` (device result vs CPU), and through NVML ``ecc``,
  ``retired_pages``, ``throttle``, ``foreign_procs``; per path (device "host"): ``disk`` (free space) and
  ``volume`` (write, fsync, read back, delete).
- full adds: ``matmul_tflops`` (bf16 throughput vs the GPU model's expectation), ``mem_bandwidth``
  (device copy), ``allreduce`` across all the devices (one real process each: NCCL on GPUs, gloo on CPU).

On a cpu slot the GPU-only checks are "skipped", never "pass"; ``visible``/``alloc``/``matmul`` and the
all-reduce run for real on the CPU. Faults from AUTORESEARCH_FAULTS (see `runtime.faults`) replace a check's
result with "fail" on the named device only. `healthy()` and `reason()` summarise for the service;
`run_isolated()` runs the checks in a child process (so the service never holds a CUDA context on a GPU it
hands out); `monitor_sample()` is the cheap NVML-only sample it takes while a job runs.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime import faults
from runtime.errors import PreflightError
from runtime.nvml import Nvml

QUICK = ("visible", "cuda_init", "alloc", "matmul", "ecc", "retired_pages", "throttle", "foreign_procs")
FULL = QUICK + ("matmul_tflops", "mem_bandwidth")
HOST = ("disk", "volume")
CHECKS = FULL + ("allreduce",) + HOST
GPU_ONLY = {"cuda_init", "ecc", "retired_pages", "throttle", "foreign_procs", "matmul_tflops", "mem_bandwidth"}
STATUSES = ("pass", "fail", "skipped")

# Sustained dense bf16 TFLOPS and device-copy GB/s a healthy card reaches in a plain torch loop (about 70-80%
# of the datasheet); a card below `PreflightConfig.expect_fraction` of these is flagged.
EXPECTED = {
    "H200": (700.0, 3600.0), "H100 PCIe": (480.0, 1600.0), "H100": (650.0, 2600.0), "A100": (250.0, 1500.0),
    "L40S": (250.0, 700.0), "L4": (90.0, 240.0), "A10": (100.0, 480.0), "V100": (90.0, 750.0),
}


class DeviceSpecError(PreflightError, ValueError):
    """A --devices value that names no devices (bad syntax, or `auto` on a host without GPUs)."""


@dataclass(frozen=True)
class CheckResult:
    """One check on one device. `value` is what was measured, `threshold` what it was held against."""

    check: str
    device: str
    status: str
    value: Any = None
    threshold: Any = None
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class PreflightConfig:
    """Thresholds and sizes of the checks."""

    min_free_gb: float = 5.0
    alloc_mb: int = 256
    matmul_n: int = 512
    matmul_rtol: float = 1e-3
    expect_fraction: float = 0.6
    allreduce_timeout_s: float = 120.0
    allowed_pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.min_free_gb < 0 or self.alloc_mb <= 0 or self.matmul_n <= 0:
            raise ValueError("min_free_gb must be >= 0, alloc_mb and matmul_n > 0")
        if not 0 < self.expect_fraction <= 1:
            raise ValueError("expect_fraction must be in (0, 1]")


def parse_devices(spec: str) -> list[str]:
    """"cpu:N" -> ["cpu:0", ..., "cpu:N-1"]; "0,1,3" -> ["0", "1", "3"]; "auto" -> this host's GPUs."""
    text = (spec or "").strip()
    if text == "auto":
        with Nvml() as nv:
            n = nv.count()
        if not n:
            import torch

            n = torch.cuda.device_count()
        if not n:
            raise DeviceSpecError("no GPU found (NVML and torch.cuda see none); use --devices cpu:N for N CPU slots")
        return [str(i) for i in range(n)]
    if m := re.fullmatch(r"cpu:(\d+)", text):
        if not 1 <= int(m.group(1)) <= 1024:
            raise DeviceSpecError(f"bad devices {spec!r}: cpu:N needs 1 <= N <= 1024")
        return [f"cpu:{i}" for i in range(int(m.group(1)))]
    if re.fullmatch(r"\d+(,\d+)*", text) and len(set(text.split(","))) == len(text.split(",")):
        return text.split(",")
    raise DeviceSpecError(f"bad devices {spec!r}: expected auto, cpu:N or GPU indices like 0,1,3")


def is_cpu(device: str) -> bool:
    """Whether `device` is a virtual CPU slot."""
    return device.startswith("cpu:")


def torch_index(device: str) -> int:
    """The torch.cuda index of physical GPU `device` in this process (CUDA_VISIBLE_DEVICES renumbers)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not re.fullmatch(r"\d+(,\d+)*", visible):
        return int(device)
    order = visible.split(",")
    if device not in order:
        raise PreflightError(f"GPU {device} is outside CUDA_VISIBLE_DEVICES={visible}")
    return order.index(device)


def healthy(results: Iterable[CheckResult]) -> bool:
    """True when no check failed (skipped is fine)."""
    return all(r.status != "fail" for r in results)


def reason(results: Iterable[CheckResult]) -> str:
    """A one-line summary of the failures, for a quarantine reason ('' when healthy)."""
    return "; ".join(f"{r.device}:{r.check}: {r.message}" for r in results if r.status == "fail")


def _result(check: str, device: str, fn: Callable[[], tuple], skip: str | None = None) -> CheckResult:
    if faults.injected(device, check):
        return CheckResult(check, device, "fail", message=faults.INJECTED)
    if skip:
        return CheckResult(check, device, "skipped", message=skip)
    try:
        status, value, threshold, message = fn()
    except Exception as exc:
        status, value, threshold, message = "fail", None, None, f"{type(exc).__name__}: {exc}"
    return CheckResult(check, device, status, value, threshold, message)


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

    src = torch.empty(1 << 28, device=dev)  # 1 GiB of fp32
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
                    "alloc": lambda: _alloc_check("cpu", cfg), "matmul": lambda: _matmul_check("cpu", cfg)}
        return [_result(c, device, cpu_runs.get(c, lambda: ()), None if c in cpu_runs else "cpu slot: no GPU")
                for c in names]
    import torch

    out: list[CheckResult] = []
    try:
        idx = torch_index(device)
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        vis = ("pass", idx, seen, f"torch index {idx}") if idx < seen else \
              ("fail", idx, seen, f"GPU {device} not visible ({seen} CUDA devices)")
    except PreflightError as exc:
        idx, vis = -1, ("fail", None, None, str(exc))
    out.append(_result("visible", device, lambda: vis))
    down = None if out[0].status == "pass" else "device not visible"
    dev = f"cuda:{idx}"
    out.append(_result("cuda_init", device, lambda: _cuda_init(dev), down))
    down = down or (None if out[-1].status == "pass" else "CUDA did not initialise")
    gpu_name = torch.cuda.get_device_name(dev) if not down else ""
    nvml_skip = None if nv.available else f"NVML unavailable: {nv.error}"
    phys = int(device)
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
            out.append(_result(c, device, nvml_runs[c], nvml_skip))
        else:
            out.append(_result(c, device, runs[c], down))
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

    return [_result("disk", "host", disk), _result("volume", "host", volume)]


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


def monitor_sample(devices: Sequence[str], *, allowed_pids: Iterable[int] | None = None) -> list[CheckResult]:
    """The cheap run-time sample (NVML only, no CUDA context): ecc, retired_pages, throttle, and
    foreign_procs when `allowed_pids` (the job's processes) is given. Faults are honoured on cpu slots too."""
    names = ["ecc", "retired_pages", "throttle"] + (["foreign_procs"] if allowed_pids is not None else [])
    allowed = tuple(allowed_pids or ())
    out = []
    with Nvml() as nv:
        for device in devices:
            for c in names:
                if is_cpu(device) or not nv.available:
                    out.append(_result(c, device, lambda: (), "cpu slot: no GPU" if is_cpu(device) else nv.error))
                    continue
                idx = int(device)
                fn = {"ecc": lambda: nv.ecc(idx), "retired_pages": lambda: nv.retired_pages(idx),
                      "throttle": lambda: nv.throttle(idx), "foreign_procs": lambda: nv.foreign_processes(idx, allowed)}[c]
                out.append(_result(c, device, fn))
    return out


def run_isolated(devices: Sequence[str], level: str = "quick", *, paths: Iterable[str | os.PathLike] = (),
                 timeout_s: float = 300.0, env: dict[str, str] | None = None) -> list[CheckResult]:
    """`run()` in a child process, so the caller (the service) never holds a CUDA context on a GPU it hands
    to jobs, and a hung driver call cannot hang it. A child that dies or times out fails every device."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "runtime.preflight", "--level", level, "--names", ",".join(devices)]
    for p in paths:
        cmd += ["--path", str(p)]
    root = str(Path(__file__).resolve().parents[1])
    child_env = dict(env if env is not None else os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env)
        return [CheckResult(**r) for r in json.loads(proc.stdout)]
    except subprocess.TimeoutExpired:
        why = f"preflight did not finish within {timeout_s:.0f}s"
    except (ValueError, TypeError):
        why = f"preflight process failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return [CheckResult("preflight", d, "fail", message=why) for d in devices]


def _main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m runtime.preflight", description="device preflight, JSON out")
    ap.add_argument("--names", default="", help="device names, comma-separated: cpu:0,cpu:1 or 0,1")
    ap.add_argument("--level", default="quick", choices=("quick", "full"))
    ap.add_argument("--path", action="append", default=[])
    a = ap.parse_args()
    devices = [d for d in a.names.split(",") if d]
    print(json.dumps([r.to_dict() for r in run(devices, a.level, paths=a.path)]))


if __name__ == "__main__":
    _main()
