"""An agent session's settings and its record: what was asked, where its state lives, how it ended.

A session is identified by a short id (`s-` and 8 hex digits). Its LangGraph checkpoints and this small
registry share one SQLite file under `AUTORESEARCH_HOME/agent/`; its results live in MLflow (the parent run)
and the queue (its trials' jobs, owned by the session id). Nothing here holds a secret: the LLM endpoint's
key stays in the environment of the process that talks to it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.core.errors import BadInput


NO_GOAL = "no goal given"  # what a sampler session without --goal records (only the LLM reads a goal)
LLM_PROPOSERS = ("llm", "hybrid")


@dataclass(frozen=True)
class SessionConfig:
    """What `autoresearch start` asked for.

    `trials` counts the search trials and the confirmation re-runs; the baseline's `baseline_seeds` runs come
    on top (they are the measurement every result is judged against, not part of the search).
    """

    goal: str
    experiment: str
    proposer: str = "tpe"
    trials: int | None = None
    budget_minutes: float | None = None
    target: float | None = None
    parallel: int | None = None  # None: the service's device count
    priority: int = 0
    model: str | None = None
    fixed: dict[str, Any] = field(default_factory=dict)  # params held constant (e.g. scale=1 on a laptop)
    # Fresh-seed re-runs of each top candidate: the gate judges a candidate on these alone (its selecting search
    # run is biased upward), so 3 give the t-test 2 degrees of freedom instead of 1.
    confirm_seeds: int = 3
    confirm_top: int = 2  # candidates re-run (best mean over seeds first)
    baseline: dict[str, Any] = field(default_factory=dict)  # overrides of the spec's defaults for the baseline
    baseline_seeds: int = 3  # the baseline runs on this many seeds, first of all
    early_stopping: bool = True
    eta: int = 3
    seed: int = 0
    max_attempts: int = 2
    poll: float = 1.0  # seconds between looks at the queue and MLflow while trials run
    llm: dict[str, Any] = field(default_factory=dict)  # LLMProposer options (timeouts, re-asks, backoff)
    project: str = "default"  # the project its trials are charged to (orchestrator.queue.projects)
    # Caps on the LLM's spend (orchestrator.agent.budget): at either, the session pauses (resumable with more).
    llm_budget_usd: float | None = None
    llm_budget_tokens: int | None = None
    # Population-based training (`--proposer pbt`): members training at once, and the interval (in the
    # experiment's progress steps) at which the bottom quantile copies a top member and perturbs its params.
    population: int | None = None
    perturbation_interval: int | None = None
    # Trials sharing one GPU (orchestrator.agent.packer): "auto" measures the baseline and packs by its use
    # (1 on cpu slots); an integer 1..16 packs that many on every device, cpu slots included.
    trials_per_gpu: str | int = "auto"
    # Whole devices each trial holds (`--gpus G`; on each node with `--nodes`, as `submit --nodes` counts them), and
    # trials across nodes (`--nodes N [--min-nodes M]`, a cluster executor: Slurm): a gang of N nodes. Above one
    # device per trial nothing is packed.
    gpus: int = 1
    nodes: int = 1
    min_nodes: int | None = None

    def __post_init__(self) -> None:
        if not self.goal.strip():
            if self.proposer in LLM_PROPOSERS:  # the samplers never read the goal; the LLM is told nothing else
                raise BadInput(f"--goal is required with the {self.proposer} proposer (it is what the LLM is told)")
            object.__setattr__(self, "goal", NO_GOAL)  # recorded as such, so a listing never shows a blank
        if self.trials is not None and self.trials < 1:
            raise BadInput(f"--trials must be >= 1, got {self.trials}")
        if self.budget_minutes is not None and not self.budget_minutes > 0:
            raise BadInput(f"--budget-minutes must be > 0, got {self.budget_minutes}")
        if self.parallel is not None and self.parallel < 1:
            raise BadInput(f"--parallel must be >= 1, got {self.parallel}")
        if self.confirm_seeds < 0:
            raise BadInput("--confirm-seeds must be >= 0")
        if self.confirm_top < 1:
            raise BadInput("--confirm-top must be >= 1")
        if not 1 <= self.baseline_seeds <= 20:
            raise BadInput(f"--baseline-seeds must be in 1..20, got {self.baseline_seeds}")
        if self.proposer == "pbt":
            if self.population is None or self.population < 2:
                raise BadInput("--proposer pbt needs --population N with N >= 2 (members training at once)")
            if self.perturbation_interval is None or self.perturbation_interval < 1:
                raise BadInput("--proposer pbt needs --perturbation-interval K >= 1 (in the experiment's "
                               "progress steps)")
        elif self.population is not None or self.perturbation_interval is not None:
            raise BadInput("--population and --perturbation-interval go with --proposer pbt")
        from orchestrator.agent.packing import parse

        object.__setattr__(self, "trials_per_gpu", parse(self.trials_per_gpu))
        from orchestrator.queue.models import check_nodes

        check_nodes(self.nodes, self.min_nodes)  # the rule a job's --nodes follows
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or not 1 <= self.gpus <= 1024:
            raise BadInput(f"--gpus (devices per trial) must be an integer from 1 to 1024, got {self.gpus!r}")
        if self.nodes > 1 and self.trials_per_gpu not in ("auto", 1):
            raise BadInput(f"--trials-per-gpu {self.trials_per_gpu} packs trials on one device; a trial across "
                           f"--nodes {self.nodes} takes whole devices on each: drop one of them")
        if self.gpus > 1 and self.trials_per_gpu not in ("auto", 1):
            raise BadInput(f"--trials-per-gpu {self.trials_per_gpu} packs trials on one device; a trial of "
                           f"--gpus {self.gpus} takes whole devices: drop one of them")
        from orchestrator.agent.budget import LLMBudget

        LLMBudget(self.llm_budget_usd, self.llm_budget_tokens)  # BadInput for a cap that is not > 0

    @property
    def max_trials(self) -> int | None:
        """The trial budget; 20 when no budget at all was given (a session must end)."""
        if self.trials is None and self.budget_minutes is None and self.target is None:
            return 20
        return self.trials

    def split(self) -> tuple[int | None, int]:
        """(search trials, confirmation re-runs): re-runs come out of `--trials`, never on top of it.

        Up to `confirm_top * confirm_seeds` re-runs, but never more than half of what is left after two trials.
        """
        want = self.confirm_top * self.confirm_seeds
        total = self.max_trials
        if total is None:
            return None, want
        confirm = min(want, max(0, (total - 2) // 2))
        return total - confirm, confirm

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SessionConfig":
        return cls(**data)


def stopped_reason(session_id: str) -> str:
    """The reason `stop` cancels a session's unfinished trials with: a trial whose job was cancelled so is run
    again by `resume` (orchestrator.agent.graph), and not counted as done meanwhile (`background.trial_counts`),
    unless its job had finished its budget as the cancel landed: `resume` then keeps its result and scores it."""
    return f"stopped with session {session_id}; resume runs it again"


def cancelled_by_stop(job: Any, session_id: str) -> bool:
    """Whether `job` was cancelled by a `stop` of session `session_id` (its trial is then run again)."""
    return job.state == "CANCELLED" and (job.reason or "").startswith(stopped_reason(session_id))


def rerun_key(key: str, attempt: int) -> str:
    """A trial's job's idempotency key (and its MLflow run's) once `attempt` runs of it were cut short by a
    `stop`: `key`, then `key~1`, `key~2` ..."""
    return key if not attempt else f"{key}~{attempt}"


def new_id() -> str:
    """A fresh session id."""
    return "s-" + uuid.uuid4().hex[:8]


def state_path(home: Path) -> Path:
    """The SQLite file holding LangGraph checkpoints and the session registry."""
    path = Path(home) / "agent"
    path.mkdir(parents=True, exist_ok=True)
    return path / "agent.db"


def connect(home: Path) -> sqlite3.Connection:
    """A connection to the agent database (WAL, so `sessions` can read while a session writes)."""
    conn = sqlite3.connect(str(state_path(home)), check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


class Registry:
    """The table of sessions: id, config, status, the process running it, its MLflow run, a summary."""

    def __init__(self, home: Path):
        self.conn = connect(home)
        with self.conn:
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, experiment TEXT, goal TEXT, "
                "proposer TEXT, config TEXT, status TEXT, pid INTEGER, mlflow_run_id TEXT, summary TEXT, "
                "created_at REAL, updated_at REAL)")
            if "llm_usage" not in {r[1] for r in self.conn.execute("PRAGMA table_info(sessions)")}:
                self.conn.execute("ALTER TABLE sessions ADD COLUMN llm_usage TEXT")  # a home from before it

    def create(self, session_id: str, config: SessionConfig) -> None:
        now = time.time()
        with self.conn:
            self.conn.execute(
                "INSERT INTO sessions (id, experiment, goal, proposer, config, status, pid, mlflow_run_id, summary, "
                "created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (session_id, config.experiment, config.goal, config.proposer, json.dumps(config.to_dict()),
                 "running", os.getpid(), None, "{}", now, now))

    def update(self, session_id: str, **fields: Any) -> None:
        for key in ("summary", "llm_usage"):
            if key in fields:
                fields[key] = json.dumps(fields[key], default=str)
        fields["updated_at"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.conn:
            self.conn.execute(f"UPDATE sessions SET {cols} WHERE id = ?", (*fields.values(), session_id))

    def get(self, session_id: str) -> dict[str, Any]:
        """The session's row (BadInput when there is none)."""
        row = self.conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise BadInput(f"no session {session_id!r}; see `autoresearch sessions`")
        return self._row(row)

    def all(self) -> list[dict[str, Any]]:
        rows = self.conn.execute("SELECT * FROM sessions ORDER BY created_at DESC").fetchall()
        return [self._row(r) for r in rows]

    def _row(self, row: tuple) -> dict[str, Any]:
        cols = [d[0] for d in self.conn.execute("SELECT * FROM sessions LIMIT 0").description]
        out = dict(zip(cols, row))
        out["config"] = json.loads(out["config"] or "{}")
        out["summary"] = json.loads(out["summary"] or "{}")
        out["llm_usage"] = json.loads(out.get("llm_usage") or "{}")
        if out["status"] == "running" and not _alive(out["pid"]):
            out["status"] = "interrupted"  # its process is gone: `autoresearch resume` continues it
        return out

    def spent(self, session_id: str, usage: dict[str, Any]) -> None:
        """Record what the session's LLM calls have cost so far (in all), as it goes: `usage` shows a running
        session's spend, not only a finished one's."""
        self.update(session_id, llm_usage=usage)

    def close(self) -> None:
        self.conn.close()


def _alive(pid: int | None) -> bool:
    """Whether the process running a session is still there (a zombie, killed but not reaped, is not)."""
    import psutil

    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
