"""Queue throughput and submit-to-start latency, side by side with Debian's task-spooler (`tsp`).

    python benchmarks/queue_throughput.py [--jobs 500] [--slots 8] [--latency-jobs 40] [--rounds 3]

Both queues get the same work in the same run:
1. throughput: N no-op jobs (`true`) on 8 slots, submitted back to back from another process, timed from the
   first submit to the last job's end (tsp: one `tsp` call per job, as users do; autoresearch: `autoresearch
   serve` in its own process, and one submitter process calling the library `api.submit`, the agent's path;
   the per-call cost of the `autoresearch submit` CLI is reported separately). Both sides look at the queue
   only once every job is submitted: at the last job's state every 2 ms, then at the count of finished jobs.
   Each round's service is timed in its steady state, as a service that has run jobs before: after its
   start-up device check and an untimed warm-up of four jobs per slot (`warm_up`: its spawner processes,
   started on first use, and for tracked jobs its tracking worker are up). A fresh service's first burst
   pays for those starts: without the warm-up the untracked ratio was 0.48x against 0.58x with it, in five
   alternating rounds (0.53x cold in a later set of six);
3. one CLI call with a service running: `submit`, `queue --json`, `show --json` through the console script's
   lean path (`orchestrator.faces.fastcli`, handed to the service over its socket) and through the full typer CLI,
   wall and CPU, against one `tsp` call;
2. latency on an idle queue: one job at a time that records when it started; submit-to-start p50 and p95.
autoresearch runs with MLflow tracking off (`track=False`, `submit --no-track`) for the no-op jobs and, in a
third row, with a tracked MLflow run per job (the default), which costs an MLflow `create_run` per job.
Prints ratios; absolute times on a shared 2-core machine are noise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.served import Served  # noqa: E402


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# ---- task-spooler ---------------------------------------------------------------------------------------

def tsp_env(tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TS_SOCKET": str(tmp / "tsp.sock"), "TS_MAXFINISHED": "100000", "TMPDIR": str(tmp)}


def tsp(env, *args) -> str:
    return subprocess.run(["tsp", *args], env=env, capture_output=True, text=True, check=True).stdout


def tsp_throughput(jobs: int, slots: int, tmp: Path) -> float:
    env = tsp_env(tmp)
    tsp(env, "-S", str(slots))
    start = time.perf_counter()
    last = None
    for _ in range(jobs):
        last = tsp(env, "-n", "true").strip()
    while True:
        state = tsp(env, "-s", last).strip()
        if state == "finished":
            out = tsp(env, "-l")
            if out.count(" finished ") >= jobs:
                break
        time.sleep(0.002)
    elapsed = time.perf_counter() - start
    tsp(env, "-K")
    return elapsed


def tsp_latency(n: int, tmp: Path) -> list[float]:
    env = tsp_env(tmp)
    tsp(env, "-S", "8")
    lat = []
    for i in range(n):
        mark = tmp / f"tsp-start-{i}"
        t0 = time.time()
        tsp(env, "-n", "sh", "-c", f"date +%s.%N > {mark}")
        while not mark.exists() or not mark.read_text().strip():
            time.sleep(0.001)
        lat.append(float(mark.read_text()) - t0)
    tsp(env, "-K")
    return lat


# ---- autoresearch ----------------------------------------------------------------------------------------

SUBMITTER = """
import sys
from orchestrator.api import jobs as api
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.core.config import Settings
settings = Settings.load()  # as the agent holds them: its submits pass settings and store
store = JobStore.from_settings(settings)
spec = JobSpec(argv=["true"], track=sys.argv[2] == "1")
print("ready", flush=True)
sys.stdin.readline()
job = None
for _ in range(int(sys.argv[1])):
    job, _ = api.submit(spec, settings, store)
print(job.id if job else 0, flush=True)
"""


def warm_up(store, slots: int, track: bool) -> int:
    """Untimed, as a service that has run before: four jobs per slot back to back, so the processes a service
    starts on first use are up (its spawner processes, started when a pass first starts that many jobs, and for
    tracked jobs the tracking worker with its MLflow import), on the service whose `store` this is. Returns the
    number of jobs run."""
    from orchestrator.api import jobs as api
    from orchestrator.queue.models import JobSpec
    from orchestrator.queue.states import JobState

    for _ in range(4 * slots):
        api.submit(JobSpec(argv=["true"], track=track), store=store)
    while store.count_in(JobState.SUCCEEDED) < 4 * slots:
        time.sleep(0.02)
    return 4 * slots


def ar_throughput(jobs: int, slots: int, home: Path, track: bool) -> float:
    from orchestrator.queue.states import JobState

    served = Served(home, slots)
    try:
        jobs_before = warm_up(served.store, slots, track)
        sub = subprocess.Popen([sys.executable, "-c", SUBMITTER, str(jobs), "1" if track else "0"],
                               env=served.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert sub.stdout.readline().strip() == "ready"
        start = time.perf_counter()
        sub.stdin.write("go\n")
        sub.stdin.flush()
        # As tsp's loop: look at the queue once every job is submitted, first at the last job, then the count
        # (a count every few ms while the jobs ran cost the box a tenth of its CPU, which tsp's side never paid).
        last = int(sub.stdout.readline())
        sub.wait(timeout=60)
        while not (served.store.get(last).job_state is JobState.SUCCEEDED
                   and served.store.count_in(JobState.SUCCEEDED) >= jobs + jobs_before):
            time.sleep(0.002)
        return time.perf_counter() - start
    finally:
        served.close()


def ar_latency(n: int, home: Path) -> list[float]:
    from orchestrator.api import jobs as api
    from orchestrator.queue.models import JobSpec

    served = Served(home, 8)
    lat = []
    try:
        for i in range(n):
            mark = home / f"ar-start-{i}"
            t0 = time.time()
            api.submit(JobSpec(argv=["sh", "-c", f"date +%s.%N > {mark}"], track=False), store=served.store)
            while not mark.exists() or not mark.read_text().strip():
                time.sleep(0.001)
            lat.append(float(mark.read_text()) - t0)
    finally:
        served.close()
    return lat


def cli_seconds(n: int, home: Path, *args: str, entry: str = "orchestrator.faces.fastcli") -> tuple[float, float]:
    """Mean wall and CPU seconds (user + system of the child) of one `autoresearch ARGS` call. The console
    script's module is `orchestrator.faces.fastcli`; `orchestrator.faces.cli` is the full typer CLI."""
    env = {**os.environ, "AUTORESEARCH_HOME": str(home)}
    before = os.times()
    start = time.perf_counter()
    for _ in range(n):
        subprocess.run([sys.executable, "-m", entry, *args], env=env, check=True, capture_output=True)
    wall = (time.perf_counter() - start) / n
    after = os.times()
    cpu = (after.children_user - before.children_user + after.children_system - before.children_system) / n
    return wall, cpu


def cli_rows(n: int, home: Path) -> dict[str, tuple[float, float]]:
    """`submit`, `queue --json` and `show --json` with a service running: the lean path and the full CLI."""
    served = Served(home, 2)
    try:
        subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "submit", "--no-track", "--", "sleep", "60"],
                       env=served.env, check=True, capture_output=True)
        rows = {
            "submit (lean, service running)": cli_seconds(n, home, "submit", "--no-track", "--", "true"),
            "submit --project/--scavenger/--deadline (lean)": cli_seconds(
                n, home, "submit", "--no-track", "--project", "default", "--scavenger", "--deadline", "2h", "--", "true"),
            "submit (full typer CLI)": cli_seconds(n, home, "submit", "--no-track", "--", "true",
                                                   entry="orchestrator.faces.cli"),
            "queue --json (lean)": cli_seconds(n, home, "queue", "--json"),
            "show 1 --json (lean)": cli_seconds(n, home, "show", "1", "--json"),
            "queue --json (full typer CLI)": cli_seconds(n, home, "queue", "--json", entry="orchestrator.faces.cli"),
        }
        served.store.cancel(1)
    finally:
        served.close()
    return rows


def tsp_client_seconds(n: int, tmp: Path, *args: str) -> float:
    env = tsp_env(tmp)
    start = time.perf_counter()
    for _ in range(n):
        tsp(env, *args)
    return (time.perf_counter() - start) / n


def tsp_submit_seconds(n: int, tmp: Path) -> float:
    env = tsp_env(tmp)
    tsp(env, "-S", "1")
    tsp(env, "-n", "sleep", "30")
    start = time.perf_counter()
    for _ in range(n):
        tsp(env, "-n", "true")
    elapsed = (time.perf_counter() - start) / n
    tsp(env, "-K")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--latency-jobs", type=int, default=40)
    parser.add_argument("--cli-submits", type=int, default=10, help="calls per CLI row")
    parser.add_argument("--rounds", type=int, default=3,
                        help="throughput rounds, each tsp then autoresearch back to back (ratios per round)")
    args = parser.parse_args()
    if shutil.which("tsp") is None:
        sys.exit("task-spooler is not installed (apt-get install task-spooler)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    try:
        rounds = []  # (tsp, untracked, tracked) seconds, one triple per round: the box's load drifts between
        for r in range(args.rounds):
            rounds.append((tsp_throughput(args.jobs, args.slots, tmp / f"tsp1-{r}"),
                           ar_throughput(args.jobs, args.slots, tmp / f"ar1-{r}", track=False),
                           ar_throughput(args.jobs, args.slots, tmp / f"ar2-{r}", track=True)))
        l_tsp = tsp_latency(args.latency_jobs, tmp / "tsp2")
        l_ar = ar_latency(args.latency_jobs, tmp / "ar3")
        s_tsp = tsp_submit_seconds(args.cli_submits, tmp / "tsp3")
        env4 = tsp_env(tmp / "tsp4")
        tsp(env4, "-S", "1")
        tsp(env4, "-n", "sleep", "30")
        l_tsp_list = tsp_client_seconds(args.cli_submits, tmp / "tsp4", "-l")
        tsp(env4, "-K")
        cli = cli_rows(args.cli_submits, tmp / "ar4")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    n = args.jobs
    print(f"throughput, {n} no-op jobs on {args.slots} slots, {len(rounds)} rounds (jobs/s per round; ratio: "
          f"median of the rounds' ratios, [min-max]):")

    def row(name: str, col: int) -> None:
        rates = " ".join(f"{n / r[col]:7.1f}" for r in rounds)
        if col == 0:
            print(f"  {name:36s} {rates}")
            return
        ratios = sorted(r[0] / r[col] for r in rounds)
        print(f"  {name:36s} {rates}   ratio vs tsp {statistics.median(ratios):5.2f}x "
              f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]")

    row("task-spooler", 0)
    row("autoresearch (untracked)", 1)
    row("autoresearch (MLflow run per job)", 2)
    print(f"submit-to-start on an idle queue, {args.latency_jobs} jobs (ms):")
    print(f"  task-spooler     p50 {1000 * statistics.median(l_tsp):7.1f}  p95 {1000 * pct(l_tsp, 95):7.1f}")
    print(f"  autoresearch     p50 {1000 * statistics.median(l_ar):7.1f}  p95 {1000 * pct(l_ar, 95):7.1f}"
          f"   p50 ratio vs tsp {statistics.median(l_ar) / statistics.median(l_tsp):5.2f}x")
    print(f"one CLI call, {args.cli_submits} each (wall ms, child CPU ms; tsp: submit {1000 * s_tsp:.1f} ms, "
          f"list {1000 * l_tsp_list:.1f} ms wall):")
    for name, (wall, cpu) in cli.items():
        peer = s_tsp if name.startswith("submit") else l_tsp_list
        print(f"  {name:32s} wall {1000 * wall:7.1f}  cpu {1000 * cpu:7.1f}   wall ratio vs tsp {wall / peer:6.1f}x")

if __name__ == "__main__":
    main()
