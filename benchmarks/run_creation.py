"""MLflow runs for queued jobs: the tracking worker's batched writes against `MlflowClient.create_run`.

    python benchmarks/run_creation.py [--runs 200] [--rounds 3] [--batch N]

Both make the same runs (a name, the job's tags, one param) in one SQLite tracking store tuned as the worker
tunes it (WAL, synchronous=NORMAL), alternating in each round: `MlflowClient.create_run` plus `log_batch`
one run at a time, and `orchestrator.tracking.jobruns.create_runs` (MLflow's own table models; its transactions as
the worker makes them, growing from `RUNS_PER_COMMIT` runs to `MAX_RUNS_PER_COMMIT`, or `--batch` runs each). Then both end the runs: `set_terminated` one at a time against `jobruns.end_runs`. Prints CPU
milliseconds per run (this process's thread time: the worker is single-threaded) and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.tracking import jobruns  # noqa: E402
from orchestrator.tracking.worker import tune_sqlite_tracking  # noqa: E402
from orchestrator.tracking.client import Tracker  # noqa: E402


def requests(n: int, start: int) -> list[dict]:
    out = []
    for job_id in range(start, start + n):
        name = f"noop-{job_id}"
        out.append({"id": job_id, "experiment": "jobs", "name": name, "params": {"lr": "0.1"},
                    "tags": {"autoresearch.job_id": str(job_id), "autoresearch.owner": "bench",
                             "mlflow.runName": name}})
    return out


def cpu_ms_per_run(fn, n: int) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, help="runs per transaction (default: as the worker makes them)")
    args = parser.parse_args()
    if args.batch:
        jobruns.RUNS_PER_COMMIT = jobruns.MAX_RUNS_PER_COMMIT = args.batch
    home = Path(tempfile.mkdtemp(prefix="run-creation-"))
    uri = f"sqlite:///{home / 'mlflow.db'}"
    tune_sqlite_tracking(uri)
    tracker = Tracker(uri, home / "artifacts")
    list(jobruns.create_runs(tracker, requests(20, 10 ** 6)))  # warm both paths (imports, the experiment)
    jobruns.create_run(tracker, requests(1, 2 * 10 ** 6)[0])
    made = {"client": [], "batched": []}
    ended = {"client": [], "batched": []}
    next_id = 0
    for _ in range(args.rounds):
        batch = requests(args.runs, next_id)
        next_id += args.runs
        ids: list[str] = []
        made["client"].append(cpu_ms_per_run(lambda: ids.extend(jobruns.create_run(tracker, r) for r in batch),
                                             args.runs))
        ended["client"].append(cpu_ms_per_run(
            lambda: [tracker.client.set_terminated(run_id, "FINISHED") for run_id in ids], args.runs))
        batch = requests(args.runs, next_id)
        next_id += args.runs
        ids = []
        made["batched"].append(cpu_ms_per_run(
            lambda: ids.extend(run_id for _, run_id in jobruns.create_runs(tracker, batch)), args.runs))
        ends = [{"run": run_id, "status": "FINISHED", "end": int(time.time() * 1000)} for run_id in ids]
        ended["batched"].append(cpu_ms_per_run(lambda: jobruns.end_runs(tracker, ends), args.runs))
    for what, rows in (("make a run (with its params)", made), ("end a run", ended)):
        client, batched = statistics.median(rows["client"]), statistics.median(rows["batched"])
        rounds = "; ".join(f"{side} " + ", ".join(f"{v:.2f}" for v in rows[side]) for side in rows)
        print(f"{what:30s} client {client:6.2f} ms CPU  batched {batched:6.2f} ms CPU  "
              f"client/batched {client / batched:5.1f}x  (rounds: {rounds})")


if __name__ == "__main__":
    main()
