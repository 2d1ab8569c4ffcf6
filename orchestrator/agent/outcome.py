"""How a trial turned out, read from its job (the queue) and its run (MLflow), and whether ASHA may demote it.

Kept apart from the graph because these are the research-integrity rules: a finished result is never dropped
(a job stopped or cancelled after its metric history reached its full budget has finished, and its final value
counts), and a demotion is decided on the trial's latest reports, not on a rung value seen a moment ago.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.core import outputmetrics
from orchestrator.agent.history import completed_value, device_seconds
from orchestrator.agent.stopping import ASHA
from orchestrator.agent.trial import Phase, Trial, TrialStatus
from orchestrator.tracking.client import run_status

if TYPE_CHECKING:
    from experiments.registry import ExperimentSpec
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker

S, P = TrialStatus, Phase


def reports(history: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(report number, value) from (step, value): one report per distinct step (a resumed job may re-log one)."""
    seen: dict[int, float] = {}
    for step, value in history:
        seen.setdefault(step, value)
    return [(i + 1, seen[step]) for i, step in enumerate(sorted(seen))]


class Outcomes:
    """Reads a session's trials' jobs and runs: their outcome when they end, their history before a demotion."""

    def __init__(self, store: JobStore, tracker: Tracker, spec: ExperimentSpec, asha: ASHA):
        self.store = store
        self.tracker = tracker
        self.spec = spec
        self.asha = asha
        self.progress_metric = spec.progress_metric or spec.metric

    def record_end(self, t: Trial, early_stopping: bool) -> None:
        """A trial whose job will not run again: its outcome, its device time, its MLflow run closed.

        A job stopped or cancelled after its metric history reached the full budget (ASHA's SIGTERM or the
        session's end arrived after its last step) has finished: its final value counts like any other.
        """
        job = self.store.get(t.job_id)
        if self.spec.run is not None:  # a config-file experiment: its output lines' reports to its run first
            outputmetrics.sync(self.tracker, job, self.spec.metric)
        t.device_s = device_seconds(self.store, job)
        t.finished_at = job.finished_at
        value = None
        if job.state == "SUCCEEDED":
            value = self.tracker.final(t.run_id, self.spec.metric)
        elif t.run_id:
            value = completed_value(self.tracker, self.spec, t.run_id)
        if early_stopping and t.run_id and t.phase in (P.BASELINE, P.SEARCH) and value is not None:
            # A trial can finish between two looks; its rung values are what later trials meet there.
            history = self.tracker.history(t.run_id, self.progress_metric)
            t.rungs = {str(k): v for k, v in self.asha.rung_values(reports(history)).items()}
        if value is not None:
            t.update(status=S.SUCCEEDED, value=value, error="" if job.state == "SUCCEEDED" else
                     f"finished its full budget before it was stopped ({job.state.lower()})")
        elif job.state == "SUCCEEDED":
            t.update(status=S.FAILED, error=f"no {self.spec.metric} logged")
        elif job.state == "FAILED":
            t.update(status=S.FAILED, error=f"exit code {job.exit_code}: {job.reason}"[:300])
        else:
            t.status = S.STOPPED if t.stopped_at is not None else S.CANCELLED
        t.ended = True
        if t.run_id:
            self.tracker.finish(t.run_id, run_status(t.status))

    def stopped_with_session(self, t: Trial, session_id: str) -> bool:
        """Whether the trial's job was cancelled by a `stop` of its session before it finished its budget (it is
        then run again, not counted: `Trial.run_again`). A paused (demoted) trial stays stopped."""
        from orchestrator.agent.session import cancelled_by_stop

        if t.status not in (S.QUEUED, S.RUNNING) or t.job_id is None:
            return False
        if not cancelled_by_stop(self.store.get(t.job_id), session_id):
            return False
        return not t.run_id or completed_value(self.tracker, self.spec, t.run_id) is None

    def still_a_loser(self, t: Trial, rung: int, peers: list[Trial]) -> bool:
        """Re-read the trial's history just before demoting it (ASHA judged it a loser at `rung`).

        A trial that has reached its full budget is left to finish; one ahead of every baseline run at the
        rung is a candidate, not a loser; one whose latest report ranks in the top 1/eta at the rung is kept.
        """
        if self.spec.run is not None:
            outputmetrics.sync(self.tracker, self.store.get(t.job_id), self.spec.metric)
        raw = self.tracker.history(t.run_id, self.progress_metric)
        if not raw:
            return True
        total = self.total(t)
        if total is not None and raw[-1][0] >= total:
            return False
        history = reports(raw)
        t.rungs = {**t.rungs, **{str(k): v for k, v in self.asha.rung_values(history).items()}}
        key = str(rung)
        at_rung = [p.rungs[key] for p in peers if key in p.rungs]
        base = [p.rungs[key] for p in peers if p.phase is P.BASELINE and key in p.rungs]
        if base and self.spec.better(t.rungs[key], self.spec.direction.worst(base)):
            return False
        return not (history[-1][0] > rung and self.asha.keep(history[-1][1], at_rung))

    def total(self, t: Trial) -> int | None:
        """The trial's full budget in steps, as its job logged it (`total_steps`); None until it has."""
        if t.total is None:
            try:
                t.total = int(float(self.tracker.params(t.run_id).get("total_steps", "")))
            except ValueError:
                return None
        return t.total
