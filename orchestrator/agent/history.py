"""What an experiment has produced so far, read from the queue (jobs by experiment) and MLflow (their metrics).

Both the proposers (every finished trial of the experiment seeds the sampler, hand-submitted runs included)
and the leaderboard read through here. A finished job's metric never changes, so values are cached per job.
"""

from __future__ import annotations

import json

from typing import TYPE_CHECKING, Any, Iterable, Sequence

from experiments.registry import ExperimentSpec
from orchestrator.agent.proposers.base import Observation
from orchestrator.agent.trial import Trial, TrialStatus
from orchestrator.queue.models import Job
from orchestrator.queue.states import HOLDING, JobState
from orchestrator.tracking.client import TAG_PHASE

if TYPE_CHECKING:
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker

S = JobState


def device_seconds(store: JobStore, job: Job, now: float | None = None) -> float:
    """Device-seconds a job has held (every attempt; STARTING through CANCELLING), times its device count (its
    share of one device for a job sharing a GPU)."""
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
    return held * (getattr(job, "gpu_share", None) or max(1, job.gpus))


def held_intervals(store: JobStore, job: Job) -> list[tuple[float, float | None]]:
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

    def __init__(self, store: JobStore, tracker: Tracker, spec: ExperimentSpec):
        self.store = store
        self.tracker = tracker
        self.spec = spec
        self._values: dict[int, float | None] = {}
        self._phase: dict[int, str | None] = {}

    def jobs(self) -> list[Job]:
        return self.store.list(experiment=self.spec.name)

    def value(self, job: Job) -> float | None:
        """The job's final metric, or None; cached once the job is final.

        A job that succeeded counts. So does one stopped or cancelled after its metric history had already
        reached its full budget (ASHA's demotion or the session's end arrived after the last step): a
        finished result is never dropped for how the job was stopped.
        """
        if job.id in self._values:
            return self._values[job.id]
        value = None
        if job.mlflow_run_id and (job.job_state is S.SUCCEEDED or job.final):
            try:
                if self.spec.run is not None:  # a config-file experiment: its output lines' reports first
                    from orchestrator.core import outputmetrics

                    outputmetrics.sync(self.tracker, job, self.spec.metric)
                if job.job_state is S.SUCCEEDED:
                    value = self.tracker.final(job.mlflow_run_id, self.spec.metric)
                else:
                    value = completed_value(self.tracker, self.spec, job.mlflow_run_id)
            except Exception:  # a run deleted by hand, or an MLflow hiccup: not worth failing a session
                value = None
        if job.final:
            self._values[job.id] = value
        return value

    def phase(self, job: Job) -> str | None:
        """The session phase a job ran in ("baseline", "search", "confirm"; its MLflow run's tag), None by hand."""
        if job.id not in self._phase:
            tags = self.tracker.tags(job.mlflow_run_id) if job.mlflow_run_id else {}
            self._phase[job.id] = tags.get(TAG_PHASE)
        return self._phase[job.id]

    def observations(self, session_trials: Sequence[Trial] = ()) -> list[Observation]:
        """Every trial of the experiment as proposer input; the session's own come from its state."""
        mine = {t.job_id: t for t in session_trials if t.job_id is not None}
        out: list[Observation] = []
        for job in self.jobs():
            if job.id in mine or job.params is None:
                continue
            if job.job_state is S.SUCCEEDED:
                value = self.value(job)
                if value is not None:
                    out.append(Observation(dict(job.params), "complete", value, source=source(job)))
            elif job.job_state is S.FAILED and job.final:
                out.append(Observation(dict(job.params), "failed", source=source(job), error=job.reason[:200]))
            elif not job.final:
                out.append(Observation(dict(job.params), "running", source=source(job)))
        for t in session_trials:
            out.append(trial_observation(t))
        return out

    def rows(self, jobs: Iterable[Job] | None = None) -> list[dict[str, Any]]:
        """Leaderboard rows: every job of the experiment with a final metric (complete runs only); a session's
        search-phase runs are marked `selection` (they rank a configuration but never gate it)."""
        rows = []
        for job in self.jobs() if jobs is None else jobs:
            if job.final and job.params is not None:
                value = self.value(job)
                if value is not None:
                    rows.append({"params": _row_params(job), "value": value, "job_id": job.id,
                                 "source": source(job), "baseline": self.phase(job) == "baseline",
                                 "selection": self.phase(job) == "search"})
        return rows


def _row_params(job: Job) -> dict[str, Any]:
    """A job's params for the leaderboard: with its schedule when it ran one (population-based training)."""
    from experiments.common import SCHEDULE_ENV
    from orchestrator.agent.schedule import row_params

    raw = (job.env or {}).get(SCHEDULE_ENV)
    return row_params(job.params, json.loads(raw) if raw else None)


def completed_value(tracker: Tracker, spec: ExperimentSpec, run_id: str) -> float | None:
    """The final metric of a run whose progress history reached its full budget, else None.

    The budget is the `total_steps` param the job logs when it starts (the bundled experiments do); a run
    without it cannot show that it finished, so it does not count.
    """
    try:
        total = int(float(tracker.params(run_id).get("total_steps", "")))
    except ValueError:
        return None
    history = tracker.history(run_id, spec.progress_metric or spec.metric)
    if not history or history[-1][0] < total:
        return None
    return tracker.final(run_id, spec.metric)


def trial_observation(t: Trial) -> Observation:
    """A session trial as an observation."""
    S = TrialStatus
    if t.status is S.SUCCEEDED and t.value is not None:
        state = "complete"
    elif t.status is S.FAILED:
        state = "failed"
    elif t.status in (S.STOPPED, S.PAUSED):
        state = "pruned"
    elif t.status is S.CANCELLED:
        state = "skip"
    else:
        state = "running"
    intermediate = {int(k): float(v) for k, v in t.rungs.items()}
    return Observation(dict(t.params), state, t.value, intermediate=intermediate, proposer=t.proposer,
                       source="session", error=t.error)
