"""The training-path probes of `gpu_check.py`: async CUDA checkpoints, a 2-rank torchrun looking for stray
contexts, and a bf16 burst with NVML throttle sampling (each returns (ok, detail, data))."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpu_probes import _need_gpu, _nvml, _which

ALIGN_SLACK = 64  # bytes of alignment a staged tensor may add


def _model(seed: int, device: str, width: int = 4096, depth: int = 6):
    import torch

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    return torch.nn.Sequential(*layers).to(device)


def _train(model, opt, steps: int, ckpt, state, device: str, width: int = 4096) -> list[float]:
    import torch

    stalls = []
    for step in range(1, steps + 1):
        x = torch.randn(64, width, device=device)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step % ckpt.config.interval_steps == 0:
            ckpt.wait()  # the previous upload (untimed): what is left is the stall of staging this save
        t0 = time.perf_counter()
        if ckpt.maybe_save(step, state):
            stalls.append(time.perf_counter() - t0)
    return stalls


def _bitwise(model_a, opt_a, model_b, opt_b) -> bool:
    import torch

    same = all(torch.equal(x, y) for x, y in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        same &= all(torch.equal(sa[k], sb[k]) for k in sa)
    return same


def check_async_checkpoint(a) -> tuple:
    import torch

    from runtime.checkpoint.manager import CheckpointManager, TrainState

    _need_gpu()
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(0, "cuda:0")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = TrainState(model, opt)
        ckpt = CheckpointManager(Path(tmp, "ckpt"), keep_last=2, interval_steps=2)
        t0 = time.perf_counter()
        stalls = _train(model, opt, 6, ckpt, state, "cuda:0")
        ckpt.wait()
        staged = ckpt.staged_bytes
        deferred = [t for t in model.parameters()] + [v for s in opt.state.values() for v in s.values()
                                                       if torch.is_tensor(v)]
        need = sum(t.nbytes for t in deferred)
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        cached_pinned = host.get("allocated_bytes.current", host.get("reserved_bytes.current", None))
        ckpt.close()
        freed = ckpt.staged_bytes
        model2 = _model(1, "cuda:0")
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        loaded = CheckpointManager(Path(tmp, "ckpt"), keep_last=2, interval_steps=2).load_latest(TrainState(model2, opt2))
        same = loaded == 6 and _bitwise(model, opt, model2, opt2)
        total = time.perf_counter() - t0
    exact = need <= staged <= need + ALIGN_SLACK * len(deferred)
    ok = same and exact and freed == 0
    detail = (f"{need / 2**30:.2f} GiB state; staged {staged / 2**30:.3f} GiB (exact: {exact}); freed on close: "
              f"{freed == 0}; caching-allocator pinned bytes {cached_pinned}; loaded step {loaded} bitwise: {same}; "
              f"maybe_save stalls {[round(s * 1000, 1) for s in stalls]} ms; {total:.1f} s")
    return ok, detail, {"staged": staged, "need": need, "stalls_ms": [s * 1000 for s in stalls]}


def _primary_contexts() -> dict[str, bool]:
    """UUID -> whether this process holds a primary context on it (CUDA driver API; no context is made)."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuInit(0)
    count = ctypes.c_int()
    cu.cuDeviceGetCount(ctypes.byref(count))
    out = {}
    for i in range(count.value):
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), i)
        raw = (ctypes.c_ubyte * 16)()
        cu.cuDeviceGetUuid(raw, dev)
        b = bytes(raw).hex()
        uuid = f"{b[:8]}-{b[8:12]}-{b[12:16]}-{b[16:20]}-{b[20:]}"
        cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
        out[uuid] = bool(active.value)
    return out


def rank_worker(out: Path) -> None:
    """One torchrun rank: DDP on its GPU (GPU 0 for both on a one-GPU box), async saves, then reports."""
    import torch
    import torch.distributed as dist

    from runtime.checkpoint.manager import CheckpointManager, TrainState

    rank, n = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
    device = f"cuda:{rank if n > 1 else 0}"
    torch.cuda.set_device(device)
    backend = "nccl" if n > 1 else "gloo"  # NCCL refuses two ranks on one GPU
    dist.init_process_group(backend, **({"device_id": torch.device(device)} if backend == "nccl" else {}))
    model = torch.nn.parallel.DistributedDataParallel(_model(0, device, 2048, 4), device_ids=[torch.device(device).index])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainState(model, opt)
    ckpt = CheckpointManager(out / "ckpt", keep_last=2, interval_steps=2)
    _train(model, opt, 6, ckpt, state, device, 2048)
    ckpt.wait()
    report = {"rank": rank, "pid": os.getpid(), "device": device, "staged": ckpt.staged_bytes,
              "contexts": _primary_contexts()}
    (out / f"ready-{rank}").write_text(json.dumps(report))
    deadline = time.monotonic() + 90
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    ckpt.close()
    model2 = torch.nn.parallel.DistributedDataParallel(_model(1, device, 2048, 4), device_ids=[torch.device(device).index])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    loaded = CheckpointManager(out / "ckpt", keep_last=2, interval_steps=2).load_latest(TrainState(model2, opt2))
    report.update(loaded=loaded, same=loaded == 6 and _bitwise(model, opt, model2, opt2))
    (out / f"done-{rank}").write_text(json.dumps(report))
    dist.destroy_process_group()


def check_torchrun_two_ranks(a) -> tuple:
    n = _need_gpu()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(Path(__file__).with_name("gpu_check.py").resolve()), "--rank-worker", str(out)]
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 150
            while not all((out / f"ready-{r}").exists() for r in (0, 1)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks did not get ready: {proc.communicate(timeout=10)[0][-2000:]}")
                time.sleep(0.2)
            smi = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout if _which("nvidia-smi") else ""
            (out / "go").write_text("")
            logs = proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        ranks = [json.loads((out / f"done-{r}").read_text()) for r in (0, 1) if (out / f"done-{r}").exists()]
    if len(ranks) != 2:
        return False, f"ranks did not finish (exit {proc.returncode}): {logs[-1500:]}", {}
    apps = [line.split(", ") for line in smi.strip().splitlines() if line.strip()]
    by_pid: dict[int, list[str]] = {}
    for uuid, pid, _mem in apps:
        by_pid.setdefault(int(pid), []).append(uuid)
    active = {r["rank"]: [u for u, on in r["contexts"].items() if on] for r in ranks}
    if n > 1:
        stray = any(len(v) != 1 for v in active.values()) or any(len(by_pid.get(r["pid"], [])) > 1 for r in ranks)
        note = "each rank on its own GPU"
    else:
        stray = any(len(by_pid.get(r["pid"], [])) > 1 for r in ranks) or any(len(v) != 1 for v in active.values())
        note = "one GPU: both ranks share GPU 0 (a stray context there cannot be told apart; one context each)"
    visible = sum(r["pid"] in by_pid for r in ranks)
    ok = all(r["same"] for r in ranks) and not stray and ranks[1]["staged"] < max(1, ranks[0]["staged"]) // 100
    detail = (f"{note}; nvidia-smi lists {visible}/2 rank pids ({len(apps)} apps); contexts per rank {active}; "
              f"staged bytes rank0 {ranks[0]['staged']} rank1 {ranks[1]['staged']}; bitwise resume "
              f"{[r['same'] for r in ranks]}")
    return ok, detail, {"ranks": ranks, "nvidia_smi": smi}


def check_bf16_burst(a) -> tuple:
    import torch

    from runtime.preflight import EXPECTED, PreflightConfig

    _need_gpu()
    nv = _nvml()
    h = nv.handle("0")
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            row: dict = {"t": time.monotonic()}
            for key, call in (("mask", lambda: nv.clock_reasons("0")[0]),
                              ("temp_c", lambda: nv._call("nvmlDeviceGetTemperature", h, 0)),
                              ("sm_mhz", lambda: nv._call("nvmlDeviceGetClockInfo", h, 1)),
                              ("power_w", lambda: nv._call("nvmlDeviceGetPowerUsage", h) / 1000)):
                try:
                    row[key] = call()
                except Exception as exc:
                    row[key] = f"{type(exc).__name__}"
            samples.append(row)

    torch.cuda.set_device(0)
    x, y = (torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16) for _ in range(2))
    x @ y
    torch.cuda.synchronize()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0, iters = time.perf_counter(), 0
    while time.perf_counter() - t0 < a.burst_s:
        for _ in range(50):
            x @ y
        torch.cuda.synchronize()
        iters += 50
    dt = time.perf_counter() - t0
    stop.set()
    sampler.join(5)
    nv.close()
    tflops = 2 * 8192**3 * iters / dt / 1e12
    critical = [isinstance(s.get("mask"), int) and bool(s["mask"] & 0xE8) for s in samples]
    run = best = 0
    for hit in critical:
        run = run + 1 if hit else 0
        best = max(best, run)
    masks = sorted({hex(s["mask"]) for s in samples if isinstance(s.get("mask"), int)})
    name = torch.cuda.get_device_name(0)
    exp = next((v[0] for k, v in EXPECTED.items() if k in name), None)
    need = exp * PreflightConfig().expect_fraction if exp else 0
    temps = [s["temp_c"] for s in samples if isinstance(s.get("temp_c"), int)]
    ok = tflops >= need and best < 3 and len(samples) > 0
    detail = (f"{dt:.0f} s at {tflops:.0f} TFLOPS bf16 (need {need:.0f}); {len(samples)} NVML samples, masks {masks}, "
              f"{sum(critical)} with hw/thermal slowdown (longest run {best}); max {max(temps, default='?')} C, "
              f"SM {max((s['sm_mhz'] for s in samples if isinstance(s.get('sm_mhz'), int)), default='?')} MHz")
    return ok, detail, {"samples": samples[-20:], "tflops": tflops}


