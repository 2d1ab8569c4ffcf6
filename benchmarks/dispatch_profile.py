"""Where a dispatch pass's time goes: an in-process service on cpu:8 runs N untracked no-op jobs submitted from
another process (the throughput benchmark's submitter), and each phase of the dispatcher thread is timed.

    python benchmarks/dispatch_profile.py [--jobs 2000] [--track]

The processes a service starts on first use (its spawners; with --track its tracking worker) are started by an
untimed warm-up, as in the throughput benchmark. With --track each job gets its MLflow run, made by the
tracking worker, whose CPU is then printed apart from the rest outside the service.

Prints jobs/s, passes and jobs per pass, the service's CPU per job (and per thread), the CPU per job outside
the service (the submitter, the spawner processes and the jobs themselves), the whole machine's busy CPU per
job (and the jobs/s this machine's cores would allow at that cost), and per phase (the pass, its
records, its plan and claim, its starts, the reads) the dispatcher's milliseconds per job and its share of the
wall time. A profile, not a comparison: it shows whether the dispatcher thread is the bottleneck (its
passes take nearly all of the wall time) and which part of a pass to work on.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(counters: tuple[collections.Counter, collections.Counter], thread: list, obj, name: str) -> None:
    """Wrap `obj.name` so its calls from the dispatcher thread are timed under `name`."""
    seconds, calls = counters
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        if threading.get_ident() != thread[0]:
            return inner(*args, **kwargs)
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
            calls[name] += 1

    setattr(obj, name, wrapper)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each of this process's threads, by thread name (a pool's threads summed)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: collections.Counter = collections.Counter()
    for task in Path("/proc/self/task").iterdir():
        name = names.get(int(task.name), "other")
        name = re.sub(r"_\d+$", " (all)", name)  # a pool's threads together
        out[name] += stat_cpu(task / "stat")
    return out


def stat_cpu(stat: Path) -> float:
    """CPU seconds (user + system) in a /proc `stat` file (a process's or a thread's); 0 when it is gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def box_busy() -> float:
    """CPU seconds every core of the machine spent busy so far (/proc/stat: all but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid) -> float:
    """CPU seconds (user + system) of a process so far; 0 when there is none."""
    return stat_cpu(Path(f"/proc/{pid}/stat")) if pid is not None else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--track", action="store_true", help="one MLflow run per job")
    args = parser.parse_args()
    jobs, track = args.jobs, args.track
    home = Path(tempfile.mkdtemp(prefix="dispatch-profile-"))
    os.environ.update(AUTORESEARCH_HOME=str(home), MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}")
    os.environ.pop("AUTORESEARCH_DB_URL", None)
    from benchmarks.queue_throughput import SUBMITTER, warm_up
    from orchestrator.core.config import Settings
    from orchestrator.queue.states import JobState
    from orchestrator.service.daemon import Service

    service = Service(Settings.load(), devices="cpu:8", preempt_after=0).start()
    while not all(d.checked_at for d in service.store.hosts.devices()):  # the start-up device check
        time.sleep(0.05)
    # As the throughput benchmark: the processes started on first use (the spawners, the tracking worker with
    # its MLflow import) are started before the timing.
    before_jobs = warm_up(service.store, 8, track)
    time.sleep(0.5)
    counters = (collections.Counter(), collections.Counter())
    thread = [None]
    one_pass = service.dispatch_once

    def dispatch_once() -> None:
        thread[0] = threading.get_ident()
        one_pass()

    service.dispatch_once = dispatch_once
    timed(counters, thread, service, "dispatch_once")
    for obj, name in ((service, "_record"), (service, "_plan_and_claim"), (service, "_start_claimed"),
                      (service.store, "available_devices"),
                      (service.store, "snapshot"), (service.store, "claim"), (service.store, "mark_running_many"),
                      (service.store, "finish_many"), (service.executor, "launch_many")):
        timed(counters, thread, obj, name)
    submitter = subprocess.Popen([sys.executable, "-c", SUBMITTER, str(jobs), "1" if track else "0"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert submitter.stdout.readline().strip() == "ready"
    passes, start, cpu, threads = service.passes, time.perf_counter(), time.process_time(), thread_cpu()
    before, busy_before = os.times(), box_busy()
    worker_before = cpu_seconds(service.runs.preparer.worker.pid) if track else 0.0
    submitter.stdin.write("go\n")
    submitter.stdin.flush()
    last = int(submitter.stdout.readline())  # as the throughput benchmark: no look at the queue before the end
    while not (service.store.get(last).job_state is JobState.SUCCEEDED
               and service.store.count_in(JobState.SUCCEEDED) >= jobs + before_jobs):
        time.sleep(0.02)  # (this process is the service's: its looks take the service's GIL)
    busy = box_busy() - busy_before
    worker = service.runs.preparer.worker.pid if track else None
    worker_total = cpu_seconds(worker)  # its whole life, MLflow's import included, is in the children's CPU
    worker_cpu = worker_total - worker_before
    wall, cpu, passes = time.perf_counter() - start, time.process_time() - cpu, service.passes - passes
    threads = {name: seconds - threads.get(name, 0.0) for name, seconds in thread_cpu().items()}
    submitter.wait(timeout=60)
    service.stop()
    after = os.times()  # (the spawners were waited for by the stop: their CPU, and their jobs', is in)
    children = after.children_user + after.children_system - before.children_user - before.children_system
    print(f"{jobs / wall:.0f} jobs/s; {passes} passes, {jobs / passes:.2f} jobs a pass; the service's CPU "
          f"{cpu * 1e3 / jobs:.2f} ms a job (this process: the service and this script's polling)")
    print("  the CPU by thread: " + ", ".join(f"{name} {seconds * 1e3 / jobs:.2f} ms"
                                              for name, seconds in sorted(threads.items(), key=lambda kv: -kv[1])
                                              if seconds * 1e3 / jobs >= 0.005))
    print(f"  outside the service: {(children - worker_total) * 1e3 / jobs:.2f} ms of CPU a job (the submitter, the "
          "spawner processes and the jobs they reaped)")
    cores = os.cpu_count() or 1
    print(f"  the whole box: {busy * 1e3 / jobs:.2f} ms of CPU a job, every process (the check on the sums above, "
          f"which count a child's whole life when it is reaped in the run); {cores} cores allow "
          f"{cores * jobs / busy:.0f} jobs/s at most")
    if track:
        print(f"  the tracking worker: {worker_cpu * 1e3 / jobs:.2f} ms of CPU a job (making and ending the runs)")
    seconds, calls = counters
    for name, total in seconds.most_common():
        print(f"  {name:18s} {total * 1e3 / jobs:6.3f} ms a job  {total / wall * 100:5.1f}% of the wall time  "
              f"{total / calls[name] * 1e3:6.2f} ms a call ({calls[name]} calls)")


if __name__ == "__main__":
    main()
