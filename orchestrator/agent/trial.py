"""One trial of an agent session: what it runs, where it stands, what it measured.

A trial is the agent's view of one job: its params and phase, its status in the session (which is not the
job's queue state: a demoted job is QUEUED in the queue but PAUSED here), and what MLflow showed of it. The
graph's checkpointed state holds trials as plain dicts (`to_dict`), so a checkpoint stays JSON and a session
checkpointed by an older version still loads (`from_dict` ignores keys it does not know).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, TypedDict

from orchestrator.agent.session import rerun_key
from orchestrator.core.records import Record


class Phase(str, Enum):
    """Why a trial runs: the baseline (the reference), the search, or a confirmation re-run on a fresh seed."""

    BASELINE = "baseline"
    SEARCH = "search"
    CONFIRM = "confirm"


class TrialStatus(str, Enum):
    """Where a trial stands in its session."""

    PROPOSED = "proposed"  # recorded (with its idempotency key), not yet submitted
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"  # demoted by ASHA: checkpointed and waiting in line at a lower priority
    SUCCEEDED = "succeeded"  # has its final metric (a finished budget counts however the job was stopped)
    FAILED = "failed"
    STOPPED = "stopped"  # paused by ASHA and never resumed
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        """It holds (or is about to hold) a slot of the session's K in flight."""
        return self in (TrialStatus.PROPOSED, TrialStatus.QUEUED, TrialStatus.RUNNING)

    @property
    def final(self) -> bool:
        """Its outcome is known and will not change."""
        return self in (TrialStatus.SUCCEEDED, TrialStatus.FAILED, TrialStatus.STOPPED, TrialStatus.CANCELLED)


@dataclass
class Trial(Record):
    """One trial; `key` (`<session>:<n>`) is its job's idempotency key and its MLflow run's tag."""

    n: int
    key: str
    phase: Phase
    params: dict[str, Any]
    proposer: str
    rationale: str = ""
    status: TrialStatus = TrialStatus.PROPOSED
    job_id: int | None = None
    run_id: str | None = None
    value: float | None = None
    rungs: dict[str, float] = field(default_factory=dict)  # ASHA rung (str(report number)) -> value there
    judged: list[int] = field(default_factory=list)  # rungs ASHA has ruled on
    stopped_at: int | None = None  # the rung where ASHA paused it
    last_step: int | None = None
    total: int | None = None  # its full budget in steps, as its job logged it (`total_steps`)
    device_s: float = 0.0
    error: str = ""
    ended: bool = False  # its job will not run again (recorded by `monitor`, acted on by `analyse`)
    submitted_at: float | None = None
    finished_at: float | None = None
    # Population-based training (orchestrator.agent.pbt): the population slot it fills, how it was forked
    # (parent trial and run, the step it forked at, the mutable params before and after), and the schedule of
    # mutable params its lineage ran ([[step, {param: value}], ...]).
    member: int | None = None
    lineage: dict[str, Any] = field(default_factory=dict)
    schedule: list = field(default_factory=list)
    attempt: int = 0  # runs of it cut short by a `stop` of its session (`run_again`)

    @property
    def job_key(self) -> str:
        """Its current job's idempotency key (and its MLflow run's): `key`, then `key~1`, ... once run again."""
        return rerun_key(self.key, self.attempt)

    def run_again(self) -> None:
        """Its job was cancelled by a `stop` of its session: on resume it is proposed again as it was (same
        params, a fresh job and run), so a stop costs no trial of the session's budget."""
        self.update(status=TrialStatus.PROPOSED, attempt=self.attempt + 1, job_id=None, run_id=None, ended=False,
                    rungs={}, judged=[], stopped_at=None, last_step=None, total=None, device_s=0.0, error="",
                    submitted_at=None, finished_at=None)

    def __post_init__(self) -> None:
        self.phase = Phase(self.phase)
        self.status = TrialStatus(self.status)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data for the graph's checkpoint."""
        out = dataclasses.asdict(self)
        out["phase"], out["status"] = self.phase.value, self.status.value
        return out

    def config_values(self) -> dict[str, Any]:
        """The ASHA view of the trial (its rungs, what was judged, where it stopped), as `stopping` reads it."""
        return {"n": self.n, "rungs": self.rungs, "judged": self.judged, "stopped_at": self.stopped_at}


def load(trials: list[Mapping[str, Any] | Trial]) -> list[Trial]:
    """Trials from the checkpointed state (copies: a node never changes the state it was given)."""
    return [Trial.from_dict(t.to_dict() if isinstance(t, Trial) else t) for t in trials]


def dump(trials: list[Trial]) -> list[dict[str, Any]]:
    """Trials for the checkpointed state."""
    return [t.to_dict() for t in trials]


class State(TypedDict, total=False):
    """The checkpointed state of a session."""

    session: str
    config: dict
    parent_run: str
    phase: str  # search | confirm | done
    trials: list[dict]  # `Trial.to_dict()` of each trial
    elapsed: float  # seconds this session has been alive (time while killed does not count)
    best: dict | None
    candidates: list[int]  # search trials whose configuration is being re-run on fresh seeds
    confirm_planned: bool  # the confirmation re-runs have been recorded (possibly none: no candidate)
    usage: dict
    stop_reason: str
    route: str
    budget_stop: str  # why the LLM budget stopped the proposing ("" while there is room)
    paused: str  # set when the session ended paused at its LLM budget (resume with a higher cap clears it)
    pbt: dict  # population-based training: the intervals judged so far
    packing: dict  # trials per GPU: k, how it was decided, its controller (orchestrator.agent.packer)
