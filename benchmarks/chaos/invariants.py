"""What must be true after the soak, each check returning how many things it looked at and what it found wrong.

The checks read what the product and the jobs left, never the soak's own idea of what happened: the queues'
jobs and event logs, the MLflow stores, the hand jobs' append-only records (`benchmarks.chaos.handjob`), the
services' memory samples and /proc.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.chaos.workload import TAG

HOLD_GRACE_S = 60.0  # how long a job's process may outlive its attempt before it counts (a SIGKILL after grace)


@dataclass
class Check:
    """One invariant: its name, how many things it checked, and the violations (one line each)."""

    name: str
    checked: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def tagged(tag: str) -> dict[int, dict[str, str]]:
    """Live processes whose environment carries the soak's tag, with their environment."""
    needle = f"{TAG}={tag}".encode()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if needle not in raw or stat[0] == "Z":
            continue
        env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
        out[int(entry)] = env
    return out


class Watcher:
    """Sampled during the soak: job processes alive while their job holds no device (outlived their attempt)."""

    def __init__(self, tag: str, stores_by_home: dict[str, object]):
        self.tag, self.stores = tag, stores_by_home
        self.seen: dict[int, float] = {}  # pid -> first time seen alive outside its attempt
        self.outlived: dict[int, str] = {}
        self.observed: set[int] = set()  # every job process sampled (what the check looked at)

    def sample(self) -> None:
        from orchestrator.queue.states import HOLDING, JobState

        now = time.time()
        current = set()
        for pid, env in tagged(self.tag).items():
            job_id, home = env.get("AUTORESEARCH_JOB_ID"), env.get("AUTORESEARCH_HOME")
            store = self.stores.get(home)
            if not job_id or store is None:
                continue
            self.observed.add(pid)
            try:
                job = store.get(int(job_id))
            except Exception:
                continue  # PostgreSQL restarting
            if JobState(job.state) in HOLDING:
                continue
            current.add(pid)
            first = self.seen.setdefault(pid, now)
            if now - first >= HOLD_GRACE_S and pid not in self.outlived:
                self.outlived[pid] = f"pid {pid} of job {job_id} ({home}) alive {now - first:.0f} s while {job.state}"
        self.seen = {p: t for p, t in self.seen.items() if p in current}


def none_lost(submitted, stores) -> Check:
    """Every submitted job is in its queue, final or still waiting (queued, or failed with a retry due), or
    holding a device with its process alive."""
    import psutil

    from orchestrator.queue.states import HOLDING, JobState

    check = Check("every submitted job final or still queued")
    for sub in submitted:
        check.checked += 1
        try:
            job = stores[sub.queue].get(sub.id)
        except Exception as exc:
            check.violations.append(f"{sub.queue} job {sub.id}: {type(exc).__name__}: {exc}")
            continue
        if job.final or job.state == JobState.QUEUED.value or job.retrying:
            continue
        if JobState(job.state) in HOLDING and job.pid and psutil.pid_exists(job.pid):
            continue
        check.violations.append(f"{sub.queue} job {sub.id}: {job.state} with no live process (pid {job.pid})")
    return check


def _records(records: Path) -> dict[str, list[dict]]:
    out = {}
    for path in sorted(records.glob("*.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a kill -9 mid-write
        out[path.stem] = rows
    return out


def never_twice(records: Path) -> Check:
    """No two attempts of one job alive at once: each attempt's span (its first to its last record) is disjoint
    from every other attempt's of the same job."""
    check = Check("no job ran twice at the same time")
    for job, rows in _records(records).items():
        check.checked += 1
        spans: dict[tuple, list[float]] = {}
        for r in rows:
            span = spans.setdefault((r["attempt"], r["pid"]), [r["t"], r["t"]])
            span[0], span[1] = min(span[0], r["t"]), max(span[1], r["t"])
        ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
        for (a, b) in zip(ordered, ordered[1:]):
            if b[1][0] < a[1][1]:
                check.violations.append(f"{job}: attempt {a[0][0]} (pid {a[0][1]}) and attempt {b[0][0]} "
                                        f"(pid {b[0][1]}) overlap by {a[1][1] - b[1][0]:.2f} s")
    return check


def loads_complete(records: Path) -> Check:
    """Every checkpoint a hand job loaded held that step's own values, and was one an attempt had saved."""
    check = Check("every checkpoint a job loaded was complete")
    for job, rows in _records(records).items():
        saving: set[int] = set()
        for r in sorted(rows, key=lambda r: r["t"]):
            if r["ev"] == "saving":
                saving.add(r["step"])
            elif r["ev"] == "load":
                check.checked += 1
                if not r["ok"]:
                    check.violations.append(f"{job}: attempt {r['attempt']} loaded step {r['step']} with other "
                                            "values (torn or foreign)")
                elif r["step"] not in saving:
                    check.violations.append(f"{job}: attempt {r['attempt']} loaded step {r['step']}, never saved")
    return check


def tracked(stores, mlflow_uris: dict[str, str], hand: dict[tuple[str, int], int]) -> Check:
    """Every SUCCEEDED job with an MLflow run has the run in its home's store; a hand job's run has its `score`
    (its last step)."""
    from mlflow import MlflowClient

    from orchestrator.queue.states import JobState

    check = Check("every SUCCEEDED job has its MLflow run with its metric")
    for queue, store in stores.items():
        try:
            client = MlflowClient(tracking_uri=mlflow_uris[queue])
        except Exception as exc:  # a store left unopenable is a violation to report, not a crash of the soak
            why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            check.violations.append(f"{queue}: its MLflow store cannot be opened: {why}")
            continue
        for job in store.list([JobState.SUCCEEDED]):
            if not job.track:
                continue
            check.checked += 1
            if not job.mlflow_run_id:
                check.violations.append(f"{queue} job {job.id} ({job.name}): SUCCEEDED without an MLflow run id")
                continue
            try:
                run = client.get_run(job.mlflow_run_id)
            except Exception as exc:
                check.violations.append(f"{queue} job {job.id}: run {job.mlflow_run_id} missing: "
                                        f"{str(exc).splitlines()[0][:120]}")
                continue
            steps = hand.get((queue, job.id))
            if steps is not None and run.data.metrics.get("score") != float(steps):
                check.violations.append(f"{queue} job {job.id}: score {run.data.metrics.get('score')}, not {steps}")
    return check


def legal_paths(stores) -> Check:
    """Every job's event log is a path of Contract 2: it starts QUEUED, each event leaves the state the previous
    one entered, each step is an allowed transition, and nothing follows a final state but a retry."""
    from orchestrator.queue.states import JobState, allowed

    check = Check("every job's event log a legal path of the job states")
    for queue, store in stores.items():
        for job in store.list():
            check.checked += 1
            events = store.events(job.id)
            path = " ".join(f"{e.src or '-'}>{e.dst}" for e in events)
            prev = None
            for ev in events:
                src = JobState(ev.src) if ev.src else None
                dst = JobState(ev.dst)
                if prev is None:
                    ok = src is None and dst == JobState.QUEUED
                else:  # FAILED -> FAILED: a retrying job cancelled (its retries stopped, no change of state)
                    ok = src == prev and (allowed(src, dst) or src == dst == JobState.FAILED)
                if not ok:
                    check.violations.append(f"{queue} job {job.id}: {ev.src} -> {ev.dst} after {prev} ({ev.reason}); "
                                            f"path {path}")
                    break
                prev = dst
            else:
                if prev is not None and prev.value != job.state:
                    check.violations.append(f"{queue} job {job.id}: log ends {prev}, job is {job.state}; path {path}")
    return check


def verdicts(sessions) -> Check:
    """Every session ended with a verdict (its last run exited 0 with its summary), however often it was killed
    and resumed."""
    check = Check("every session reached a verdict after resume")
    for sess in sessions:
        check.checked += 1
        if not sess.verdict:
            check.violations.append(f"{sess.label} ({sess.session_id}): no verdict after {sess.resumes} resumes; "
                                    + "; ".join(sess.failures[-3:]))
    return check


def no_leftovers(tag: str, watcher: Watcher) -> Check:
    """No process outlived its job or service: none of the soak's processes alive once every service and session
    stopped, and no job's process alive a minute after its attempt ended (sampled during the soak; the count is
    the job processes those samples saw)."""
    check = Check("no process outlived its job or service")
    deadline = time.time() + 30  # a service's helpers exit as it stops: give them that moment
    while (left := tagged(tag)) and time.time() < deadline:
        time.sleep(0.5)
    check.checked = len(watcher.observed)
    check.violations += list(watcher.outlived.values())
    for pid, env in left.items():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        check.violations.append(f"pid {pid} alive after the end: {cmd}")
    return check


def flat_memory(services, min_samples: int = 6, ratio: float = 1.5, slack_mb: float = 50.0) -> Check:
    """Each service incarnation that lived long enough: its RSS at the end (median of its last 3 samples) within
    `ratio` times its RSS after warm-up (median of its 3rd to 5th) plus `slack_mb`."""
    import statistics

    check = Check("services' memory flat")
    for svc in services:
        for pid, samples in svc.rss.items():
            if len(samples) < min_samples:
                continue
            check.checked += 1
            base, end = statistics.median(samples[2:5]), statistics.median(samples[-3:])
            if end > base * ratio + slack_mb:
                check.violations.append(f"{svc.home.name} pid {pid}: {base:.0f} MB after warm-up, {end:.0f} MB at "
                                        f"the end ({len(samples)} samples)")
    return check


def hand_steps(submitted) -> dict[tuple[str, int], int]:
    return {(s.queue, s.id): s.steps for s in submitted}
