"""The warm-start check of `gpu_check.py` (run on a box with a CUDA device; skipped without one).

An embedded service on GPU 0 runs the same CUDA training job twice, started cold (a fresh interpreter) and
warm (forked from the local executor's pool, which has torch imported). It passes when:
- the pool holds no CUDA context: no /dev/nvidia* descriptor open, `nvidia-smi --query-compute-apps` does not
  list it, and the driver is not initialised in it (a CUDA build of torch may map libcuda.so at import: that
  is safe to fork; the pool asks the loaded library whether `cuInit` ran, and the check names the import that
  mapped it);
- each job found CUDA uninitialised at its start and initialised it itself, on the device it was given;
- the warm job says so in its RUNNING event, and trains at the speed of the cold one (0.9x-1.1x steps/s).

As a job: `python benchmarks/gpu_warm.py --job` trains a 4-layer MLP (bf16 autocast) and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, TIMED = 300, 200  # steps per job, of which the last TIMED are timed


def job() -> None:
    """The training job: CUDA state at its start, then steps/s of an MLP on one device."""
    import torch

    before = torch.cuda.is_initialized()
    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(4096, 4096), torch.nn.GELU())]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2048, 4096, device=dev)
    t0 = None
    for step in range(STEPS):
        if step == STEPS - TIMED:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    rate = TIMED / (time.perf_counter() - t0)
    print(json.dumps({"cuda_at_start": before, "cuda_after": torch.cuda.is_initialized(),
                      "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "steps_per_s": rate,
                      "device": torch.cuda.get_device_name(0), "pid": os.getpid()}), flush=True)


def _pool_holds_cuda(pid: int) -> list[str]:
    """What shows that process `pid` has touched CUDA (empty: nothing)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.append(f"fd {fd} -> {target}")
    if "libcuda.so" in Path(f"/proc/{pid}/maps").read_text():
        found.append("libcuda.so is mapped")
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30).stdout.split()
    if str(pid) in apps:
        found.append("listed by nvidia-smi --query-compute-apps")
    return found


def _first_mapping_import() -> str | None:
    """The first of the pool's preloads after which libcuda.so is mapped (in a fresh interpreter), or None."""
    code = ("import importlib, sys\nfrom orchestrator.executors.local.warmpool import PRELOAD\n"
            "for n in PRELOAD:\n    try:\n        importlib.import_module(n)\n    except Exception:\n        pass\n"
            "    if 'libcuda.so' in open('/proc/self/maps').read():\n        print(n); break\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT),
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                        os.environ.get("PYTHONPATH")]))})
    return out.stdout.strip() or None


def check_warm_start(a) -> tuple:
    """The check (see the module's docstring): (ok, detail, data)."""
    import gpu_probes

    if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode:
        raise gpu_probes.Skip("no CUDA device (nvidia-smi finds none)")
    home = Path(tempfile.mkdtemp(prefix="gpu-warm-"))
    os.environ.update(AUTORESEARCH_HOME=str(home), MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}",
                      AUTORESEARCH_PREFLIGHT="off", AUTORESEARCH_WARM="1")
    from orchestrator.api import jobs as api
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.service.daemon import Service

    service = Service(Settings.load(devices="0"), devices="0", executor="local", tick=0.1).start()
    data: dict = {}
    try:
        t0 = time.monotonic()
        if not service.executor.warm_pool.wait_ready(120):
            return False, "the warm pool did not get ready in 120 s", data
        data["pool_ready_s"] = round(time.monotonic() - t0, 1)
        pool = service.executor.warm_pool.pid
        for warm in (False, True):
            service.executor.warm_pool.enabled = warm
            spec = JobSpec(argv=[sys.executable, str(Path(__file__).resolve()), "--job"], cwd=str(ROOT), track=False)
            job_id = api.submit(spec)[0].id
            deadline = time.monotonic() + 120
            while service.store.get(job_id).state not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                if time.monotonic() > deadline:
                    return False, f"the {'warm' if warm else 'cold'} job did not end in 120 s", data
                time.sleep(0.1)
            job = service.store.get(job_id)
            text = Path(job.log_path).read_text(errors="replace")
            line = next((x for x in text.splitlines() if x.startswith("{")), None)
            if job.state != "SUCCEEDED" or line is None:
                return False, f"job {job_id} ended {job.state}: {text[-400:]}", data
            how = next(e.reason for e in service.store.events(job_id) if e.dst == "RUNNING")
            data["warm" if warm else "cold"] = {**json.loads(line), "how": how}
        data["pool_cuda"] = _pool_holds_cuda(pool)
        data["pool_driver"] = (service.executor.warm_pool._ready or {}).get("cuda")
    finally:
        service.stop()
    data["maps_libcuda_after"] = _first_mapping_import()
    cold, warm = data["cold"], data["warm"]
    ratio = warm["steps_per_s"] / cold["steps_per_s"]
    data["speed_ratio"] = round(ratio, 3)
    # A mapped driver library is safe to fork while the driver is not initialised (no cuInit: no /dev/nvidia*
    # descriptor, no context); the pool asks the loaded library itself (warmpool.cuda_driver).
    driver = data["pool_driver"] or {}
    problems = [f for f in data["pool_cuda"] if f != "libcuda.so is mapped"]
    if driver.get("loaded") and driver.get("initialised") is not False:
        problems.append(f"the CUDA driver in the pool: {driver}")
    if not warm["how"].endswith(", warm") or ", cold" not in cold["how"]:
        problems.append(f"started {cold['how']!r} and {warm['how']!r}")
    for name, run in (("cold", cold), ("warm", warm)):
        if run["cuda_at_start"] or not run["cuda_after"] or run["visible"] in (None, ""):
            problems.append(f"{name} job: CUDA at start {run['cuda_at_start']}, after {run['cuda_after']}, "
                            f"CUDA_VISIBLE_DEVICES={run['visible']!r}")
    if not 0.9 <= ratio <= 1.1:
        problems.append(f"warm trains at {ratio:.2f}x the cold job's speed")
    mapped = "libcuda.so mapped, driver not initialised" if driver.get("loaded") else "libcuda.so not loaded"
    detail = (f"pool without a CUDA context ({mapped}); both jobs initialised CUDA themselves; warm {warm['steps_per_s']:.1f} vs cold "
              f"{cold['steps_per_s']:.1f} steps/s ({ratio:.2f}x)")
    return not problems, "; ".join(problems) or detail, data


if __name__ == "__main__" and sys.argv[1:] == ["--job"]:
    job()
