"""The holdout: a metric measured on data no search decision uses, read once, after the search.

Every trial of a session is chosen on the same validation split, so after many trials the winner's lead is
partly fitted to that split. An experiment that declares `holdout_metric` (the bundled ones score a test split
once, at the end of each run) gets a second figure: the winner's confirmation re-runs against the baseline's
runs on the holdout, with the same Welch interval as the gate.

Two rules keep the search blind to it, enforced by structure rather than by care:
- `SearchTracker` is the only tracker the search holds (the proposers' history, ASHA's rungs, the ranking and
  the gate all read through it). Its metric reads accept only the spec's `search_metrics` (the validation
  metric and the progress metric) and raise `HoldoutLeak` for anything else; it has no raw MLflow client.
- `attach` (below) is the only reader of the holdout metric. The runner calls it after the graph has ended,
  for the summary, and the leaderboard calls it for the winner and the baseline it shows; neither result
  flows back into a session.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping, MutableMapping, Sequence

from orchestrator.core.gate import gate

if TYPE_CHECKING:
    from experiments.registry import ExperimentSpec
    from orchestrator.tracking.client import Tracker

LEVEL = 0.95  # one candidate is judged on the holdout: no multiple-comparison correction is needed
HALF = 0.5  # a holdout lead under this share of the validation lead earns a warning


class HoldoutLeak(RuntimeError):
    """Code on the search's side asked for a metric the search must not read."""


class SearchTracker:
    """A `Tracker` as the search sees it: writes and tags pass through, metric reads only for search metrics.

    Explicit on purpose: each method the agent uses is listed, so nothing reaches MLflow's client (and every
    metric of a run) by accident.
    """

    _PASS = ("session_run", "trial_run", "find_trial", "params", "tags", "log_params", "set_tags", "log_metrics", "log_points",
             "finish", "log_text", "best_so_far_plot", "tracking_uri", "artifacts_dir")

    def __init__(self, tracker: Tracker, spec: ExperimentSpec):
        self._tracker = tracker
        self.allowed = spec.search_metrics
        self.holdout = spec.holdout_metric

    def _check(self, metric: str) -> None:
        if metric not in self.allowed:
            what = "the holdout metric" if metric == self.holdout else "a metric outside the search's"
            raise HoldoutLeak(f"the search may read {sorted(self.allowed)}, not {what} {metric!r}")

    def final(self, run_id: str, metric: str) -> float | None:
        """The latest value of a search metric (HoldoutLeak for any other)."""
        self._check(metric)
        return self._tracker.final(run_id, metric)

    def history(self, run_id: str, metric: str) -> list[tuple[int, float]]:
        """Every (step, value) of a search metric (HoldoutLeak for any other)."""
        self._check(metric)
        return self._tracker.history(run_id, metric)

    def system_metrics(self, run_id: str, names: Iterable[str]) -> dict[str, float | None]:
        """A run's resource metrics (`system/...`: memory, utilisation; never a result), for packing trials
        (HoldoutLeak for a name outside `system/`)."""
        out = {}
        for name in names:
            if not name.startswith("system/"):
                self._check(name)
            out[name] = self._tracker.final(run_id, name)
        return out

    def __getattr__(self, name: str) -> Any:
        if name in SearchTracker._PASS:
            return getattr(self._tracker, name)
        raise AttributeError(f"the search's tracker has no {name!r} (metric reads go through final/history)")


def search_view(tracker: Any, spec: ExperimentSpec) -> SearchTracker:
    """`tracker` wrapped for the search (a SearchTracker stays as it is)."""
    return tracker if isinstance(tracker, SearchTracker) else SearchTracker(tracker, spec)


def values(tracker: Tracker, spec: ExperimentSpec, run_ids: Iterable[str | None]) -> list[float]:
    """The holdout values of the given runs (runs that logged none are left out). The raw tracker: callers are
    the end-of-session report and the leaderboard, never the search."""
    if not spec.holdout_metric:
        return []
    out = []
    for run_id in run_ids:
        if run_id:
            value = tracker.final(run_id, spec.holdout_metric)
            if value is not None and math.isfinite(value):
                out.append(value)
    return out


def judge(spec: ExperimentSpec, baseline: Sequence[float], winner: Sequence[float],
          validation_delta: float | None) -> dict[str, Any] | None:
    """The winner against the baseline on the holdout: delta, 95% CI, the one-line text and its warnings; None
    when either side has no holdout value."""
    if not baseline or not winner:
        return None
    v = gate(baseline, winner, direction=spec.direction, level=LEVEL)
    warnings = []
    if not v.ci[0] > 0:
        warnings.append(f"the holdout does not confirm it: its {LEVEL * 100:g}% CI includes zero")
    if validation_delta is not None and v.delta < HALF * validation_delta:
        warnings.append("the holdout lead is less than half the validation lead: part of the gain may be "
                        "fitted to the validation split")
    return {"metric": spec.holdout_metric, "delta": v.delta, "ci": list(v.ci), "level": LEVEL,
            "baseline_mean": v.baseline_mean, "baseline_std": v.baseline_std, "n_baseline": v.n_baseline,
            "winner_mean": v.candidate_mean, "winner_std": v.candidate_std, "n_winner": v.n_candidate,
            "confirmed": v.ci[0] > 0, "warnings": warnings,
            "text": f"holdout {_signed(v.delta)} ({LEVEL * 100:g}% CI {_signed(v.ci[0])}..{_signed(v.ci[1])})"}


def headline(validation: str, holdout: Mapping[str, Any]) -> str:
    """`improvement +X (95% CI a..b) over baseline M ± s, N seeds on validation; holdout +Y (95% CI c..d)`:
    the validation verdict as the gate words it (its baseline and seeds kept), then the holdout's figure, then
    any warnings. A correction note in brackets (`[...]`) stays at the end of the validation part."""
    main, sep, note = validation.partition(" [")
    line = f"{main} on validation; {holdout['text']}" + (f" [{note}" if sep else "")
    return line + "".join(f". Warning: {w}" for w in holdout["warnings"])


def attach(board: MutableMapping[str, Any], spec: ExperimentSpec, tracker: Tracker,
           baseline_runs: Iterable[str | None], winner_runs: Iterable[str | None]) -> None:
    """Read the holdout of the baseline's runs and the winner's confirmation runs and add it to `board` (a
    leaderboard or a session summary: `holdout`, and the `headline` with both figures). Nothing is read when
    the experiment has no holdout or there is no winner."""
    board.setdefault("holdout", None)
    if not spec.holdout_metric or not board.get("winner") or not board.get("verdict"):
        return
    result = judge(spec, values(tracker, spec, baseline_runs), values(tracker, spec, winner_runs),
                   board["verdict"]["delta"])
    board["holdout"] = result
    if result is not None:
        board["headline"] = headline(board.get("headline") or "", result)


def session_runs(trials: Sequence[Mapping[str, Any]], winner: Mapping[str, Any] | None,
                 seed_keys: Sequence[str] = ("seed",)) -> tuple[list[str], list[str]]:
    """(the baseline's run ids, the winner's confirmation re-runs' ids) among a session's finished trials."""
    def config(params: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in params.items() if k not in seed_keys}

    done = [t for t in trials if t.get("status") == "succeeded" and t.get("run_id")]
    base = [t["run_id"] for t in done if t.get("phase") == "baseline"]
    if not winner:
        return base, []
    from orchestrator.agent.schedule import row_params  # a PBT winner is its schedule: its replays carry it

    want = config(winner["params"])
    return base, [t["run_id"] for t in done if t.get("phase") == "confirm"
                  and config(row_params(t["params"], t.get("schedule"))) == want]


def _signed(x: float) -> str:
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x:+.3g}"
