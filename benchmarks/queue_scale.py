"""The queue at scale: submit, a dispatch pass, `queue` (unfinished jobs) and `show` on an empty database and on
one holding 100,000 finished and 10,000 queued jobs (each finished job with 4 events), side by side.

    python benchmarks/queue_scale.py [--finished 100000] [--queued 10000] [--reps 50]

The aim (issue 16): every row within 2x of the empty database. Rows are filled with SQL (a recursive CTE
copying one submitted job), not through the API, so filling takes seconds. Prints ratios big/empty; the
dispatch pass runs in-process on 8 `cpu:N` slots that are all busy (the pass plans and starts nothing, which
is the common case on a full box).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fill(store, finished: int, queued: int) -> None:
    """Copy job 1 into `finished` SUCCEEDED jobs (4 events each) and `queued` QUEUED jobs."""
    from sqlalchemy import text

    from orchestrator.queue.models import Job, JobEvent

    cols = [c.name for c in Job.__table__.columns if c.name not in ("id", "state")]
    ecols = [c.name for c in JobEvent.__table__.columns if c.name not in ("id", "job_id")]
    with store.engine.begin() as conn:
        for n, state in ((finished, "SUCCEEDED"), (queued, "QUEUED")):
            conn.execute(text(
                f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {n}) "
                f"INSERT INTO jobs (state, {', '.join(cols)}) SELECT '{state}', {', '.join(cols)} "
                f"FROM n, jobs WHERE jobs.id = 1"))
        conn.execute(text(
            f"INSERT INTO job_events (job_id, {', '.join(ecols)}) SELECT jobs.id, {', '.join('e.' + c for c in ecols)} "
            f"FROM jobs, job_events e, (SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4) "
            f"WHERE jobs.state = 'SUCCEEDED' AND e.job_id = 1"))


def measure(home: Path, finished: int, queued: int, reps: int) -> dict[str, float]:
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    from orchestrator import api
    from orchestrator.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.queue.store import JobStore
    from orchestrator.service import Service

    settings = Settings.load()
    store = JobStore(settings.db_url)
    spec = JobSpec(argv=["sleep", "600"], track=False, priority=-5)
    store.submit(spec)
    if finished or queued:
        fill(store, finished, queued)
    service = Service(settings, devices="cpu:8", preempt_after=1e9, tick=3600).start()
    try:
        deadline = time.time() + 60
        while store.count_in("RUNNING") < 8 and time.time() < deadline:  # fill every slot, then time
            time.sleep(0.05)
        out = {}
        t = time.perf_counter()
        for _ in range(reps):
            api.submit(spec, settings, store)
        out["submit (api.submit)"] = (time.perf_counter() - t) / reps
        with service.guard.placing():
            t = time.perf_counter()
            for _ in range(reps):
                service.dispatch_once()
            out["dispatch pass (slots full)"] = (time.perf_counter() - t) / reps
        t = time.perf_counter()
        for _ in range(max(1, reps // 10)):
            store.unfinished()
        out["queue: unfinished jobs"] = (time.perf_counter() - t) / max(1, reps // 10)
        t = time.perf_counter()
        for _ in range(reps):
            api.show(1, store)
        out["show 1"] = (time.perf_counter() - t) / reps
        for job in store.list(["RUNNING", "STARTING"]):
            store.cancel(job.id)
    finally:
        service.stop()
        from tests.orchestrator.helpers import kill_leftovers

        kill_leftovers(store)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=100_000)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    import json
    import subprocess

    results = {}
    for label, finished, queued in (("empty", 0, 0), ("big", args.finished, args.queued)):
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
            code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.queue_scale import measure; "
                    f"from pathlib import Path; print(json.dumps(measure(Path({tmp!r}), {finished}, {queued}, "
                    f"{args.reps})))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"queue at scale: empty database vs {args.finished} finished + {args.queued} queued jobs (ms):")
    for name in results["empty"]:
        empty, big = results["empty"][name], results["big"][name]
        print(f"  {name:28s} empty {1000 * empty:8.2f}   big {1000 * big:8.2f}   ratio {big / empty:6.2f}x")


if __name__ == "__main__":
    main()
