"""Projects sharing 8 devices for a simulated week, driven by the real `orchestrator.queue.policy.plan`.

Three projects with shares 2:1:1 (quotas 2, 1, 1) submit more than the box can run; project c's work is mostly
an agent session's short trials; scavengers wait for idle devices all week; project b goes quiet for a few
hours on day 3 (it withdraws its waiting jobs) and then comes back (its reclaim latency is measured). A pass runs every PASS seconds of
simulated time; a preempted job releases after GRACE and resumes where it stopped (a checkpoint); the decayed
usage fair sharing weighs is kept per project with the default 24 h half-life.

Printed: the achieved shares (device-time of non-scavenger jobs) against 50/25/25, utilisation with EASY
backfill and without it (same workload, same seed), the owner's reclaim latency, and the cost of one `plan`
call at 10,000 waiting jobs against the policy as it was before projects (tests/orchestrator/legacy_plan.py),
as a ratio.

    python benchmarks/fair_share.py [--days 7] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.queue.policy import Project, Running, Waiting, plan  # noqa: E402
from tests.orchestrator import legacy_plan  # noqa: E402

DEVICES = tuple(f"cuda:{i}" for i in range(8))
PASS = 30.0  # seconds of simulated time between dispatch passes
GRACE = 20.0  # seconds a preempted job takes to checkpoint and release
PREEMPT_AFTER = 60.0
HALF_LIFE = 86400.0
SHARES = {"a": 2.0, "b": 1.0, "c": 1.0}
QUOTAS = {"a": 2, "b": 1, "c": 1}
BACKLOG = 12  # each project keeps this many jobs waiting: more than the box can run
QUIET = (2.5 * 86400, 2.5 * 86400 + 6 * 3600)  # project b submits nothing then


@dataclass
class Job:
    id: int
    project: str
    gpus: int
    work: float  # seconds of work left
    limit: float  # its time limit per attempt
    submitted: float
    priority: int = 10
    scavenger: bool = False
    started: float = 0.0
    devices: tuple = ()
    release_at: float = -1.0  # being preempted: devices free at this time


def make_job(rng: random.Random, job_id: int, project: str, now: float) -> Job:
    if project == "c" and rng.random() < 0.7:  # the agent session's trials: short, one device, priority 0
        work = rng.uniform(300, 1200)
        return Job(job_id, project, 1, work, work * 1.5, now, priority=0)
    gpus = rng.choices([1, 2, 4], weights=[55, 25, 20])[0]
    work = rng.uniform(1800, 4 * 3600)
    return Job(job_id, project, gpus, work, work * rng.uniform(1.1, 1.6), now)


def simulate(days: float, seed: int, backfill: bool) -> dict:
    rng = random.Random(seed)
    now, end, next_id = 0.0, days * 86400, 1
    waiting: dict[int, Job] = {}
    running: dict[int, Job] = {}
    usage = {p: 0.0 for p in SHARES}
    used = {p: 0.0 for p in SHARES}
    used["scavenger"] = 0.0
    latencies: list[float] = []
    quiet_returned = None
    probe = -1
    plan_seconds, passes = 0.0, 0

    def account(job: Job, until: float) -> None:
        used["scavenger" if job.scavenger else job.project] += job.gpus * (until - job.started)

    while now < end:
        # Ends since the last pass: finished work, and preempted jobs releasing (back in line, work kept).
        for job in list(running.values()):
            if job.release_at >= 0 and job.release_at <= now:
                account(job, job.release_at)
                job.work -= job.release_at - job.started
                job.release_at, job.devices = -1.0, ()
                del running[job.id]
                waiting[job.id] = job
            elif job.release_at < 0 and job.started + min(job.work, job.limit) <= now:
                account(job, job.started + min(job.work, job.limit))
                del running[job.id]
        for project in SHARES:
            if project == "b" and QUIET[0] <= now < QUIET[1]:
                for job in [j for j in waiting.values() if j.project == "b" and not j.scavenger]:
                    del waiting[job.id]  # b withdraws its waiting work: its quota is lent to the others
                continue
            if project == "b" and now >= QUIET[1] and quiet_returned is None:
                # The owner comes back with a one-device job within its quota of 1, the first in its line:
                # borrowers of b's quota are reclaimed for it.
                quiet_returned = now
                waiting[next_id] = Job(next_id, "b", 1, 1800.0, 2700.0, now)
                probe = next_id
                next_id += 1
            while sum(1 for j in waiting.values() if j.project == project and not j.scavenger) < BACKLOG:
                waiting[next_id] = make_job(rng, next_id, project, now)
                next_id += 1
        while sum(1 for j in waiting.values() if j.scavenger) < 6:
            waiting[next_id] = Job(next_id, "a", 1, 7200.0, 1e9, now, priority=0, scavenger=True)
            next_id += 1
        held = {p: 0 for p in SHARES}
        for job in running.values():
            if not job.scavenger:
                held[job.project] += job.gpus
        for p in SHARES:  # decayed device-seconds, advanced one pass
            usage[p] = usage[p] * 0.5 ** (PASS / HALF_LIFE) + held[p] * PASS
        projects = tuple(Project(p, SHARES[p], QUOTAS[p], usage=usage[p]) for p in SHARES)
        w = [Waiting(j.id, j.priority, j.submitted, j.gpus, j.project, j.scavenger, None,
                     None if j.scavenger else j.limit) for j in waiting.values()]
        r = [Running(j.id, j.priority, j.devices, j.started, True, j.release_at >= 0, j.project, j.scavenger,
                     None if j.scavenger else j.started + j.limit) for j in running.values()]
        t0 = time.perf_counter()
        p = plan(w, r, DEVICES, now, PREEMPT_AFTER, projects, backfill=backfill)
        plan_seconds += time.perf_counter() - t0
        passes += 1
        for victim in p.preempt:
            running[victim].release_at = now + GRACE
        for job_id, devs in p.starts:
            job = waiting.pop(job_id)
            job.started, job.devices = now, devs
            running[job_id] = job
            if quiet_returned is not None and job_id == probe:
                latencies.append(now - job.submitted)
        now += PASS
    for job in running.values():
        account(job, min(now, job.started + min(job.work, job.limit)))
    charged = sum(used[p] for p in SHARES)
    return {"shares": {p: used[p] / charged for p in SHARES}, "utilisation": charged / (len(DEVICES) * now),
            "with_scavengers": (charged + used["scavenger"]) / (len(DEVICES) * now),
            "reclaim_latency": latencies[0] if latencies else None, "plan_ms": 1000 * plan_seconds / passes}


def plan_cost(n: int, repeats: int) -> tuple[float, float, float]:
    """Seconds per plan() at n waiting jobs: the old policy, the new one with one project, with three."""
    rng = random.Random(1)
    jobs = [(i, rng.randint(0, 20), float(i), rng.choice([1, 1, 2, 4])) for i in range(n)]
    running = [(1_000_000 + k, 5, (d,), 0.0) for k, d in enumerate(DEVICES[:6])]
    old_w = [legacy_plan.Waiting(*j) for j in jobs]
    old_r = [legacy_plan.Running(i, pr, d, s, True) for i, pr, d, s in running]
    one_w = [Waiting(*j) for j in jobs]
    new_r = [Running(i, pr, d, s, True) for i, pr, d, s in running]
    three_w = [Waiting(*j, project="abc"[j[0] % 3], time_limit=3600.0) for j in jobs]
    three_r = [Running(i, pr, d, s, True, project="abc"[i % 3], ends_at=7200.0) for i, pr, d, s in running]
    projects = tuple(Project(p, SHARES[p], QUOTAS[p]) for p in SHARES)

    calls = (lambda: legacy_plan.plan(old_w, old_r, DEVICES, 100.0, 60.0),
             lambda: plan(one_w, new_r, DEVICES, 100.0, 60.0),
             lambda: plan(three_w, three_r, DEVICES, 100.0, 60.0, projects))
    best = [float("inf")] * len(calls)
    for _ in range(repeats):  # interleaved, best of each: a busy machine slows all three alike
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1], best[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--waiting", type=int, default=10_000)
    args = parser.parse_args()
    with_bf = simulate(args.days, args.seed, backfill=True)
    without = simulate(args.days, args.seed, backfill=False)
    print(f"simulated {args.days:g} days on {len(DEVICES)} devices, a pass every {PASS:g} s (seed {args.seed})")
    for name, res in (("with backfill", with_bf), ("without backfill", without)):
        shares = " ".join(f"{p} {100 * s:.1f}%" for p, s in res["shares"].items())
        print(f"  {name:17s} shares {shares} (target a 50 b 25 c 25); utilisation {100 * res['utilisation']:.1f}% "
              f"(with scavengers {100 * res['with_scavengers']:.1f}%); plan {res['plan_ms']:.3f} ms/pass")
    print(f"  backfill adds {100 * (with_bf['utilisation'] - without['utilisation']):.1f} points of utilisation")
    worst = max(abs(with_bf["shares"][p] - t) for p, t in (("a", .5), ("b", .25), ("c", .25)))
    print(f"  largest share error {100 * worst:.1f} points")
    lat = with_bf["reclaim_latency"]
    print(f"  reclaim: project b's one-device job after its quiet hours started {lat:.0f} s after submit "
          f"(bound preempt_after {PREEMPT_AFTER:g} + grace {GRACE:g} + one pass {PASS:g} = "
          f"{PREEMPT_AFTER + GRACE + PASS:g} s)" if lat is not None else "  reclaim: not measured")
    old, one, three = plan_cost(args.waiting, 15)
    print(f"plan() at {args.waiting:,} waiting jobs: before projects {1000 * old:.2f} ms; one default project "
          f"{1000 * one:.2f} ms ({one / old:.2f}x); three projects with time limits {1000 * three:.2f} ms "
          f"({three / old:.2f}x)")


if __name__ == "__main__":
    main()
