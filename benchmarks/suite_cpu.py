"""Where a command's CPU goes, by Python process: run it with a `sitecustomize` that records, as each Python process
ends, its command line, its own CPU seconds (user + system, from getrusage) and the test that was running
(`PYTEST_CURRENT_TEST`, which pytest sets and every process a test starts inherits); then print the CPU by kind of
process and by test file.

    python benchmarks/suite_cpu.py -- python -m pytest -q -n 2 --dist loadgroup
    python benchmarks/suite_cpu.py --log /tmp/cpu.jsonl --report-only    # the table of an earlier run again
    python benchmarks/suite_cpu.py    # a small sample: the warm pool's and the tracking worker's tests

What it cannot see: a process killed by a signal (its exit handlers never run: killed jobs, services and pools
stopped with SIGKILL), and programs that are not Python (PostgreSQL, Slurm's daemons). Compare the total with the
machine's busy time (`vmstat`) to know how much that is. A warm-forked job counts its own CPU only (`forked`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HOOK = '''import atexit, json, os, sys
_PID = os.getpid()


def _record():
    try:
        import resource
        use = resource.getrusage(resource.RUSAGE_SELF)
        line = json.dumps({"argv": [str(a) for a in (getattr(sys, "orig_argv", None) or sys.argv)[:6]],
                           "module_argv": [str(a) for a in sys.argv[:2]], "forked": os.getpid() != _PID,
                           "cpu": use.ru_utime + use.ru_stime, "test": os.environ.get("PYTEST_CURRENT_TEST", "")})
        fd = os.open(os.environ["SUITE_CPU_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        os.write(fd, (line + "\\n").encode())
        os.close(fd)
    except Exception:
        pass


if os.environ.get("SUITE_CPU_LOG"):
    atexit.register(_record)
'''


def kind(rec: dict) -> str:
    """A process's kind: the pytest worker, `-m MODULE`, `-c`, or the script's file name (`forked:` when a warm
    pool forked it)."""
    argv = rec.get("argv") or []
    if not argv:
        return "?"
    if rec.get("forked"):
        return "forked: " + os.path.basename((rec.get("module_argv") or ["?"])[0])
    if any("exec(eval(sys.stdin" in a or a.endswith("pytest") for a in argv) or argv[1:3] == ["-m", "pytest"]:
        return "pytest (its own process)"
    if "-m" in argv[1:]:
        at = argv.index("-m")
        return "-m " + (argv[at + 1] if at + 1 < len(argv) else "?")
    if "-c" in argv[1:]:
        return "-c (inline code)"
    return os.path.basename(argv[1]) if len(argv) > 1 else os.path.basename(argv[0])


def report(log: Path, top: int) -> None:
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    by_file: dict[str, float] = collections.defaultdict(float)
    for rec in records:
        k = kind(rec)
        by_kind[k][0] += 1
        by_kind[k][1] += rec["cpu"]
        if not k.startswith("pytest"):
            by_file[rec.get("test", "").split("::")[0] or "(no test)"] += rec["cpu"]
    total = sum(cpu for _, cpu in by_kind.values())
    print(f"{len(records)} Python processes ended, {total:.0f} CPU-s in all")
    print(f"\n{'CPU-s':>8} {'procs':>6} {'each':>6}  kind")
    for name, (n, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{cpu:8.1f} {n:6d} {cpu / n:6.2f}  {name[:58]}")
    print(f"\n{'CPU-s':>8}  processes a test started, by test file")
    for name, cpu in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{cpu:8.1f}  {name[:70]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, help="the records (default: a new file in a temporary folder)")
    parser.add_argument("--report-only", action="store_true", help="print the table of --log; run nothing")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.report_only:
        if args.log is None or not args.log.exists():
            parser.error("--report-only needs the --log of an earlier run")
        report(args.log, args.top)
        return 0
    command = command or [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/orchestrator/test_warm_preload.py", "tests/orchestrator/test_tracking_worker.py"]
    hook_dir = Path(tempfile.mkdtemp(prefix="suite-cpu-"))
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    log = args.log or hook_dir / "cpu.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "SUITE_CPU_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p)}
    code = subprocess.call(command, env=env)
    if log.exists():
        report(log, args.top)
        print(f"\nrecords: {log}")
    return code


if __name__ == "__main__":
    sys.exit(main())
