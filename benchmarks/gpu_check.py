"""GPU check for an accelerator machine: preflight (full) on every GPU, then the checkpoint benchmark on CUDA.

Fits in about 5 minutes on one GPU. Each section runs on its own, so one failing still leaves the others'
output. Prints JSON per section and a summary; with ``$OUT`` set, writes ``$OUT/gpu_check.json`` too.
Run: ``python benchmarks/gpu_check.py [--params-m 100] [--batch 512] [--skip-bench]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def section(name: str, fn, summary: dict) -> None:
    print(f"\n=== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        summary[name] = {"ok": True, "result": fn()}
    except Exception as exc:  # keep going: a later section may still tell us something
        traceback.print_exc()
        summary[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    summary[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary[name], indent=2, default=str), flush=True)


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
            "count": torch.cuda.device_count()}
    info["names"] = [torch.cuda.get_device_name(i) for i in range(info["count"])]
    return info


def preflight(level: str) -> dict:
    from runtime import preflight as pf

    devices = pf.parse_devices("auto")
    results = pf.run(devices, level, paths=[tempfile.gettempdir()])
    for r in results:
        print(f"  {r.device:>5} {r.check:<14} {r.status:<7} {r.value!s:<22} {r.threshold!s:<10} {r.message}")
    return {"devices": devices, "healthy": pf.healthy(results), "reason": pf.reason(results),
            "results": [r.to_dict() for r in results],
            "monitor_sample": [r.to_dict() for r in pf.monitor_sample(devices, allowed_pids=[])]}


def bench(params_m: float, batch: int) -> dict:
    import checkpoint as ckbench  # benchmarks/checkpoint.py, next to this file

    res = ckbench.run(params_m=params_m, device="cuda:0", saves=3, interval=6, batch=batch, rounds=2)
    ckbench.report(res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=100)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--skip-bench", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    summary: dict = {}
    t0 = time.perf_counter()
    section("environment", environment, summary)
    section("preflight_quick", lambda: preflight("quick"), summary)
    section("preflight_full", lambda: preflight("full"), summary)
    if not a.skip_bench and summary["environment"].get("result", {}).get("available"):
        section("checkpoint_bench_cuda", lambda: bench(a.params_m, a.batch), summary)
    summary["total_seconds"] = round(time.perf_counter() - t0, 1)
    print("\n=== summary")
    print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "result"})
                      for k, v in summary.items()}, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    ok = all(v.get("ok", True) for v in summary.values() if isinstance(v, dict))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
