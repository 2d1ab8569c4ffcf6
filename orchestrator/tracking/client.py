"""MLflow bookkeeping: session parent runs, trial child runs, metric reads, the leaderboard and its plot.

Everything goes through one `MlflowClient` bound to this home's tracking URI (never the fluent, process-global
API), so the service, the agent and tests can each hold their own `Tracker` without stepping on each other.
Runs are found again by tags (`autoresearch.session`, `autoresearch.key`), which is what makes creating
them idempotent: a resumed session asks for the same run and gets the one it made before it was killed.

    tracker = Tracker.from_settings(Settings.load())
    parent = tracker.session_run("s-1a2b", "digits", {"goal": "...", "proposer": "tpe"})
    child = tracker.trial_run(parent, "digits", key="s-1a2b:3", name="trial 3", params={...}, tags={...})
    tracker.history(child, "val_loss")   # -> [(step, value), ...]
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from orchestrator.core.config import Settings
from orchestrator.core.direction import Direction
from orchestrator.tracking.store import open_client

log = logging.getLogger(__name__)

TAG_KIND = "autoresearch.kind"  # "session" or "trial"
TAG_SESSION = "autoresearch.session"
TAG_KEY = "autoresearch.key"  # a trial's idempotency key
TAG_EXPERIMENT = "autoresearch.experiment"
TAG_JOB = "autoresearch.job_id"
TAG_PHASE = "autoresearch.phase"  # a trial's phase: "baseline", "search" or "confirm"
PARENT = "mlflow.parentRunId"
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"  # what the MLflow 3 UI reads to pick an experiment's first page
TRAINING = "custom_model_development"  # its value for model-training experiments (runs table, not GenAI)
_MAX_TAG = 5000  # MLflow allows 8000; rationales longer than this are truncated, never rejected


_IMPORT_LOCK = threading.Lock()
OPEN = ("RUNNING", "SCHEDULED")  # a run in these states has not ended


def run_status(outcome: str) -> str:
    """The status a run ends with for a job's or a trial's outcome (either case): FINISHED for succeeded,
    FAILED for failed, KILLED for anything else (cancelled, stopped)."""
    return {"SUCCEEDED": "FINISHED", "FAILED": "FAILED"}.get(outcome.upper(), "KILLED")


def runs_page(base_url: str, experiment_id: str, search: str | None = None) -> str:
    """The MLflow UI address of an experiment's runs table, optionally filtered by a search. It names MLflow 3's
    model-training view (`workflowType=machine_learning`): without it the UI opens on its GenAI pages whatever
    the experiment's `mlflow.experimentKind` tag says (seen in headless Chromium)."""
    from urllib.parse import quote

    page = f"{base_url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    return page + (f"&searchFilter={quote(search)}" if search else "")


def import_mlflow():
    """The `mlflow` module, imported once per process under a lock. Two threads importing mlflow at once (the
    service's warm-up and the agent, in `autoresearch start`) can meet its package half-initialised and fail
    with a circular-import error; importing it here first, one thread at a time, avoids that."""
    with _IMPORT_LOCK:
        import mlflow

        return mlflow


class Tracker:
    """A thin, idempotent layer over `MlflowClient` for one tracking store."""

    def __init__(self, tracking_uri: str, artifacts_dir: Path | str | None = None):
        import_mlflow()  # heavy: imported only when a tracker is actually built
        self.tracking_uri = tracking_uri
        self.artifacts_dir = Path(artifacts_dir) if artifacts_dir else None
        # A new store is created whole, once, under a lock: several processes at once (`serve` and `start` on a
        # new home, a fleet on one PostgreSQL store) or one killed midway no longer break MLflow's migrations.
        self.client = open_client(tracking_uri, self.artifacts_dir)
        self._experiments: dict[str, str] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> "Tracker":
        """The tracker of a `Settings` home (its tracking URI, artifacts under the home)."""
        return cls(settings.tracking_uri, settings.artifacts_dir)

    # -- experiments and runs ------------------------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        """The MLflow experiment named `name`, created with its artifacts under this home if missing."""
        if name in self._experiments:
            return self._experiments[name]
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            # Without an explicit location MLflow puts artifacts in ./mlruns of whatever the cwd happens to be.
            location = (self.artifacts_dir / name).as_uri() if self.artifacts_dir else None
            try:
                exp_id = self.client.create_experiment(name, artifact_location=location)
            except Exception:  # another process created it between our get and create
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        if exp is None or exp.tags.get(TAG_EXPERIMENT_KIND) != TRAINING:
            # MLflow 3 opens an experiment without this tag on its GenAI overview; these are training runs.
            self.client.set_experiment_tag(exp_id, TAG_EXPERIMENT_KIND, TRAINING)
        self._experiments[name] = exp_id
        return exp_id

    def _find(self, experiment: str, filter_string: str) -> str | None:
        runs = self.client.search_runs([self.experiment_id(experiment)], filter_string, max_results=1)
        return runs[0].info.run_id if runs else None

    def session_run(self, session_id: str, experiment: str, params: Mapping[str, Any],
                    tags: Mapping[str, str] | None = None) -> str:
        """The parent run of agent session `session_id` (created on first call, found again afterwards)."""
        found = self._find(experiment, f"tags.`{TAG_SESSION}` = '{session_id}' and tags.`{TAG_KIND}` = 'session'")
        if found:
            return found
        run = self.client.create_run(
            self.experiment_id(experiment), run_name=f"session {session_id}",
            tags={TAG_KIND: "session", TAG_SESSION: session_id, TAG_EXPERIMENT: experiment, **(tags or {})})
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def trial_run(self, parent_run_id: str | None, experiment: str, *, key: str, name: str,
                  params: Mapping[str, Any], tags: Mapping[str, str] | None = None) -> str:
        """The child run of one trial, identified by its idempotency `key` (created once, then found)."""
        found = self.find_trial(experiment, key)
        if found:
            return found
        all_tags = {TAG_KIND: "trial", TAG_KEY: key, TAG_EXPERIMENT: experiment}
        if parent_run_id:
            all_tags[PARENT] = parent_run_id
        all_tags.update({k: _clip(v) for k, v in (tags or {}).items()})
        run = self.client.create_run(self.experiment_id(experiment), run_name=name, tags=all_tags)
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def find_trial(self, experiment: str, key: str) -> str | None:
        """The run made for trial `key`, if any."""
        return self._find(experiment, f"tags.`{TAG_KEY}` = '{key}'")

    def params(self, run_id: str) -> dict[str, str]:
        """A run's params (as the text MLflow stores)."""
        return dict(self.client.get_run(run_id).data.params)

    def tags(self, run_id: str) -> dict[str, str]:
        """A run's tags."""
        return dict(self.client.get_run(run_id).data.tags)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Log params (values as text, clipped to MLflow's limit)."""
        from mlflow.entities import Param

        from mlflow.exceptions import MlflowException

        items = [Param(str(k), _clip(v, 6000)) for k, v in params.items()]
        if items:
            try:
                self.client.log_batch(run_id, params=items)
            except MlflowException as exc:
                # Logging the same values again is accepted; a changed value is refused, and a resumed caller
                # keeps the run's first (the run records what it started with). Anything else is an error.
                if exc.error_code != "INVALID_PARAMETER_VALUE":
                    raise
                log.warning("run %s keeps its logged params: %s", run_id, str(exc).splitlines()[0][:200])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Set tags on a run (values clipped)."""
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(str(k), _clip(v)) for k, v in tags.items()])

    def log_points(self, run_id: str, metric: str, points: Iterable[tuple[int, float]]) -> None:
        """Log one metric at several steps ((step, value) pairs) in one batch."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(metric, float(v), now, int(s)) for s, v in points]
        if items:
            self.client.log_batch(run_id, metrics=items)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        """Log several metrics at one step."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step)) for k, v in metrics.items() if v is not None]
        if items:
            self.client.log_batch(run_id, metrics=items)

    def finish(self, run_id: str, status: str = "FINISHED", end_time: int | None = None) -> None:
        """Mark a run finished (FINISHED, FAILED or KILLED; at `end_time` ms, else now) unless it already is."""
        run = self.client.get_run(run_id)
        if run.info.status in OPEN:
            self.client.set_terminated(run_id, status=status, end_time=end_time)

    # -- reads -----------------------------------------------------------------------------------------------------

    def history(self, run_id: str, metric: str) -> list[tuple[int, float]]:
        """Every (step, value) of `metric` in run `run_id`, by step."""
        points = self.client.get_metric_history(run_id, metric)
        return sorted((int(m.step), float(m.value)) for m in points)

    def final(self, run_id: str, metric: str) -> float | None:
        """The latest value of `metric` in `run_id`, or None when it was never logged."""
        value = self.client.get_run(run_id).data.metrics.get(metric)
        return None if value is None or not math.isfinite(value) else float(value)

    def experiments(self, limit: int) -> list[Any]:
        """The store's `limit` newest active experiments that hold runs (MLflow's `Default` only when used)."""
        found = []
        for exp in self.client.search_experiments(order_by=["creation_time DESC"]):
            if len(found) == limit:
                break
            if self.client.search_runs([exp.experiment_id], max_results=1):
                found.append(exp)
        return found

    def session_runs(self) -> list[Any]:
        """Every session parent run in the store, newest first."""
        exps = [e.experiment_id for e in self.client.search_experiments()]
        if not exps:
            return []
        return list(self.client.search_runs(exps, f"tags.`{TAG_KIND}` = 'session'", order_by=["start_time DESC"]))

    # -- artifacts -------------------------------------------------------------------------------------------------

    def log_text(self, run_id: str, text: str, name: str) -> None:
        """Log `text` as the artifact `name` of a run (e.g. the session's report.md)."""
        self.client.log_text(run_id, text, name)

    def best_so_far_plot(self, run_id: str, values: Sequence[float | None], direction: str, metric: str) -> None:
        """Log `best_so_far.png`: each trial's metric and the running best, by trial number."""
        import matplotlib

        matplotlib.use("Agg")  # no display on a server; must come before pyplot
        import matplotlib.pyplot as plt

        best = best_so_far(values, direction)
        xs = list(range(1, len(values) + 1))
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if pts:
            ax.scatter(*zip(*pts), s=14, alpha=0.6, label="trial")
        line = [(x, b) for x, b in zip(xs, best) if b is not None]
        if line:
            ax.step(*zip(*line), where="post", color="C3", label="best so far")
        ax.set_xlabel("trial")
        ax.set_ylabel(metric)
        if pts or line:
            ax.legend(loc="best")
        fig.tight_layout()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "best_so_far.png"
            fig.savefig(path)
            plt.close(fig)
            self.client.log_artifact(run_id, str(path))


def _clip(value: Any, limit: int = _MAX_TAG) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def best_so_far(values: Iterable[float | None], direction: str) -> list[float | None]:
    """The running best of `values` (None entries, failed trials, keep the previous best)."""
    out: list[float | None] = []
    best: float | None = None
    for v in values:
        if v is not None and (best is None or Direction.of(direction).better(v, best)):
            best = v
        out.append(best)
    return out


# -- the leaderboard ---------------------------------------------------------------------------------------------

@dataclass
class Entry:
    """One configuration on the leaderboard: every finished run of the same params (seeds pooled)."""

    params: dict[str, Any]
    values: list[float]
    sources: list[str] = field(default_factory=list)  # "job 12 (session s-ab)" / "job 7 (by hand)"
    job_ids: list[int] = field(default_factory=list)
    baseline_runs: int = 0  # how many of its runs were a session's baseline
    fresh: list[float] = field(default_factory=list)  # the values of runs that played no part in selecting it
    fresh_jobs: list[int] = field(default_factory=list)  # the jobs of those runs (the holdout reads them)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def spread(self) -> float | None:
        """Sample standard deviation over seeds; None from a single run (the noise is unknown)."""
        return statistics.stdev(self.values) if self.n > 1 else None


NO_IMPROVEMENT = "no improvement over the baseline found"


def leaderboard(rows: Iterable[Mapping[str, Any]], direction: str, seed_keys: Sequence[str] = ("seed",),
                defaults: Mapping[str, Any] | None = None, alpha: float = 0.05, exact: bool = False) -> dict:
    """Rank configurations by mean metric over seeds and judge the confirmed ones against the baseline.

    `rows` have `params`, `value` and optionally `job_id`, `source`, `baseline` (the run was a session's
    baseline) and `selection` (a session's search-phase run: the run that made the configuration a candidate).
    Runs differing only in a seed key are the same configuration. The baseline is the configuration with the
    most baseline runs; each entry gets its `gap` to the baseline's mean (positive = better) and `diff`, its
    params that differ from the baseline's (from `defaults` when there is no baseline).

    Ranking uses every run; the gate does not. A selection run is the best of many draws, so pooling it with a
    candidate's re-runs biases the candidate's mean upward (the winner's curse): the gate
    (`orchestrator.core.gate`, Welch's t-test) judges each configuration on its other runs only (fresh-seed
    confirmation re-runs, other sessions' confirmations, runs by hand). Only confirmed candidates, those with
    at least 2 such runs, are gated, and since k of them are tested at once the level is Bonferroni-corrected
    to 1 - alpha/k (97.5% CIs for two candidates), so the chance that any of them is called a win by noise
    stays at most `alpha`. The winner is the best-ranked candidate that passes; `headline` says so in words,
    or that none was found. `lead_within_noise` (kept for scripts) compares the top two: None when neither was
    run twice. `exact`: the experiment has no seed parameter, so a configuration's runs repeat it exactly, and
    identical runs on both sides are judged as showing no noise (`gate`'s `exact`).
    """
    from orchestrator.core.gate import gate

    groups: dict[str, Entry] = {}
    for row in rows:
        if row.get("value") is None:
            continue
        params = {k: v for k, v in dict(row["params"]).items() if k not in seed_keys}
        key = repr(sorted((k, repr(v)) for k, v in params.items()))
        entry = groups.setdefault(key, Entry(params=params, values=[]))
        entry.values.append(float(row["value"]))
        if not row.get("selection"):
            entry.fresh.append(float(row["value"]))
            if row.get("job_id") is not None:
                entry.fresh_jobs.append(int(row["job_id"]))
        entry.baseline_runs += bool(row.get("baseline"))
        if row.get("source"):
            entry.sources.append(str(row["source"]))
        if row.get("job_id") is not None:
            entry.job_ids.append(int(row["job_id"]))
    d = Direction.of(direction)
    entries = sorted(groups.values(), key=lambda e: (d.key(e.mean), -e.n))
    base = max((e for e in entries if e.baseline_runs), key=lambda e: (e.baseline_runs, e.n), default=None)
    lead = noise = None
    within: bool | None = None
    if len(entries) >= 2:
        lead = abs(entries[0].mean - entries[1].mean)
        spreads = [s for s in (entries[0].spread, entries[1].spread) if s is not None]
        if spreads:
            noise = max(spreads)
            within = lead < noise
    reference = base.params if base is not None else dict(defaults or {})
    winner = verdict = best_tried = None
    confirmed = [] if base is None or not base.fresh else [e for e in entries if e is not base and len(e.fresh) >= 2]
    k = len(confirmed)
    for e in confirmed:
        v = gate(base.fresh, e.fresh, direction=direction, level=1.0 - alpha / k, exact=exact)
        if k > 1:
            v = dataclasses.replace(v, method=f"{v.method}, Bonferroni-corrected for {k} candidates")
        if best_tried is None:
            best_tried = v
        if v.win:
            winner, verdict = e, v
            break
    correction = f" [{k} candidates gated, Bonferroni: {(1 - alpha / k) * 100:g}% CIs]" if k > 1 else ""
    if base is None:
        headline = "no baseline measured: no result can be called an improvement"
    elif verdict is not None:
        headline = verdict.describe() + correction
    else:
        headline = NO_IMPROVEMENT + (f" (best re-run candidate: {best_tried.describe().split('(', 1)[1]}"
                                     f"{correction}" if best_tried is not None
                                     else " (no candidate was re-run on 2 or more fresh seeds)")
    out_entries = []
    for i, e in enumerate(entries):
        out_entries.append({
            "rank": i + 1, "params": e.params, "diff": _diff(e.params, reference), "n": e.n, "mean": e.mean,
            "spread": e.spread, "best": d.best(e.values), "values": e.values,
            "gap": None if base is None else d.score(e.mean - base.mean), "baseline": e is base,
            "winner": e is winner, "job_ids": e.job_ids, "sources": sorted(set(e.sources)),
            "n_fresh": len(e.fresh), "gated": any(e is c for c in confirmed)})
    summary = (lambda e: None if e is None else {"params": e.params, "n": e.n, "mean": e.mean, "spread": e.spread,
                                                 "values": e.values, "job_ids": e.job_ids, "fresh": e.fresh,
                                                 "fresh_jobs": e.fresh_jobs})
    return {
        "direction": direction,
        "entries": out_entries,
        "baseline": summary(base),
        "winner": summary(winner),
        "verdict": None if verdict is None else {**dataclasses.asdict(verdict), "text": verdict.describe()},
        "headline": headline,
        "gated": k,
        "lead": lead,
        "noise": noise,
        "lead_within_noise": within,
    }


def _diff(params: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
    """The params that differ from (or are missing in) `reference`."""
    return {k: v for k, v in params.items() if k not in reference or reference[k] != v}
