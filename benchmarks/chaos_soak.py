"""A chaos soak: mixed work on three services while faults land at seeded random moments, then every invariant.

    python benchmarks/chaos_soak.py --minutes 30 [--seed S] [--mean-gap 12]

Two `autoresearch serve` on one PostgreSQL queue (the soak's own cluster, initdb'd on a free port: never a
shared server, since one fault restarts it) and one on SQLite (its home on a small tmpfs where the machine lets
the soak mount one, for the full-disk fault); an agent session on each queue (digits, TPE) and a program-mode
session (the fake LLM), each started again when it ends; a stream of checkpointing hand jobs at priorities that
preempt the trials and each other. The chaos loop (`benchmarks.chaos.faults`) meanwhile kills services, spawners,
the tracking worker, jobs' and sessions' processes (sessions are then resumed), restarts PostgreSQL, SIGSTOPs a
service for 30 s, fills the tmpfs for a minute and tears checkpoints. Then the queues drain, and the invariants
(`benchmarks.chaos.invariants`) are checked and printed with their counts. The seed is printed first: the same
seed draws the same faults at the same offsets (what they hit depends on the machine's timing). Exit status 1
when any invariant was violated.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import faults, invariants, workload  # noqa: E402
from benchmarks.chaos.cluster import Cluster  # noqa: E402


@dataclass
class World:
    """What the chaos loop may hit."""

    services: list
    sessions: list
    stores: dict
    cluster: Cluster
    full_disk_dir: Optional[Path]
    log: list = field(default_factory=list)


def mount_small(path: Path, size: str = "256m") -> bool:
    """A small tmpfs at `path` for the full-disk fault (needs root); False where the machine refuses."""
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of chaos (the drain comes after)")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--mean-gap", type=float, default=12.0, help="mean seconds between faults")
    parser.add_argument("--job-gap", type=float, default=5.0, help="mean seconds between hand jobs")
    parser.add_argument("--drain-minutes", type=float, default=6.0, help="most minutes to wait for the work")
    parser.add_argument("--trials", type=int, default=6, help="trials of each agent and program session")
    parser.add_argument("--kinds", default=",".join(faults.KINDS), help="fault kinds (comma-separated)")
    parser.add_argument("--keep", action="store_true", help="keep the soak's directory (logs, homes)")
    args = parser.parse_args()
    unknown = set(args.kinds.split(",")) - set(faults.KINDS)
    if args.minutes <= 0 or unknown:
        parser.error(f"unknown fault kinds: {', '.join(sorted(unknown))}" if unknown else "--minutes must be > 0")
    return args


def wait_services(stores: dict, want: int, procs: list, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        up = 0
        for store in stores.values():
            try:
                up += len(store.hosts.services(max_age=10))
            except Exception:
                pass
        if up >= want:
            return
        dead = [s.home.name for s in procs if not s.alive()]
        if dead:
            raise RuntimeError(f"service(s) {', '.join(dead)} exited at start (see their logs)")
        time.sleep(0.5)
    raise RuntimeError("the services did not come up")


def main() -> int:
    args = parse()
    # A SIGTERM (a test's timeout, Ctrl-C's cousin) unwinds through the cleanup below: no cluster, mount or
    # service left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"chaos soak: seed {seed}, {args.minutes:g} minutes, a fault every {args.mean_gap:g} s on average",
          flush=True)
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    tag = uuid.uuid4().hex
    logs, records = tmp / "logs", tmp / "records"
    logs.mkdir()
    records.mkdir()
    small = tmp / "small"
    mounted = mount_small(small)
    cluster = Cluster().create()
    t0 = time.time()

    def say(line: str) -> None:
        print(f"[{(time.time() - t0) / 60:5.1f} min] {line}", flush=True)

    from tests.agent.fake_llm import FakeLLM

    llm = FakeLLM(default=workload.ProgramLLM().answer).__enter__()
    pg_mlflow = f"sqlite:///{tmp / 'pg-mlflow.db'}"  # one tracking store for the hosts of one queue
    sqlite_home = (small if mounted else tmp / "sqlite") / "home"
    homes = [workload.Home("pg-a", tmp / "pg-a", "pg", cluster.url, pg_mlflow, tag),
             workload.Home("pg-b", tmp / "pg-b", "pg", cluster.url, pg_mlflow, tag),
             workload.Home("sqlite", sqlite_home, "sqlite", f"sqlite:///{sqlite_home / 'queue.db'}",
                           f"sqlite:///{sqlite_home / 'mlflow.db'}", tag)]
    for h in homes:
        h.path.mkdir(parents=True)
    from orchestrator.queue.store import JobStore

    stores = {"pg": JobStore(cluster.url), "sqlite": JobStore(homes[2].db_url)}
    services = [workload.ServiceProc(h, "cpu:2", logs) for h in homes]
    for svc in services:  # at the same moment: the fleet start
        svc.start()
    program = workload.write_program(tmp / "program")
    sessions: list = []
    counter = Counter()

    def new_session(kind: str, home) -> None:
        counter[kind, home.name] += 1
        if kind == "program":
            sess = workload.Session(f"program-{home.name}-{counter[kind, home.name]}", home,
                                    workload.program_argv(program, args.trials), logs,
                                    {"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": "soak"})
        else:
            sess = workload.Session(f"agent-{home.name}-{counter[kind, home.name]}", home,
                                    workload.agent_argv(args.trials), logs)
        sess.start()
        sessions.append(sess)

    world = World(services, sessions, stores, cluster, small if mounted else None)
    chaos = faults.Chaos(rng, world, tuple(args.kinds.split(",")), args.mean_gap, say)
    hand = workload.HandJobs(random.Random(seed + 1), {"pg": homes[0], "sqlite": homes[2]}, records, args.job_gap)
    watcher = invariants.Watcher(tag, {str(h.path): stores[h.queue] for h in homes})
    code = 1
    try:
        wait_services(stores, 3, services)
        say(f"3 services up; PostgreSQL on port {cluster.port}; full disk: "
            f"{'tmpfs ' + str(small) if mounted else 'unavailable (no mount here)'}")
        slots = [("agent", homes[0]), ("agent", homes[2]), ("program", homes[1])]
        for kind, home in slots:
            new_session(kind, home)
        end = time.time() + args.minutes * 60
        drain_end = end + args.drain_minutes * 60
        last_sample, draining = 0.0, False
        while True:
            now = time.time()
            chaos_on = now < end
            for svc in services:
                if svc.keep_up():
                    say(f"{svc.home.name}: service restarted (start {svc.starts})")
            for sess in list(sessions):
                sess.step(fault_held=world.full_disk_dir is not None and sess.home is homes[2]
                          and now < chaos.disk_held_until)
            if chaos_on:
                for kind, home in slots:  # a finished session is followed by a new one while the chaos lasts
                    latest = [s for s in sessions if s.home is home and s.label.startswith(kind)][-1]
                    if latest.verdict:
                        say(f"{latest.label}: verdict: {latest.verdict}")
                        new_session(kind, home)
                hand.step()
                chaos.step()
            if now - last_sample >= 10:
                last_sample = now
                for svc in services:
                    svc.sample()
                try:
                    watcher.sample()
                except Exception as exc:
                    say(f"watcher: {type(exc).__name__}: {exc}")
            if not chaos_on:
                if not draining:
                    draining = True
                    chaos.close()
                    say("chaos over: draining")
                if _drained(sessions, hand, stores) or now > drain_end:
                    break
            time.sleep(0.5)
        say("checking")
        checks = [invariants.none_lost(hand.jobs, stores)]
        _cancel_all(stores, say)
        for sess in sessions:
            sess.stop()
        for svc in services:
            svc.stop()
        checks += [invariants.never_twice(records), invariants.loads_complete(records),
                   invariants.tracked(stores, {"pg": pg_mlflow, "sqlite": homes[2].mlflow_uri},
                                      invariants.hand_steps(hand.jobs)),
                   invariants.verdicts(sessions), invariants.no_leftovers(tag, watcher),
                   invariants.flat_memory(services), invariants.legal_paths(stores)]
        report(args, seed, t0, end, chaos, hand, sessions, services, stores, checks)
        code = 0 if all(c.ok for c in checks) else 1
    finally:
        for sess in sessions:
            sess.stop()
        for svc in services:
            svc.stop()
        _kill_tagged(tag)
        llm.__exit__(None, None, None)
        cluster.destroy()
        if mounted:
            subprocess.run(["umount", "-l", str(small)], capture_output=True)
        if args.keep or code:
            print(f"the soak's directory: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return code


def _drained(sessions, hand, stores) -> bool:
    if any(not s.verdict and len(s.failures) <= workload.MAX_FAILURES for s in sessions):
        return False
    for sub in hand.jobs:
        try:
            job = stores[sub.queue].get(sub.id)
        except Exception:
            return False
        if not job.final:
            return False
    return True


def _cancel_all(stores, say) -> None:
    """Cancel what is left (sessions cut at the drain's end, jobs still waiting) and wait until nothing holds a
    device, so that every process the soak started should be gone once the services stop."""
    from orchestrator.queue.states import ACTIVE, HOLDING

    for queue, store in stores.items():
        for job in store.list(ACTIVE):
            try:
                store.cancel(job.id)
            except Exception as exc:
                say(f"cancel {queue} job {job.id}: {type(exc).__name__}: {exc}")
    deadline = time.time() + 120
    while time.time() < deadline and any(store.list(HOLDING) for store in stores.values()):
        time.sleep(1)


def _kill_tagged(tag: str) -> None:
    for pid in invariants.tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def report(args, seed, t0, end, chaos, hand, sessions, services, stores, checks) -> None:
    """The soak's table: minutes, faults by kind, jobs, sessions, then each invariant with its count."""
    from orchestrator.queue.states import JobState

    print(f"\n== chaos soak, seed {seed}: {args.minutes:g} minutes of chaos, {(time.time() - t0) / 60:.1f} minutes "
          "in all (drain and checks included)")
    print(f"faults: {sum(chaos.done.values())}")
    for kind in faults.KINDS:
        if kind in chaos.kinds:
            print(f"  {kind:<22} {chaos.done[kind]:>5}")
    states = Counter()
    for store in stores.values():
        for job in store.list():
            states[job.state] += 1
    hand_states = Counter(stores[s.queue].get(s.id).state for s in hand.jobs)
    print(f"jobs: {sum(states.values())} in all ({', '.join(f'{k} {v}' for k, v in sorted(states.items()))}); "
          f"hand jobs {len(hand.jobs)} ({', '.join(f'{k} {v}' for k, v in sorted(hand_states.items()))}), "
          f"{hand.errors} submit tries refused by a fault")
    print(f"services: {sum(s.starts for s in services)} starts ({len(services)} services)")
    print(f"sessions: {len(sessions)} ({sum(1 for s in sessions if s.verdict)} with a verdict), "
          f"{sum(s.killed for s in sessions)} killed, {sum(s.fault_exits for s in sessions)} ended by the full disk, "
          f"{sum(s.resumes for s in sessions)} resumes")
    print("invariants:")
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'} {c.name:<55} checked {c.checked:>5}  violations {len(c.violations)}")
        for v in c.violations[:10]:
            print(f"       {v}")
    _ = JobState


if __name__ == "__main__":
    sys.exit(main())
