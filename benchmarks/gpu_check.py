"""Device check for a real GPU box: the CUDA, NCCL and NVML paths the CPU test suite cannot reach.

About 5 minutes on one H200. Run from the repository root, no install needed (torch; nvidia-ml-py for the
NVML parts, each of which says so and is skipped without it):

    python benchmarks/gpu_check.py [--burst-s 40] [--budget-s 290] [--only NAME,...]

Checks (each in its own child process, time-boxed; one failing or hanging does not stop the others):
  environment          torch/CUDA/driver, the GPUs, how torch spells a UUID
  uuid_identity        NVML's UUID of every GPU matches torch's device properties (devices keyed by UUID)
  cvd_uuid             the service inheriting CUDA_VISIBLE_DEVICES=<UUID>: `auto` keeps the UUID, which
                       resolves to the right CUDA device
  cvd_reorder          CUDA_VISIBLE_DEVICES=1,0: names map to swapped CUDA indices by UUID (>= 2 GPUs)
  nvml                 a long-lived NVML session: call timings, clock-event vs throttle-reasons support
  foreign_context      a process holding a context is seen as foreign by preflight, and not once it is gone;
                       two raw preflights at once vs the service's serialized path; the caller holds no context
  preflight_nccl_debug the full preflight with NCCL_DEBUG=INFO printing on the child's stdout
  async_checkpoint     async DCP saves of a CUDA model + AdamW, loaded back and compared bitwise; exact-sized
                       staging memory, freed on close
  torchrun_two_ranks   2 ranks (sharing GPU 0 on a one-GPU box) with async saves; `nvidia-smi
                       --query-compute-apps` and each rank's primary contexts catch a stray context on GPU 0
  bf16_burst           --burst-s seconds of 8192^3 bf16 matmuls with NVML throttle sampling every 0.5 s

Prints PASS/FAIL/SKIP per check and a summary; exits 1 when any check failed. With $OUT set, also writes
$OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs without `pip install -e .`
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # as jobs get it (Contract 3), before any CUDA init
ALIGN_SLACK = 64  # bytes of alignment a staged tensor may add


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
    from orchestrator.devices import cuda_visible
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
    from orchestrator.health import Health, HealthConfig
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

    from runtime.checkpoint import CheckpointManager, TrainState

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

    from runtime.checkpoint import CheckpointManager, TrainState

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
               str(Path(__file__).resolve()), "--rank-worker", str(out)]
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


CHECKS = ["environment", "uuid_identity", "cvd_uuid", "cvd_reorder", "nvml", "foreign_context",
          "preflight_nccl_debug", "async_checkpoint", "torchrun_two_ranks", "bf16_burst"]
LIMITS = {"environment": 60, "uuid_identity": 60, "cvd_uuid": 60, "cvd_reorder": 60, "nvml": 60,
          "foreign_context": 120, "preflight_nccl_debug": 150, "async_checkpoint": 120, "torchrun_two_ranks": 180,
          "bf16_burst": 60}


# ---- the parent: one child per check, time-boxed ----------------------------------------------------------


def child(name: str, a) -> None:
    try:
        ok, detail, data = globals()[f"check_{name}"](a)
        result = {"status": "PASS" if ok else "FAIL", "detail": detail, "data": data}
    except Skip as exc:
        result = {"status": "SKIP", "detail": str(exc), "data": None}
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"status": "FAIL", "detail": f"{type(exc).__name__}: {exc}", "data": None}
    Path(a.result).write_text(json.dumps(result, default=str))


def run_check(name: str, a, env_extra: dict, limit: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result_path = Path(fh.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--result", str(result_path),
           "--burst-s", str(a.burst_s)]
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        proc.wait(timeout=limit)
        text = result_path.read_text()
        result = json.loads(text) if text else {"status": "FAIL", "detail": f"no result (exit {proc.returncode})"}
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        result = {"status": "FAIL", "detail": f"timed out after {limit:.0f}s"}
    except (OSError, ValueError) as exc:
        result = {"status": "FAIL", "detail": f"no result (exit {proc.returncode}): {exc}"}
    finally:
        result_path.unlink(missing_ok=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--burst-s", type=float, default=40.0, help="length of the bf16 burst (default 40 s)")
    ap.add_argument("--budget-s", type=float, default=290.0, help="stop starting checks after this long")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--rank-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_worker:
        return rank_worker(Path(a.rank_worker))
    if a.child:
        return child(a.child, a)
    names = [n for n in a.only.split(",") if n] or CHECKS
    unknown = set(names) - set(CHECKS)
    if unknown:
        print(f"unknown checks: {sorted(unknown)}; known: {', '.join(CHECKS)}", file=sys.stderr)
        sys.exit(2)
    LIMITS["bf16_burst"] = a.burst_s + 60
    summary: dict[str, dict] = {}
    t_start = time.monotonic()
    first_uuid = None
    for name in names:
        left = a.budget_s - (time.monotonic() - t_start)
        extra: dict[str, str] = {}
        if name == "cvd_uuid":
            first_uuid = _first_uuid(summary)
            extra = {"CUDA_VISIBLE_DEVICES": first_uuid} if first_uuid else {}
        if name == "cvd_reorder":
            extra = {"CUDA_VISIBLE_DEVICES": "1,0"}
        print(f"\n=== {name}", flush=True)
        if left < 15:
            result = {"status": "SKIP", "detail": f"out of time (budget {a.budget_s:.0f}s)", "seconds": 0}
        elif name == "cvd_uuid" and not first_uuid:
            result = {"status": "SKIP", "detail": "no GPU UUID from NVML (see environment)", "seconds": 0}
        elif name == "cvd_reorder" and _gpus(summary) < 2:
            result = {"status": "SKIP", "detail": "one GPU: CUDA_VISIBLE_DEVICES=1,0 needs two", "seconds": 0}
        else:
            result = run_check(name, a, extra, min(LIMITS[name], max(left, 15)))
        summary[name] = result
        print(f"{result['status']:<4} {name} ({result['seconds']}s): {result['detail']}", flush=True)
    print("\n=== summary", flush=True)
    for name, r in summary.items():
        print(f"{r['status']:<4} {name:<22} {r['seconds']:>6}s  {str(r['detail'])[:160]}")
    failed = [n for n, r in summary.items() if r["status"] == "FAIL"]
    total = round(time.monotonic() - t_start, 1)
    print(f"{'FAIL' if failed else 'PASS'}: {len(summary) - len(failed)}/{len(summary)} checks passed or skipped "
          f"in {total}s" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    sys.exit(1 if failed else 0)


def _first_uuid(summary: dict) -> str | None:
    nvml = ((summary.get("environment") or {}).get("data") or {}).get("nvml")
    return nvml[0]["uuid"] if isinstance(nvml, list) and nvml else None


def _gpus(summary: dict) -> int:
    return int(((summary.get("environment") or {}).get("data") or {}).get("count") or 0)


if __name__ == "__main__":
    main()
