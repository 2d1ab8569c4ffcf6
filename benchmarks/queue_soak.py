"""The queue service's memory: idle, and over a soak of many short jobs.

    python benchmarks/queue_soak.py [--jobs 20000] [--slots 2] [--tracked 20]

`autoresearch serve --devices cpu:SLOTS` runs in its own process on a fresh home, as users run it. The
resident memory (RSS) of its whole process tree (the service, its tracking worker and any other child; the
jobs themselves are no-op `true` and are not running when it is sampled) is printed:
1. at start (once its start-up device check ended), and 15 s later (idle, after its warm-ups: the README's row);
2. after a warm-up of 500 no-op untracked jobs, then every `--every` jobs of the soak and at its end
   (`--jobs` no-op untracked jobs submitted through the library API, `api.submit`, in chunks of 1,000 so
   the queue stays short), with the growth from the warm-up to the end;
3. with `--tracked N`: N tracked jobs (one MLflow run each: the tracking worker starts), and again after the
   worker's idle time (it stops). Also which heavy compiled libraries the service process has mapped
   (`/proc/PID/maps`: torch, numpy, pandas, pyarrow, Ray; MLflow itself is pure Python and shows as pandas
   and pyarrow) at each point; `tests/orchestrator/test_idle_imports.py` checks `sys.modules` itself.
Absolute numbers depend on the Python build and libraries; growth over the soak is what to compare.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.served import Served  # noqa: E402
HEAVY = ("torch", "numpy", "pandas", "pyarrow", "ray")


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and all its descendants, in MB."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total / 1e6


def heavy_loaded(pid: int) -> list[str]:
    """Which of HEAVY the process has loaded: a shared object of that package mapped in."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return [name for name in HEAVY if f"/site-packages/{name}/" in maps or f"/site-packages/{name}." in maps]


class Soaked(Served):
    """The served service, with its memory and a way to push jobs through it."""

    def rss(self) -> float:
        return tree_rss_mb(self.proc.pid)

    def run(self, n: int, *, track: bool = False, chunk: int = 1000) -> None:
        """Submit `n` no-op jobs in chunks and wait until all of them succeeded."""
        from orchestrator.api import jobs as api
        from orchestrator.queue.models import JobSpec
        from orchestrator.queue.states import JobState

        spec = JobSpec(argv=["true"], track=track)
        target = self.store.count_in(JobState.SUCCEEDED) + n
        while n > 0:
            for _ in range(min(chunk, n)):
                api.submit(spec, self.settings, store=self.store)
            n -= min(chunk, n)
            while self.store.count_in(JobState.SUCCEEDED) < target - n - chunk // 2:
                time.sleep(0.05)  # keep at most about half a chunk queued before the next chunk
        while self.store.count_in(JobState.SUCCEEDED) < target:
            time.sleep(0.05)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--every", type=int, default=5000, help="print RSS every this many soak jobs")
    parser.add_argument("--tracked", type=int, default=0, help="then run this many tracked jobs")
    parser.add_argument("--idle-wait", type=float, default=15.0, help="seconds after start for the idle row")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    served = Soaked(tmp / "home", args.slots)
    pid = served.proc.pid
    try:
        print(f"autoresearch serve --devices cpu:{args.slots}: process tree RSS (MB)")
        print(f"  at start                        {served.rss():7.1f}")
        time.sleep(args.idle_wait)
        print(f"  idle, {args.idle_wait:.0f} s after start           {served.rss():7.1f}   heavy libraries: "
              f"{heavy_loaded(pid) or 'none'}")
        t0 = time.perf_counter()
        served.run(args.warmup)
        warm = served.rss()
        print(f"  after a warm-up of {args.warmup} jobs       {warm:7.1f}")
        done = 0
        while done < args.jobs:
            step = min(args.every, args.jobs - done)
            served.run(step)
            done += step
            print(f"  after {done:6d} soak jobs           {served.rss():7.1f}")
        end = served.rss()
        rate = (args.warmup + args.jobs) / (time.perf_counter() - t0)
        print(f"  growth over {args.jobs} jobs: {end - warm:+.1f} MB ({(end - warm) / warm * 100:+.1f}%); "
              f"{rate:.0f} jobs/s; heavy libraries: {heavy_loaded(pid) or 'none'}")
        if args.tracked:
            served.run(args.tracked, track=True, chunk=args.tracked)
            print(f"  after {args.tracked} tracked jobs (worker up)  {served.rss():7.1f}   service's heavy "
                  f"libraries: {heavy_loaded(pid) or 'none'}")
            from orchestrator.tracking.worker import IDLE_EXIT

            time.sleep(IDLE_EXIT + 5)
            print(f"  {IDLE_EXIT + 5:.0f} s later (worker stopped)    {served.rss():7.1f}")
    finally:
        served.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
