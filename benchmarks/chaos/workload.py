"""The soak's work: homes and their queues, the services (restarted when they die), a stream of hand jobs, and
agent and program sessions (resumed when their process dies).

Everything runs as users run it: `autoresearch serve`, `autoresearch start`/`resume` in processes of their own,
hand jobs through the library's submit. Every process the soak starts carries `TAG` in its environment (and its
children inherit it), so that at the end the invariants can find any process that outlived its job or service.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
TAG = "AUTORESEARCH_CHAOS_SOAK"
RESUME_AFTER_S = 5.0  # a session that failed (not one the chaos killed) is resumed after this long
MAX_FAILURES = 30  # failed runs before a session counts as one that never reaches a verdict
PRIORITIES = (0, 5, 10, 20)  # hand jobs: at 10 and 20 they preempt the sessions' trials (priority 0) and each other


@dataclass
class Home:
    """One AUTORESEARCH_HOME: its queue (`pg` or `sqlite`), the URLs its processes use, a node name."""

    name: str
    path: Path
    queue: str
    db_url: str
    mlflow_uri: str
    tag: str

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTORESEARCH_", "OPENAI_"))}
        env.update(AUTORESEARCH_HOME=str(self.path), AUTORESEARCH_DB_URL=self.db_url, AUTORESEARCH_NODE=self.name,
                   MLFLOW_TRACKING_URI=self.mlflow_uri, AUTORESEARCH_PREFLIGHT="off", PYTHONPATH=str(ROOT),
                   # The SQLite home lies on a 256 MB tmpfs (the full-disk fault): jobs start below the default
                   # 1 GiB free, and stop starting only when the fault fills it.
                   AUTORESEARCH_DISK_MIN_FREE_MB="32",
                   **{TAG: self.tag}, **extra)
        return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.faces.cli", *args]


@dataclass
class ServiceProc:
    """`autoresearch serve` for one home, restarted by `keep_up` whenever it is gone (a kill -9)."""

    home: Home
    devices: str
    logs: Path
    proc: Optional[subprocess.Popen] = None
    starts: int = 0
    stopped_until: float = 0.0  # SIGSTOPped until then (the chaos loop's SIGCONT timer)
    rss: dict[int, list[float]] = field(default_factory=dict)  # pid -> RSS samples in MB, per incarnation

    def start(self) -> None:
        self.starts += 1
        log = open(self.logs / f"serve-{self.home.name}-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(cli("serve", "--devices", self.devices, "--preempt-after", "3"),
                                     env=self.home.env(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=ROOT)
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def keep_up(self) -> bool:
        """Start it again if it died; True when it did."""
        if self.alive():
            return False
        self.start()
        return True

    def sample(self) -> None:
        """One RSS sample of the service process itself (its jobs and helpers are not the service's memory)."""
        import psutil

        if not self.alive():
            return
        try:
            self.rss.setdefault(self.proc.pid, []).append(psutil.Process(self.proc.pid).memory_info().rss / 1e6)
        except psutil.Error:
            pass

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Session:
    """An agent or program session: started once, resumed after its process dies, until it ends with a verdict
    (its process exits 0 having printed its summary)."""

    label: str
    home: Home
    argv: list[str]
    logs: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    proc: Optional[subprocess.Popen] = None
    session_id: Optional[str] = None
    runs: int = 0
    resumes: int = 0
    failures: list[str] = field(default_factory=list)  # exits other than 0 and a chaos kill
    killed: int = 0
    fault_exits: int = 0  # runs that ended while a fault held the session's home (the disk full)
    verdict: Optional[str] = None
    _retry_at: float = 0.0
    _failed_run: int = 0

    def _launch(self, argv: list[str]) -> None:
        self.runs += 1
        self._log = self.logs / f"session-{self.label}-{self.runs}.log"
        self.proc = subprocess.Popen(cli(*argv), env=self.home.env(**self.env_extra), stdout=open(self._log, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)

    def start(self) -> None:
        self._launch(self.argv)

    def _learn_id(self) -> None:
        if self.session_id is None and self.runs:
            m = re.search(r"^session (\S+) on ", self._log.read_text(errors="replace"), re.M)
            if m:
                self.session_id = m.group(1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def step(self, fault_held: bool = False) -> None:
        """Resume it if its process died before a verdict. `fault_held`: a fault that its process cannot outlive
        holds its home now (the disk full): an exit then is the fault's, not a failure, and the resume waits."""
        self._learn_id()
        if self.verdict or self.alive() or self.proc is None:
            return
        code = self.proc.returncode
        if code == 0:
            self.verdict = self._log.read_text(errors="replace").strip().splitlines()[-1][:200]
            return
        if code != -9 and self._failed_run != self.runs:
            self._failed_run = self.runs
            last = (self._log.read_text(errors="replace").strip().splitlines() or [""])[-1][:200]
            if code == 2 and "already finished" in last:
                # Killed after it had finished (its summary printed, its process still closing down): `resume`
                # says so, and the registry holds its verdict. That is a verdict, not a failure to resume.
                self.verdict = last[:200]
                return
            if code == 2 and "no session" in last:
                # Killed after it printed its id and before it registered itself: there is nothing to resume,
                # so it starts afresh (what its user would do).
                self.session_id, self.fault_exits = None, self.fault_exits + 1
                self.start()
                return
            if fault_held:
                self.fault_exits += 1
            else:
                self.failures.append(f"run {self.runs} exit {code}: {last}")
            self._retry_at = time.time() + RESUME_AFTER_S
        if fault_held:
            return
        if len(self.failures) > MAX_FAILURES or time.time() < self._retry_at:
            return  # waits (a fault may still hold: the disk full), or reported as a session without a verdict
        if self.session_id is None:
            self.start()  # killed before it named itself: nothing to resume
        else:
            self.resumes += 1
            self._launch(["resume", self.session_id])

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()


@dataclass
class Submitted:
    """A hand job the soak submitted (its id returned by the queue)."""

    queue: str
    id: int
    priority: int
    steps: int


class HandJobs:
    """A stream of hand jobs with checkpoints onto the queues, at seeded random moments and priorities."""

    def __init__(self, rng: random.Random, homes: dict[str, Home], records: Path, mean_gap: float = 4.0):
        from orchestrator.queue.store import JobStore

        self.rng, self.homes, self.records, self.mean_gap = rng, homes, records, mean_gap
        self.stores = {q: JobStore(h.db_url) for q, h in homes.items()}
        self.jobs: list[Submitted] = []
        self.errors = 0  # submits refused by a fault (PostgreSQL restarting, the disk full) and retried
        self._n = 0
        self._next = time.time()
        self._pending: Optional[tuple] = None  # a submit a fault refused: tried again at the next step

    def spec(self, queue: str, priority: int, steps: int, key: str):
        from orchestrator.queue.models import JobSpec

        return JobSpec(argv=[sys.executable, "-m", "benchmarks.chaos.handjob", str(self.records), queue, str(steps)],
                       name=key, priority=priority, max_attempts=3, grace=20.0, cwd=str(ROOT), track=True,
                       idempotency_key=key, env={"PYTHONPATH": str(ROOT)})

    def step(self) -> None:
        if self._pending is None:
            if time.time() < self._next:
                return
            self._next = time.time() + self.rng.expovariate(1 / self.mean_gap)
            self._n += 1
            self._pending = (self.rng.choice(sorted(self.homes)), self.rng.choice(PRIORITIES),
                             self.rng.randint(15, 60), f"hand-{self._n}")
        queue, priority, steps, key = self._pending
        try:  # the same key on every try: a submit that committed before it raised is not doubled
            job = self.stores[queue].submit(self.spec(queue, priority, steps, key))
        except Exception:
            self.errors += 1
            return
        self._pending = None
        self.jobs.append(Submitted(queue, job.id, priority, steps))


def write_program(root: Path) -> Path:
    """A small program (Contract 4) in a git repository: `train.py` prints `score: ...` after a short run."""
    root.mkdir(parents=True)
    (root / "prepare.py").write_text("def evaluate(lr):\n    return (lr - 3.0) ** 2\n")
    (root / "train.py").write_text("import os, random, time\nfrom prepare import evaluate\nLR = 1.0\n"
                                   "random.seed(int(os.environ.get('AUTORESEARCH_SEED', '0')))\ntime.sleep(1.0)\n"
                                   "print(f'score: {evaluate(LR) + random.gauss(0, 0.01):.6f}', flush=True)\n")
    (root / "autoresearch.toml").write_text(
        f'[program]\nedit = ["train.py"]\nprotected = ["prepare.py"]\nrun = "{sys.executable} train.py"\n'
        'metric = "score"\ndirection = "minimize"\ntime_limit = "2m"\nrepeats = 2\n')
    git = ["git", "-c", "user.name=soak", "-c", "user.email=soak@localhost"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "the program"], cwd=root, check=True)
    return root


class ProgramLLM:
    """The fake LLM's answers for the program session: one edit of the learning rate per proposal."""

    def __init__(self) -> None:
        self.i = 0
        self._lock = threading.Lock()

    def answer(self, body: dict):
        from tests.agent.fake_llm import Step

        prompt = body["messages"][-1]["content"]
        m = re.search(r"Propose (\d+)", prompt)
        current = re.search(r"LR = ([0-9.]+)", prompt)
        search = f"LR = {current.group(1)}" if current else "LR = 1.0"
        props = []
        with self._lock:
            for _ in range(int(m.group(1)) if m else 1):
                self.i += 1
                props.append({"parent": "best", "rationale": f"lr step {self.i}",
                              "edits": [{"file": "train.py", "search": search,
                                         "replace": f"LR = {round(1.0 + 0.05 * self.i, 4)}"}]})
        return Step(200, json.dumps({"proposals": props}))


def agent_argv(trials: int) -> list[str]:
    """An agent session on digits with the TPE sampler: short trials, one seed each for baseline and confirm."""
    return ["start", "--goal", "soak", "--experiment", "digits", "--proposer", "tpe", "--trials", str(trials),
            "--parallel", "2", "--param", "epochs=2", "--baseline-seeds", "1", "--confirm-seeds", "1",
            "--confirm-top", "1"]


def program_argv(program: Path, trials: int) -> list[str]:
    return ["start", "--goal", "lower score", "--program", str(program), "--trials", str(trials), "--parallel", "1"]
