"""The identity, NVML and preflight probes of `gpu_check.py` (each runs in its own child process and returns
(ok, detail, data), or raises Skip when it does not apply)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


class Skip(Exception):
    """The check does not apply on this machine (the message says why)."""


def _nvml():
    from runtime.nvml import Nvml

    nv = Nvml(timeout_s=5.0).open()
    if not nv.available:
        raise Skip(f"NVML unavailable ({nv.error}); needs the NVIDIA driver and nvidia-ml-py")
    return nv


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _need_gpu() -> int:
    n = _gpu_count()
    if not n:
        raise Skip("no CUDA device")
    return n


# ---- checks (each runs in a child process; returns (ok, detail, data)) -----------------------------------


def check_environment(a) -> tuple:
    import torch

    data = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "count": _gpu_count(), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}
    data["gpus"] = [{"name": torch.cuda.get_device_name(i), "torch_uuid": str(torch.cuda.get_device_properties(i).uuid)}
                    for i in range(data["count"])]
    try:
        nv = _nvml()
        data["nvml"] = [{"name": n, "uuid": u} for n, u in nv.inventory()]
        data["driver"] = str(nv._call("nvmlSystemGetDriverVersion"))
        nv.close()
    except Skip as exc:
        data["nvml"] = str(exc)
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30) if _which("nvidia-smi") else None
    data["nvidia_smi_L"] = smi.stdout.strip() if smi else "nvidia-smi not found"
    return data["count"] > 0, f"{data['count']} GPU(s): {[g['name'] for g in data['gpus']]}, torch {data['torch']}", data


def _which(cmd: str) -> bool:
    from shutil import which

    return which(cmd) is not None


def check_uuid_identity(a) -> tuple:
    from runtime.devices import cuda_index, normalize_uuid, parse_devices

    n = _need_gpu()
    nv = _nvml()
    names = parse_devices("auto", nvml=nv)
    rows, ok = [], True
    for name in names:
        idx = cuda_index(name, nv)
        import torch

        same = normalize_uuid(str(torch.cuda.get_device_properties(idx).uuid)) == normalize_uuid(nv.uuid(name))
        ok &= same and (os.environ.get("CUDA_VISIBLE_DEVICES") is not None or idx == int(name))
        rows.append({"name": name, "nvml_uuid": nv.uuid(name), "cuda_index": idx, "uuid_match": same})
    ok &= len(names) == n
    return ok, f"{len(names)} NVML device(s) matched to {n} CUDA device(s) by UUID", rows


def check_cvd_uuid(a) -> tuple:
    """Run with CUDA_VISIBLE_DEVICES=<UUID of GPU 0> (the parent sets it)."""
    from orchestrator.core.devices import cuda_visible
    from runtime.devices import cuda_index, parse_devices

    _need_gpu()
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    nv = _nvml()
    names = parse_devices("auto", nvml=nv)
    prefix = cvd[:12]
    short = parse_devices("auto", env={"CUDA_VISIBLE_DEVICES": prefix}, nvml=nv)
    idx = cuda_index(names[0], nv)
    ok = names == [cvd] and short == [prefix] and idx == 0 and cuda_visible(names) == cvd
    return ok, f"auto -> {names}; prefix {prefix} -> {short}; cuda index {idx}; job CVD {cuda_visible(names)}", {}


def check_cvd_reorder(a) -> tuple:
    """Run with CUDA_VISIBLE_DEVICES=1,0 (the parent sets it)."""
    from runtime.devices import cuda_index, parse_devices

    if _need_gpu() < 2:
        raise Skip("one GPU: no order to swap")
    nv = _nvml()
    names = parse_devices("auto", nvml=nv)
    got = {n: cuda_index(n, nv) for n in names}
    return names == ["1", "0"] and got == {"1": 0, "0": 1}, f"auto -> {names}; cuda indices {got}", got


def check_nvml(a) -> tuple:
    from runtime import preflight
    from runtime.nvml import CLOCK_REASON_CALLS

    nv = _nvml()
    names = [n for n, _ in nv.inventory() if n.isdigit()]
    timings: dict[str, list[float]] = {}
    calls = {"count": lambda d: nv.count(), "uuid": nv.uuid, "ecc": nv.ecc, "retired_pages": nv.retired_pages,
             "throttle": nv.throttle, "processes": nv.processes}
    for _ in range(20):
        for key, fn in calls.items():
            for d in names:
                t0 = time.perf_counter()
                fn(d)
                timings.setdefault(key, []).append((time.perf_counter() - t0) * 1000)
    support = {}
    h = nv.handle(names[0])
    for fn in CLOCK_REASON_CALLS:
        try:
            support[fn] = hex(int(nv._call(fn, h))) if hasattr(nv._nvml, fn) else "not in binding"
        except Exception as exc:
            support[fn] = f"{type(exc).__name__}"
    mask, used = nv.clock_reasons(names[0])
    t0 = time.perf_counter()
    samples = [preflight.monitor_sample(names, nvml=nv) for _ in range(10)]
    sample_ms = (time.perf_counter() - t0) * 100
    faults = [f"{r.device}:{r.check}: {r.message}" for r in samples[-1] if r.status == "fail" and r.check != "throttle"]
    stats = {k: {"median_ms": round(sorted(v)[len(v) // 2], 3), "max_ms": round(max(v), 3)} for k, v in timings.items()}
    nv.close()
    worst = max(s["max_ms"] for s in stats.values())
    detail = (f"clock reasons via {used} (mask {hex(mask)}); monitor sample of {len(names)} GPU(s) "
              f"{sample_ms:.2f} ms; slowest call {worst:.1f} ms" + (f"; HARDWARE FAULTS {faults}" if faults else ""))
    return not faults and worst < 5000, detail, {"timings": stats, "clock_calls": support}


def _holder(device: str = "cuda:0") -> subprocess.Popen:
    code = (f"import torch,time; torch.zeros(1,device='{device}'); torch.cuda.synchronize(); "
            "print('ready',flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "ready" not in line:
        raise RuntimeError("the context holder did not start")
    return proc


def check_foreign_context(a) -> tuple:
    from orchestrator.service.health import Health, HealthConfig
    from runtime import preflight

    _need_gpu()  # only counts devices; this process must never create a context
    nv = _nvml()
    holder = _holder()
    try:
        listed = nv.processes("0")
        busy = preflight.run_isolated(["0"], "quick")
    finally:
        holder.kill()
        holder.wait()
    time.sleep(1.0)
    free = preflight.run_isolated(["0"], "quick")
    fp = {r.check: r for r in busy}["foreign_procs"]
    seen = fp.status == "fail" and str(holder.pid) in fp.message
    clean = preflight.healthy(free)
    # Two raw preflights at once see each other; the service's path (one lock, reservations) must not.
    raw: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: raw.__setitem__(i, preflight.run_isolated(["0"], "quick")))
               for i in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    raw_collided = sum(not preflight.healthy(r or []) for r in raw)
    health = Health(HealthConfig(preflight_ttl=0))
    verdicts: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: verdicts.__setitem__(i, health.preflight(["0"])))
               for i in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    service_ok = all(v is not None and v.ok for v in verdicts)
    mine = os.getpid() in nv.processes("0")
    nv.close()
    ok = seen and clean and service_ok and not mine
    detail = (f"holder pid {holder.pid} listed by NVML: {holder.pid in listed}; preflight saw it: {seen}; "
              f"after it left: {'pass' if clean else preflight.reason(free)}; two raw preflights at once: "
              f"{raw_collided} of 2 failed; service path at once: {'both pass' if service_ok else verdicts}; "
              f"checker holds a context: {mine}")
    return ok, detail, {"busy": [r.to_dict() for r in busy], "raw_concurrent": [preflight.reason(r or []) for r in raw]}


NCCL_NOISE = """
import os
if os.environ.get("GPU_CHECK_NCCL_NOISE"):
    # One GPU has no NCCL peer, so no preflight NCCL traffic; make NCCL print on this stdout anyway.
    import torch, torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%s" % os.environ["GPU_CHECK_NCCL_PORT"],
                            rank=0, world_size=1, device_id=torch.device("cuda:0"))
    t = torch.ones(1, device="cuda:0"); dist.all_reduce(t); torch.cuda.synchronize()
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_preflight_nccl_debug(a) -> tuple:
    from runtime import preflight

    n = _need_gpu()
    names = [str(i) for i in range(n)] if "CUDA_VISIBLE_DEVICES" not in os.environ else \
        os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    env = dict(os.environ, NCCL_DEBUG="INFO")
    with tempfile.TemporaryDirectory() as tmp:
        if n < 2:
            Path(tmp, "sitecustomize.py").write_text(NCCL_NOISE)
            env.update(GPU_CHECK_NCCL_NOISE="1", GPU_CHECK_NCCL_PORT=str(_free_port()),
                       PYTHONPATH=os.pathsep.join(filter(None, [tmp, env.get("PYTHONPATH")])))
        probe = subprocess.run([sys.executable, "-c", "pass"], env=env, capture_output=True, text=True, timeout=120)
        noise = sum("NCCL INFO" in line for line in probe.stdout.splitlines())
        results = preflight.run_isolated(names, "full", env=env, timeout_s=240)
    by = {(r.device, r.check): r for r in results}
    lines = [f"{r.device}:{r.check}={r.status}({r.value})" for r in results if r.check in
             ("matmul_tflops", "mem_bandwidth", "allreduce", "foreign_procs", "throttle")]
    ok = preflight.healthy(results) and ("0", "preflight") not in by and noise > 0
    return ok, f"{noise} NCCL INFO lines on a child's stdout; {'; '.join(lines) or preflight.reason(results)}", \
        [r.to_dict() for r in results]


