"""What an experiment has produced so far, read from the queue (jobs by experiment) and MLflow (their metrics).

Both the proposers (every finished trial of the experiment seeds the sampler, hand-submitted runs included)
and the leaderboard read through here. A finished job's metric never changes, so values are cached per job.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from experiments.registry import ExperimentSpec
from orchestrator.agent.proposers.base import Observation
from orchestrator.queue.models import Job
from orchestrator.queue.states import HOLDING, JobState

S = JobState


def is_final(job: Job) -> bool:
    """Whether a job will never run again (a FAILED job with attempts left is retried by the service)."""
    state = job.job_state
    if state is S.FAILED:
        return job.failures >= job.max_attempts
    return state in (S.SUCCEEDED, S.CANCELLED)


def device_seconds(store: Any, job: Job, now: float | None = None) -> float:
    """Device-seconds a job has held (every attempt; STARTING through CANCELLING), times its device count."""
    import time

    held, since = 0.0, None
    for ev in store.events(job.id):
        holding = JobState(ev.dst) in HOLDING
        if holding and since is None:
            since = ev.at
        elif not holding and since is not None:
            held += ev.at - since
            since = None
    if since is not None:
        held += (now or time.time()) - since
    return held * max(1, job.gpus)


def held_intervals(store: Any, job: Job) -> list[tuple[float, float | None]]:
    """(start, end) of each stretch the job held devices (end None while it still does)."""
    out: list[tuple[float, float | None]] = []
    since = None
    for ev in store.events(job.id):
        holding = JobState(ev.dst) in HOLDING
        if holding and since is None:
            since = ev.at
        elif not holding and since is not None:
            out.append((since, ev.at))
            since = None
    if since is not None:
        out.append((since, None))
    return out


def source(job: Job) -> str:
    """Who made a job, for people: "session s-1a2b3c4d" or "by hand (owner)"."""
    owner = job.owner or "?"
    return f"session {owner}" if owner.startswith("s-") else f"by hand ({owner})"


class Results:
    """Jobs of one experiment with their final metrics."""

    def __init__(self, store: Any, tracker: Any, spec: ExperimentSpec):
        self.store = store
        self.tracker = tracker
        self.spec = spec
        self._values: dict[int, float | None] = {}

    def jobs(self) -> list[Job]:
        return self.store.list(experiment=self.spec.name)

    def value(self, job: Job) -> float | None:
        """The job's final metric (None when it has none or no run); cached once the job is final."""
        if job.id in self._values:
            return self._values[job.id]
        value = None
        if job.mlflow_run_id:
            try:
                value = self.tracker.final(job.mlflow_run_id, self.spec.metric)
            except Exception:  # a run deleted by hand, or an MLflow hiccup: not worth failing a session
                value = None
        if is_final(job):
            self._values[job.id] = value
        return value

    def observations(self, session_trials: Sequence[Mapping[str, Any]] = ()) -> list[Observation]:
        """Every trial of the experiment as proposer input; the session's own come from its state."""
        mine = {t["job_id"]: t for t in session_trials if t.get("job_id") is not None}
        out: list[Observation] = []
        for job in self.jobs():
            if job.id in mine or job.params is None:
                continue
            if job.job_state is S.SUCCEEDED:
                value = self.value(job)
                if value is not None:
                    out.append(Observation(dict(job.params), "complete", value, source=source(job)))
            elif job.job_state is S.FAILED and is_final(job):
                out.append(Observation(dict(job.params), "failed", source=source(job), error=job.reason[:200]))
            elif not is_final(job):
                out.append(Observation(dict(job.params), "running", source=source(job)))
        for t in session_trials:
            out.append(trial_observation(t))
        return out

    def rows(self, jobs: Iterable[Job] | None = None) -> list[dict[str, Any]]:
        """Leaderboard rows: every succeeded job of the experiment that logged the metric."""
        rows = []
        for job in self.jobs() if jobs is None else jobs:
            if job.job_state is S.SUCCEEDED and job.params is not None:
                value = self.value(job)
                if value is not None:
                    rows.append({"params": dict(job.params), "value": value, "job_id": job.id,
                                 "source": source(job)})
        return rows


def trial_observation(t: Mapping[str, Any]) -> Observation:
    """A session trial (a dict of the agent's state) as an observation."""
    status = t.get("status")
    if status == "succeeded" and t.get("value") is not None:
        state = "complete"
    elif status == "failed":
        state = "failed"
    elif status in ("stopped", "paused"):
        state = "pruned"
    elif status == "cancelled":
        state = "skip"
    else:
        state = "running"
    intermediate = {int(k): float(v) for k, v in (t.get("rungs") or {}).items()}
    return Observation(dict(t["params"]), state, t.get("value"), intermediate=intermediate,
                       proposer=t.get("proposer", ""), source="session", error=t.get("error", ""))
