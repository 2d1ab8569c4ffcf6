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
  warm_start           a job forked from the local executor's warm pool: the pool holds no CUDA context,
                       the job initialises CUDA itself and trains at the cold job's speed (gpu_warm.py)

Prints PASS/FAIL/SKIP per check and a summary; exits 1 when any check failed. With $OUT set, also writes
$OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs without `pip install -e .`
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # as jobs get it (the job protocol), before any CUDA init


import gpu_probes  # noqa: E402  (next to this file; after the repo root is on sys.path)
import gpu_training  # noqa: E402
import gpu_warm  # noqa: E402

CHECKS = ["environment", "uuid_identity", "cvd_uuid", "cvd_reorder", "nvml", "foreign_context",
          "preflight_nccl_debug", "async_checkpoint", "torchrun_two_ranks", "bf16_burst", "warm_start"]
LIMITS = {"environment": 60, "uuid_identity": 60, "cvd_uuid": 60, "cvd_reorder": 60, "nvml": 60,
          "foreign_context": 120, "preflight_nccl_debug": 150, "async_checkpoint": 120, "torchrun_two_ranks": 180,
          "bf16_burst": 60, "warm_start": 180}


# ---- the parent: one child per check, time-boxed ----------------------------------------------------------


def child(name: str, a) -> None:
    try:
        fn = next(getattr(m, f"check_{name}") for m in (gpu_probes, gpu_training, gpu_warm)
                  if hasattr(m, f"check_{name}"))
        ok, detail, data = fn(a)
        result = {"status": "PASS" if ok else "FAIL", "detail": detail, "data": data}
    except gpu_probes.Skip as exc:
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
        return gpu_training.rank_worker(Path(a.rank_worker))
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
