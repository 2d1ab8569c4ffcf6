"""The queue at scale: submit, a dispatch pass, `queue` (unfinished jobs: the table and the JSON of the first 50,
and of all of them) and `show` on an empty database and on one holding 100,000 finished and 10,000 queued jobs
(each finished job with 4 events), side by side.

    python benchmarks/queue_scale.py [--finished 100000] [--queued 10000] [--reps 50] [--rounds 5]

The aim (issue 16): every row within 2x of the empty database. Rows are filled with SQL (a recursive CTE
copying one submitted job), not through the API, so filling takes seconds. Each database lives in a worker
process with its service; the rows run on both back to back, in rounds, so both see the same load on a busy
machine. Prints the median of the rounds and the ratio big/empty; the dispatch pass runs in-process on 8
`cpu:N` slots that are all busy (the pass plans and starts nothing, which is the common case on a full box).
The full listing (`--limit 0`) is there to show what it costs, not for the aim: its output grows with the queue.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
    with store.db.engine.begin() as conn:
        for n, state in ((finished, "SUCCEEDED"), (queued, "QUEUED")):
            conn.execute(text(
                f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {n}) "
                f"INSERT INTO jobs (state, {', '.join(cols)}) SELECT '{state}', {', '.join(cols)} "
                f"FROM n, jobs WHERE jobs.id = 1"))
        conn.execute(text(
            f"INSERT INTO job_events (job_id, {', '.join(ecols)}) SELECT jobs.id, {', '.join('e.' + c for c in ecols)} "
            f"FROM jobs, job_events e, (SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4) "
            f"WHERE jobs.state = 'SUCCEEDED' AND e.job_id = 1"))


def timed(fn, reps: int) -> float:
    """Seconds per call of `fn`."""
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def table(store) -> None:
    """What `autoresearch queue` prints (the first 50 unfinished jobs and the line counting the rest), into a
    buffer instead of the terminal."""
    import contextlib
    import io

    from orchestrator.faces.cli.jobs import print_listing

    with contextlib.redirect_stdout(io.StringIO()):
        print_listing(store.listing())


def worker(home: Path, finished: int, queued: int) -> None:
    """One database with its service: prints "ready", then answers each row name read on stdin with the seconds
    per call of that row (one JSON line), until stdin closes."""
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    from orchestrator.api import jobs as api
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.queue.store import JobStore
    from orchestrator.service.daemon import Service

    settings = Settings.load()
    store = JobStore(settings.db_url)
    spec = JobSpec(argv=["sleep", "600"], track=False, priority=-5)
    store.submit(spec)
    if finished or queued:
        fill(store, finished, queued)
    service = Service(settings, devices="cpu:8", preempt_after=1e9, tick=3600).start()

    def dispatch() -> None:
        with service.guard.placing():
            service.dispatch_once()

    rows = {
        "submit (api.submit)": lambda: api.submit(spec, settings, store),
        "dispatch pass (slots full)": dispatch,
        "queue (table, first 50)": lambda: table(store),
        "queue --json (first 50)": lambda: json.dumps(store.listing().jobs, default=str, indent=2),
        "queue --json --limit 0 (all)": lambda: json.dumps(store.listing(limit=None).jobs, default=str, indent=2),
        "show 1 --json": lambda: json.dumps(store.record(1), default=str, indent=2),
        # The command as a person or an agent runs it: the console script, answered by the service.
        "`autoresearch queue --json`": lambda: subprocess.run(
            [sys.executable, "-m", "orchestrator.faces.fastcli", "queue", "--json"], check=True, capture_output=True,
            cwd=ROOT),
    }
    try:
        deadline = time.time() + 60
        while store.count_in("RUNNING") < 8 and time.time() < deadline:  # fill every slot, then time
            time.sleep(0.05)
        for fn in rows.values():
            fn()  # warm up
        print("ready", flush=True)
        for line in sys.stdin:
            name, reps = json.loads(line)
            print(json.dumps(timed(rows[name], reps)), flush=True)
    finally:
        for job in store.list(["RUNNING", "STARTING"]):
            store.cancel(job.id)
        service.stop()
        from tests.orchestrator.helpers import kill_leftovers

        kill_leftovers(store)


# (row, calls per round): the full listing costs a second or more per call on the big database
ROWS = [("submit (api.submit)", 1), ("dispatch pass (slots full)", 1), ("queue (table, first 50)", 1),
        ("queue --json (first 50)", 1), ("show 1 --json", 1), ("`autoresearch queue --json`", 0.25),
        ("queue --json --limit 0 (all)", 0.1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=100_000)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=50, help="calls of each row per database (fewer for the "
                        "slow rows), in rounds that alternate between the databases")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import statistics

    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        workers = {}
        for label, finished, queued in (("empty", 0, 0), ("big", args.finished, args.queued)):
            (Path(tmp) / label).mkdir()
            code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.queue_scale import worker; "
                    f"from pathlib import Path; worker(Path({str(Path(tmp) / label)!r}), {finished}, {queued})")
            workers[label] = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, text=True)
        for proc in workers.values():
            assert proc.stdout.readline().strip() == "ready"
        times: dict[tuple[str, str], list[float]] = {}
        for rnd in range(args.rounds):  # each row on both databases back to back, the order swapped each round
            for name, share in ROWS:
                reps = max(1, round(args.reps * share / args.rounds))
                for label in (("empty", "big") if rnd % 2 == 0 else ("big", "empty")):
                    proc = workers[label]
                    proc.stdin.write(json.dumps([name, reps]) + "\n")
                    proc.stdin.flush()
                    times.setdefault((name, label), []).append(json.loads(proc.stdout.readline()))
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=120)
    print(f"queue at scale: empty database vs {args.finished} finished + {args.queued} queued jobs "
          f"(ms, median of {args.rounds} interleaved rounds):")
    for name, _ in ROWS:
        empty, big = (statistics.median(times[(name, label)]) for label in ("empty", "big"))
        print(f"  {name:30s} empty {1000 * empty:8.2f}   big {1000 * big:8.2f}   ratio {big / empty:6.2f}x")


if __name__ == "__main__":
    main()
