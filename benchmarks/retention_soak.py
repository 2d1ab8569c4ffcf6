"""Retention soak: a session-like stream of short jobs that each write a checkpoint, with the default retention
policy against retention off, side by side on the same machine.

Each job (a `sh -c` that writes one complete `step_1/` checkpoint of `--mb` MB with its `.metadata`) belongs to
one agent session registered in the home's agent registry, as a session's trials do; a scorer thread gives
each finished trial a score as the session does once it reads the trial's metric (seeded random values). When
every job has ended the session is marked finished. We report:

- the home's size at the end (every file under AUTORESEARCH_HOME, after the service's last retention pass)
  with `retention = "ranked"` (the default: the best 3 kept) against `retention = "off"` (aim: under 2%);
- the dispatch rate (jobs finished per second, from the first start to the last end) with the service's
  retention pass running every `--gc-every` seconds against no retention pass at all (aim: >= 0.9x).

Run: ``python benchmarks/retention_soak.py [--jobs 2000] [--mb 2] [--slots 8] [--gc-every 1]``
(``--jobs 200`` for a quick look). Needs a few GB free in the temp dir for the retention-off run.

``--pass-cost N`` instead times the service's retention pass over a home of months: N finished people's jobs
(kept) and N session trials whose checkpoints were removed, against a full pass (what `gc` does) over it.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SESSION = "soak-session"


def home_bytes(home: Path) -> int:
    """Every byte of every file under the home."""
    from orchestrator.service.gc import tree_bytes

    return tree_bytes(home)


def run(jobs: int, mb: float, slots: int, gc_every: float, retention: str) -> dict:
    """One soak in a fresh home; returns its figures."""
    root = Path(tempfile.mkdtemp(prefix=f"soak-{retention}-"))
    os.environ.update(AUTORESEARCH_HOME=str(root), AUTORESEARCH_RETENTION=retention,
                      AUTORESEARCH_GC_EVERY=str(gc_every), AUTORESEARCH_DISK_MIN_FREE_MB="0",
                      MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}")
    os.environ.pop("AUTORESEARCH_DB_URL", None)
    from orchestrator.agent.session import Registry
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.service.daemon import Service

    registry = Registry(root)
    with registry.conn:
        registry.conn.execute("INSERT INTO sessions (id, experiment, status, created_at, updated_at) "
                              "VALUES (?, 'soak', 'running', 0, 0)", (SESSION,))
    size = int(mb * 1024 * 1024)
    script = ('mkdir -p "$AUTORESEARCH_CHECKPOINT_DIR/step_0000000001" && '
              f'head -c {size} /dev/urandom > "$AUTORESEARCH_CHECKPOINT_DIR/step_0000000001/__0_0.distcp" && '
              ': > "$AUTORESEARCH_CHECKPOINT_DIR/step_0000000001/.metadata" && echo val_loss: 1.0')
    service = Service(Settings.load(), devices=f"cpu:{slots}", tick=0.2).start()
    store = service.store
    for _ in range(jobs):
        store.submit(JobSpec(argv=["sh", "-c", script], owner=SESSION, experiment="soak", phase="search",
                               track=False, name="trial"))
    rng = random.Random(0)
    done = threading.Event()

    def scorer() -> None:  # what the session does as trials finish: their value becomes their score
        scored: set[int] = set()
        while not done.is_set():
            finished = [j.id for j in store.list(owner=SESSION) if j.final and j.id not in scored]
            store.keeping.set_scores({job_id: rng.random() for job_id in finished})
            scored.update(finished)
            done.wait(0.5)

    thread = threading.Thread(target=scorer, daemon=True)
    thread.start()
    while True:
        counts = store.state_counts(finished=True, owner=SESSION)
        ended = sum(n for s, n in counts.items() if s in ("SUCCEEDED", "FAILED", "CANCELLED"))
        if ended >= jobs:
            break
        time.sleep(1.0)
    done.set()
    thread.join()
    first_start = min(j.started_at for j in store.list(owner=SESSION) if j.started_at)
    last_end = max(j.finished_at for j in store.list(owner=SESSION) if j.finished_at)
    failed = store.state_counts(finished=True, owner=SESSION).get("FAILED", 0)
    registry.update(SESSION, status="finished")  # the session ends: its trials' fate is settled
    registry.close()
    service.collect_garbage()  # the service's next pass, now
    service.stop()
    out = {"retention": retention, "jobs": jobs, "failed": failed, "home_bytes": home_bytes(root),
           "rate": jobs / max(1e-9, last_end - first_start), "gc_passes": service.gc_passes,
           "kept": sum(1 for p in (root / "checkpoints").iterdir() if any(p.iterdir()))}
    shutil.rmtree(root, ignore_errors=True)
    return out


def pass_cost(n: int, passes: int = 5) -> None:
    """Seconds per service pass (nothing changed since the last) and per full pass over 2n finished jobs."""
    from sqlalchemy import text

    root = Path(tempfile.mkdtemp(prefix="soak-pass-"))
    os.environ.update(AUTORESEARCH_HOME=str(root), MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}")
    os.environ.pop("AUTORESEARCH_DB_URL", None)
    from orchestrator.agent.session import Registry
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.queue.store import JobStore
    from orchestrator.service.gc import Collector

    settings = Settings.load()
    store = JobStore(settings.db_url)
    registry = Registry(root)
    with registry.conn:
        registry.conn.execute("INSERT INTO sessions (id, experiment, status, created_at, updated_at) "
                              "VALUES (?, 'soak', 'finished', 0, 0)", (SESSION,))
    registry.close()
    for owner in (SESSION, "human"):
        for _ in range(n):
            store.submit(JobSpec(argv=["true"], owner=owner, experiment="soak", track=False))
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    with store.db.engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET state = 'SUCCEEDED', finished_at = :now, checkpoint_dir = :d || id, "
                          "log_path = :l || id || '.log'"),
                     {"d": f"{root / 'checkpoints'}/", "l": f"{logs}/", "now": time.time() - 60})
        conn.execute(text("UPDATE jobs SET checkpoint_gc = 'removed' WHERE owner = :s"), {"s": SESSION})
    for i in range(1, 2 * n + 1):
        (logs / f"{i}.log").write_text("x\n")
    collector = Collector(settings, store)
    collector.collect(everything=False)  # the service's first pass does everything
    timed = []
    for everything in (False, True):
        start = time.perf_counter()
        for _ in range(passes):
            collector.collect(everything=everything)
        timed.append((time.perf_counter() - start) / passes)
    print(f"retention pass over {2 * n} finished jobs: service pass {1000 * timed[0]:.1f} ms, full pass "
          f"{1000 * timed[1]:.1f} ms ({timed[1] / timed[0]:.1f}x)")
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    """Both runs, then the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--mb", type=float, default=2.0, help="checkpoint size of each job (MB)")
    ap.add_argument("--slots", type=int, default=8, help="cpu:N slots of the service")
    ap.add_argument("--gc-every", type=float, default=1.0, help="seconds between the service's retention passes")
    ap.add_argument("--repeat", type=int, default=1, help="pairs of runs, alternating which goes first (the "
                    "rate ratio is the median of the pairs': a shared machine's load drifts)")
    ap.add_argument("--pass-cost", type=int, default=0, metavar="N", help="time the retention pass over N "
                    "people's jobs and N removed trials instead")
    args = ap.parse_args()
    if args.pass_cost:
        pass_cost(args.pass_cost)
        return
    pairs = []
    for i in range(args.repeat):
        order = ("ranked", "off") if i % 2 == 0 else ("off", "ranked")
        got = {name: run(args.jobs, args.mb, args.slots, args.gc_every if name == "ranked" else 0.0, name)
               for name in order}
        pairs.append((got["ranked"], got["off"]))
    ratios = sorted(r["rate"] / o["rate"] for r, o in pairs)
    ranked, off = pairs[-1]
    for r in (x for pair in pairs for x in pair):
        print(f"retention={r['retention']:<6} jobs={r['jobs']} failed={r['failed']} "
              f"home={r['home_bytes'] / 2**20:9.1f} MiB  kept dirs={r['kept']:5d}  "
              f"rate={r['rate']:6.1f} jobs/s  gc passes={r['gc_passes']}")
    print(f"home size, default policy / retention off: {ranked['home_bytes'] / off['home_bytes']:.4f} "
          f"({100 * ranked['home_bytes'] / off['home_bytes']:.2f}%; aim < 2%)")
    print(f"dispatch rate with retention passes every {args.gc_every:g}s / without: "
          f"{ratios[len(ratios) // 2]:.2f}x, median of {len(ratios)} pairs {[round(x, 2) for x in ratios]} "
          "(aim >= 0.9x)")


if __name__ == "__main__":
    main()
