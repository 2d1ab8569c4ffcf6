"""How much a thread of the service gets done while jobs are spawned: `os.posix_spawn` against `subprocess.Popen`.

    python benchmarks/spawn_gil.py [--spawns 300] [--rounds 2]

One thread spins (counts) while the main thread spawns `sh -c true` jobs as the local executor does (own
session, output to a file, stdin from /dev/null). CPython's `os.posix_spawn` keeps the GIL until the child has
exec'd; `_posixsubprocess` (behind `subprocess.Popen`) releases it around vfork and exec. Prints the spinner's
rate with each, alternating, and the ratio Popen / posix_spawn (higher: the service's other threads keep going).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SWITCH_INTERVAL = 0.0005  # as `autoresearch serve` sets it (orchestrator.service.daemon)


def spin(stop: threading.Event, out: list) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


def spawn(kind: str, log: str) -> int:
    argv = ["/bin/sh", "-c", '"$@"', "job", "true"]
    if kind == "posix_spawn":
        return os.posix_spawn(argv[0], argv, os.environ, setsid=True,
                              file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                            (os.POSIX_SPAWN_OPEN, 1, log, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                             0o644),
                                            (os.POSIX_SPAWN_DUP2, 1, 2)])
    with open(log, "ab", buffering=0) as out:
        proc = subprocess.Popen(argv, env=os.environ, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    proc.returncode = 0  # reaped below with waitpid, as the executor's watcher does
    return proc.pid


def run(kind: str, spawns: int, log: str) -> tuple[float, float]:
    """(spinner iterations per second, spawn wall ms) while `spawns` jobs are started."""
    stop, out = threading.Event(), []
    spinner = threading.Thread(target=spin, args=(stop, out))
    spinner.start()
    start = time.perf_counter()
    pids = [spawn(kind, log) for _ in range(spawns)]
    elapsed = time.perf_counter() - start
    stop.set()
    spinner.join()
    for pid in pids:
        os.waitpid(pid, 0)
    return out[0] / elapsed, elapsed / spawns * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spawns", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sys.setswitchinterval(SWITCH_INTERVAL)
    log = os.path.join(tempfile.mkdtemp(prefix="bench-spawn-"), "job.log")
    rates: dict[str, list[float]] = {"posix_spawn": [], "Popen": []}
    for _ in range(args.rounds):
        for kind in rates:
            rate, ms = run(kind, args.spawns, log)
            rates[kind].append(rate)
            print(f"  {kind:12s} spinner {rate / 1e6:6.2f} M/s   spawn {ms:5.2f} ms wall")
    ratios = [p / s for p, s in zip(rates["Popen"], rates["posix_spawn"])]
    print(f"spinner while spawning, Popen / posix_spawn: {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}-{max(ratios):.2f}] over {args.rounds} rounds")


if __name__ == "__main__":
    main()
