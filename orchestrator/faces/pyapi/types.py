"""The typed results of the Python API: frozen dataclasses built from the JSON records the CLI prints.

Each keeps the record it was built from (`to_dict()`), so the CLI's `--json` and the MCP tools answer exactly what
they always did while Python callers get attributes, predicates and help() text. A leaf module: it imports
nothing of the orchestrator, so reading a result costs no database or MLflow import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")  # the final job states (they never change)


@dataclass(frozen=True)
class JobEvent:
    """One state transition of a job: when, from which state (None for the submit), to which, and why."""

    at: float
    to: str
    reason: str
    source: Optional[str] = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "JobEvent":
        """From one entry of `show --json`'s `events`."""
        return cls(at=data["at"], to=data["to"], reason=data.get("reason") or "", source=data.get("from"))


@dataclass(frozen=True)
class Job:
    """A job as the queue holds it (the fields of `autoresearch show --json`).

    `events` is filled by `orchestrator.job(ID)` (empty in listings); `service_running` is set by `submit`: whether
    a service was running to pick the job up (if not, it waits until `autoresearch serve` or `orchestrator.serve`).
    """

    id: int
    name: str
    state: str
    priority: int
    gpus: Union[int, float]  # devices, or a share of one GPU (0.25)
    devices: tuple[str, ...] = ()
    attempts: int = 0
    preemptions: int = 0
    exit_code: Optional[int] = None
    mlflow_run_id: Optional[str] = None
    owner: str = ""
    experiment: Optional[str] = None
    params: Mapping[str, Any] = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    reason: str = ""
    project: str = "default"
    time_limit: Optional[float] = None
    log_path: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    submitted_at: Optional[float] = None
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    events: tuple[JobEvent, ...] = ()
    next: Optional[str] = None
    service_running: Optional[bool] = None
    record: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], service_running: Optional[bool] = None) -> "Job":
        """From a job record (`show --json`, `queue --json`); keys this class does not name stay in `to_dict()`."""
        names = {f.name for f in dataclasses.fields(cls)} - {"events", "record", "service_running"}
        values = {k: v for k, v in data.items() if k in names}
        for key in ("devices", "argv"):
            values[key] = tuple(values.get(key) or ())
        values["params"] = dict(values.get("params") or {})
        values["reason"] = values.get("reason") or ""
        values["owner"] = values.get("owner") or ""
        events = tuple(JobEvent.from_dict(e) for e in data.get("events") or ())
        return cls(**values, events=events, service_running=service_running, record=dict(data))

    @property
    def is_finished(self) -> bool:
        """Whether the job reached a final state (SUCCEEDED, FAILED or CANCELLED)."""
        return self.state in FINISHED

    @property
    def succeeded(self) -> bool:
        """Whether the job ended SUCCEEDED."""
        return self.state == "SUCCEEDED"

    def to_dict(self) -> dict[str, Any]:
        """The job's JSON record, as `autoresearch show --json` prints it."""
        return dict(self.record)


@dataclass(frozen=True)
class Entry:
    """One configuration on a leaderboard: its rank, mean metric over its runs and spread (the seed noise), its
    `gap` to the baseline (positive: better), its params and their `diff` from the baseline's, and its jobs."""

    rank: int
    mean: float
    spread: Optional[float]
    n: int
    params: Mapping[str, Any]
    diff: Mapping[str, Any]
    gap: Optional[float]
    job_ids: tuple[int, ...]
    baseline: bool = False
    winner: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Entry":
        """From one of a board's `entries`."""
        return cls(rank=data["rank"], mean=data["mean"], spread=data.get("spread"), n=data["n"],
                   params=dict(data.get("params") or {}), diff=dict(data.get("diff", data.get("params")) or {}),
                   gap=data.get("gap"), job_ids=tuple(data.get("job_ids") or ()),
                   baseline=bool(data.get("baseline")), winner=bool(data.get("winner")))


@dataclass(frozen=True)
class Leaderboard:
    """One experiment's ranking (`autoresearch leaderboard`): entries best first, the gated `winner` (None when
    nothing beat the baseline by more than the noise) and the verdict in one line (`headline`)."""

    experiment: str
    metric: str
    direction: str
    entries: tuple[Entry, ...]
    headline: str
    record: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Leaderboard":
        """From one board of `leaderboard --json`."""
        return cls(experiment=data["experiment"], metric=data["metric"], direction=data["direction"],
                   entries=tuple(Entry.from_dict(e) for e in data.get("entries") or ()),
                   headline=data.get("headline") or "", record=dict(data))

    @property
    def winner(self) -> Optional[Entry]:
        """The configuration that beat the baseline through the noise gate, if any."""
        return next((e for e in self.entries if e.winner), None)

    @property
    def baseline(self) -> Optional[Entry]:
        """The baseline configuration (the experiment's defaults, run on several seeds), if measured."""
        return next((e for e in self.entries if e.baseline), None)

    def to_dict(self) -> dict[str, Any]:
        """The board as `autoresearch leaderboard --json` prints it."""
        return dict(self.record)


@dataclass(frozen=True)
class Event:
    """One thing a running session did, as `autoresearch start` shows it live: `kind` is submitted, running,
    succeeded, failed, paused, stopped, cancelled, promoted, phase or message; `data` holds the rest (trial, job,
    params, value, the running tally...)."""

    kind: str
    elapsed: Optional[float]
    data: Mapping[str, Any]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Event":
        """From one line of the session's event file."""
        return cls(kind=str(data.get("event", "message")), elapsed=data.get("elapsed"), data=dict(data))

    @property
    def text(self) -> str:
        """A message event's words (program sessions report in words), else ''."""
        return str(self.data.get("message", ""))


@dataclass(frozen=True)
class Verdict:
    """How a session ended. `status` is finished, paused (at its LLM budget), interrupted or failed; `improved`
    says whether a variant beat the baseline through the noise gate, and `headline` says it in words. `baseline`
    and `best` are metric means; `params` are the winner's (an experiment) or its commit and change (a program).
    `summary` is everything the session recorded (`autoresearch start --json`)."""

    session: str
    status: str
    headline: str
    improved: bool
    metric: Optional[str]
    direction: Optional[str]
    baseline: Optional[float]
    best: Optional[float]
    params: Mapping[str, Any]
    stop_reason: str
    summary: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_summary(cls, session: str, status: str, summary: Mapping[str, Any]) -> "Verdict":
        """From a session's recorded summary (an experiment's or a program's)."""
        base, best = summary.get("baseline"), summary.get("winner") or summary.get("best") or {}
        if isinstance(base, Mapping):
            base = base.get("mean")
        if "program" in summary:  # a program session: the incumbent commit, judged against the baseline
            improved = bool(best.get("trial"))
            params = {"commit": best.get("commit"), "change": best.get("rationale")} if improved else {}
        else:
            improved, params = bool(summary.get("winner")), dict((summary.get("winner") or {}).get("params") or {})
        value = best.get("mean", best.get("value")) if isinstance(best, Mapping) else None
        error = summary.get("error")
        headline = summary.get("headline") or (f"failed: {error}" if error else "")
        return cls(session=session, status=status, headline=headline, improved=improved,
                   metric=summary.get("metric"), direction=summary.get("direction"), baseline=base, best=value,
                   params=params, stop_reason=summary.get("stop_reason") or "", summary=dict(summary))


@dataclass(frozen=True)
class Experiment:
    """An experiment the agent can search (a bundled one, or a folder's `autoresearch.toml`): the metric it
    reports and which way is better, and its search space (one dict per parameter: name, type, range, default)."""

    name: str
    metric: str
    direction: str
    description: str
    space: tuple[Mapping[str, Any], ...]
    source: Optional[str] = None

    @property
    def defaults(self) -> dict[str, Any]:
        """The parameters' defaults: what the baseline runs."""
        return {p["name"]: p.get("default") for p in self.space}
