"""Submit-to-start on Slurm: through our queue (`--executor slurm`) against a bare `sbatch` of the same command
on the same cluster.

    python benchmarks/slurm_submit.py [--jobs 10] [--partition P]

The command writes the time it started (`date +%s.%N`) to a file. Bare: the time from calling `sbatch` to that
start. Ours: the time from `api.submit` (the queue's submit, as `autoresearch submit` makes it, without the
CLI's interpreter start) to that start, with an in-process service on one cpu slot (`--devices cpu:1`)
already running; the service sbatches each attempt under its wrapper. One job at a time, each waited for
before the next (a bare one, then one of ours, and so on: both see the same load), so the figures are
latencies, not throughput. Printed: median and p90 of each, and the ratio
of the medians (ours / bare). Needs a Slurm cluster (`.ci/slurm-setup.sh` makes a one-host one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def wait_file(path: Path, timeout: float = 120.0) -> float:
    """The start time the job wrote into `path`, once it is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text:
                return float(text)
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    raise TimeoutError(f"no start recorded in {path}")


def wait_gone(slurm_id: str) -> None:
    """Until Slurm no longer runs the job (its CPU is free again for the next one)."""
    while subprocess.run(["squeue", "-h", "-j", slurm_id, "-o", "%T"], capture_output=True,
                         text=True).stdout.strip() not in ("", "COMPLETED"):
        time.sleep(0.02)


def bare_one(i: int, work: Path, partition: str | None) -> float:
    """Submit-to-start of one bare sbatch job (waited for until Slurm is done with it)."""
    mark = work / f"bare-{i}"
    argv = ["sbatch", "--parsable", "-o", "/dev/null", "-n1", "-J", f"bench-bare-{i}",
            *([f"--partition={partition}"] if partition else []), "--wrap", f"date +%s.%N > {mark}"]
    t0 = time.time()
    sid = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    took = wait_file(mark) - t0
    wait_gone(sid)
    return took


def ours_one(i: int, work: Path, svc) -> float:
    """Submit-to-start of one job through the queue and the service on Slurm (waited for until it ended)."""
    from orchestrator.api import jobs as api
    from orchestrator.queue.models import JobSpec

    mark = work / f"ours-{i}"
    t0 = time.time()
    job = api.submit(JobSpec(argv=["sh", "-c", f"date +%s.%N > {mark}"], track=False))[0]
    took = wait_file(mark) - t0
    while not svc.store.get(job.id).final:
        time.sleep(0.01)
    wait_gone((svc.store.get(job.id).proc_start or ":").split(":", 1)[1])
    return took


def measure(n: int, work: Path, partition: str | None) -> tuple[list[float], list[float]]:
    """(bare, ours) submit-to-start of `n` jobs each, alternating one of each so both see the same load."""
    home = work / "home"
    os.environ.update(AUTORESEARCH_HOME=str(home), AUTORESEARCH_PREFLIGHT="off",
                      MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}")
    if partition:
        os.environ["AUTORESEARCH_SLURM_PARTITION"] = partition
    from orchestrator.core.config import Settings
    from orchestrator.service.daemon import Service

    svc = Service(Settings.load(devices="cpu:1", executor="slurm"), preempt_after=0, tick=0.2).start()
    bare, ours = [], []
    try:
        ours_one(-1, work, svc)  # warm-up: the service's first pass and imports
        for i in range(n):
            bare.append(bare_one(i, work, partition))
            ours.append(ours_one(i, work, svc))
    finally:
        svc.stop()
    return bare, ours


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"median {statistics.median(xs) * 1000:7.0f} ms   p90 {p90 * 1000:7.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--partition", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="slurm-bench-") as tmp:
        work = Path(tmp)
        b, o = measure(args.jobs, work, args.partition)
    print(f"submit-to-start, {args.jobs} jobs one at a time")
    print(f"  bare sbatch          {summary(b)}")
    print(f"  autoresearch (slurm) {summary(o)}")
    print(f"  ratio (ours / bare, medians) {statistics.median(o) / statistics.median(b):.2f}x")


if __name__ == "__main__":
    main()
