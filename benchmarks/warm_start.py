"""Warm starts against cold ones: a digits trial's start, from the service's claim to its first training step.

    python benchmarks/warm_start.py [--trials 4] [--epochs 1] [--slots 1]
    python benchmarks/warm_start.py --imports     (where a warm trial's start still goes)

One embedded service (`--slots` cpu slots) in a fresh AUTORESEARCH_HOME runs digits trials (the bundled
experiment, tracked in MLflow as every trial is) one after another, alternating cold and warm starts, so both
see the same load: cold is the local executor's wrapper starting a fresh interpreter (what `AUTORESEARCH_WARM=0`
gives: the pool switched off), warm is an attempt forked from the executor's warm pool (started and ready
beforehand: its own start is reported apart). For each trial: start = the job's first heartbeat (written by the
job at its first training step) minus the STARTING event (the claim); device time = the attempt's end minus the
claim. Printed: the median of each per mode and the ratios warm/cold (aim: start <= 0.15x on cpu slots).
The digits volume is built once first, and one untimed trial of each mode warms the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_trial(service, api, params: dict, warm: bool) -> dict:
    """Submit one digits trial, wait for its end; its start and device time in seconds and how it started."""
    service.executor.warm_pool.enabled = warm
    if warm and not service.executor.warm_pool.wait_ready(300):  # (it starts again when a package is installed)
        raise SystemExit("the warm pool did not get ready in 300 s")
    job_id = api.submit(api.experiment_spec("digits", params))[0].id
    beat, first = service.layout.heartbeat_file(job_id), None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        job = service.store.get(job_id)
        if first is None:
            try:
                first = json.loads(beat.read_text())["time"]  # (polled well within the job's 5 s throttle)
            except (OSError, ValueError, KeyError):
                pass
        if job.state in ("SUCCEEDED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.01)
    events = service.store.events(job_id)
    claim = next(e.at for e in events if e.dst == "STARTING")
    running = next(e for e in events if e.dst == "RUNNING")
    if job.state != "SUCCEEDED" or first is None:
        raise SystemExit(f"trial {job_id} ended {job.state} (see {job.log_path})")
    return {"start": first - claim, "device": events[-1].at - claim, "how": running.reason.split(", ", 1)[-1]}


IMPORTS = """
import time
t0 = time.perf_counter()
from orchestrator.executors.local import warmpool
warmpool.preload()
t1 = time.perf_counter()
import experiments.digits.train
t2 = time.perf_counter()
from mlflow.tracking import MlflowClient
from mlflow.entities import Metric, Param
t3 = time.perf_counter()
print(f"the pool's PRELOAD {t1 - t0:.2f} s; then experiments.digits.train {t2 - t1:.2f} s; "
      f"then MLflow's client {t3 - t2:.2f} s")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4, help="timed trials per mode")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--imports", action="store_true", help="time the imports a warm trial still pays, and stop")
    args = ap.parse_args()
    if args.imports:
        import subprocess

        subprocess.run([sys.executable, "-c", IMPORTS], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        return
    home = Path(tempfile.mkdtemp(prefix="warm-bench-"))
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    os.environ.setdefault("AUTORESEARCH_PREFLIGHT", "off")  # (device checks are not what is measured)
    os.environ["AUTORESEARCH_WARM"] = "1"
    from experiments.digits import prepare
    from orchestrator.api import jobs as api
    from orchestrator.core.config import Settings
    from orchestrator.service.daemon import Service

    prepare.ensure()
    devices = f"cpu:{args.slots}"
    service = Service(Settings.load(devices=devices), devices=devices, executor="local", tick=0.1).start()
    try:
        t0 = time.monotonic()
        if not service.executor.warm_pool.wait_ready(300):
            raise SystemExit("the warm pool did not get ready in 300 s")
        print(f"warm pool ready after {time.monotonic() - t0:.1f} s (paid once per service, off the trials' path)")
        params = {"epochs": args.epochs}
        for warm in (False, True):
            run_trial(service, api, params, warm)  # untimed: page cache, MLflow's tables, the volume's cache
        rows: dict[bool, list[dict]] = {False: [], True: []}
        for i in range(args.trials):
            for warm in ((False, True) if i % 2 == 0 else (True, False)):
                row = run_trial(service, api, params, warm)
                rows[warm].append(row)
                print(f"  trial {i + 1} {'warm' if warm else 'cold'}: start {row['start']:.2f} s, "
                      f"device {row['device']:.2f} s ({row['how']})", flush=True)
    finally:
        service.stop()
    med = {w: {k: statistics.median(r[k] for r in rows[w]) for k in ("start", "device")} for w in rows}
    print(f"\n{'':28}{'cold':>10}{'warm':>10}{'warm/cold':>11}")
    for key, label in (("start", "claim -> first step (s)"), ("device", "device time per trial (s)")):
        print(f"{label:28}{med[False][key]:10.2f}{med[True][key]:10.2f}{med[True][key] / med[False][key]:10.2f}x")
    print(f"(median of {args.trials} digits trials per mode, {args.epochs} epoch(s), {devices}; load average "
          f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
