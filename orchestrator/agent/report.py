"""What a session found, judged against its baseline: the summary dict and the Markdown report on its MLflow run.

The ranking and the verdict come from `orchestrator.tracking.client.leaderboard` over the session's own finished
trials (the baseline's runs included and marked), so a session's report and `autoresearch leaderboard` can
never disagree about what counts as a win.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from orchestrator.agent import tally
from orchestrator.queue.gpuuse import busy_share, share_text
from orchestrator.tracking.client import leaderboard

REPORT = "report.md"


def session_board(session_id: str, trials: Sequence[Mapping[str, Any]], direction: str,
                  defaults: Mapping[str, Any] | None = None, exact: bool = False) -> dict[str, Any]:
    """The leaderboard of one session's finished trials (baseline and selection runs marked)."""
    from orchestrator.agent.schedule import row_params

    rows = [{"params": row_params(t["params"], t.get("schedule")), "value": t["value"], "job_id": t["job_id"], "source": f"session {session_id}",
             "baseline": t["phase"] == "baseline", "selection": t["phase"] == "search"}
            for t in trials if t["status"] == "succeeded" and t.get("value") is not None]
    return leaderboard(rows, direction, defaults=defaults, exact=exact)


def summarise(session_id: str, config: Any, state: Mapping[str, Any], spec: Any, *, parallel: int,
              defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Counts, the baseline, the gated winner (None when nothing beat the baseline by more than the noise),
    the one-line verdict, the ranking and the cost."""
    trials = state["trials"]
    board = session_board(session_id, trials, spec.direction, defaults, exact=not getattr(spec, "seeded", True))
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    phases = tally.of_trials(trials, tally.planned(config.to_dict()))
    return {
        "session": session_id, "experiment": config.experiment, "proposer": config.proposer,
        "goal": config.goal, "stop_reason": state.get("stop_reason", ""), "trials": len(trials), "counts": counts,
        "phases": phases, "tally": tally.text(phases),
        "metric": spec.metric, "direction": spec.direction,
        "best": state.get("best"), "baseline": board["baseline"], "winner": board["winner"],
        "verdict": board["verdict"], "headline": board["headline"], "ranking": board["entries"][:20],
        "lead": board["lead"], "noise": board["noise"], "lead_within_noise": board["lead_within_noise"],
        "elapsed_s": round(state.get("elapsed", 0.0), 1),
        "device_seconds": round(sum(t.get("device_s", 0.0) for t in trials), 1),
        "usage": state.get("usage", {}), "parallel": parallel, "mlflow_run_id": state.get("parent_run"),
        "finished_at": time.time(),
    }


def gpu_use(store: Any, trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How busy the GPUs were while the session's trials held them (`orchestrator.queue.gpuuse.busy_share`):
    held and busy device-seconds and the report's line ("no GPU held" on cpu slots)."""
    held, busy = busy_share(store, [t["job_id"] for t in trials if t.get("job_id") is not None])
    return {"held_s": round(held, 1), "busy_s": round(busy, 1), "text": share_text(held, busy)}


def markdown(summary: Mapping[str, Any], top: int = 15) -> str:
    """The session report: the verdict, the baseline, the ranking (params as changes from the baseline)."""
    metric = summary["metric"]
    lines = [f"# Session {summary['session']}: {summary['experiment']}", "",
             f"**Goal:** {summary['goal']}  ", f"**Proposer:** {summary['proposer']}  ",
             f"**Ended:** {summary['stop_reason'] or 'done'} after {summary.get('tally') or summary['trials']}, "
             f"{summary['elapsed_s']} s, {summary['device_seconds']} device-seconds", "",
             *([f"**GPU:** {summary['gpu']['text']}", ""] if (summary.get("gpu") or {}).get("held_s") else []),
             "## Verdict", "", f"**{summary['headline']}**", ""]
    base = summary.get("baseline")
    if base:
        spread = "" if base["spread"] is None else f" ± {base['spread']:.4g}"
        lines += [f"Baseline (the experiment's defaults): {metric} {base['mean']:.4g}{spread} over {base['n']} "
                  f"seeds.", ""]
    verdict = summary.get("verdict")
    if verdict and verdict.get("exact"):
        lines += [f"Gate: {verdict['method']}. The experiment has no seed parameter and its re-runs came back "
                  "identical, so no confidence interval is computed: any difference is real.", ""]
    elif verdict:
        lines += [f"Gate: {verdict['method']}; a candidate wins only if the lower end of the CI of its "
                  "improvement is above zero, judged on its fresh-seed re-runs only (the search run that "
                  "selected it is left out).", ""]
    held = summary.get("holdout")
    if held:
        lines += [f"Holdout ({held['metric']}, data no search decision read, scored once at the end of each run): "
                  f"baseline {held['baseline_mean']:.4g} over {held['n_baseline']} runs, winner "
                  f"{held['winner_mean']:.4g} over its {held['n_winner']} fresh re-runs: {held['text']}.", ""]
        lines += [f"**Warning:** {w}." for w in held["warnings"]] + ([""] if held["warnings"] else [])
    lines += ["## Ranking", "", f"| # | {metric} mean | spread | n | gap to baseline | changes from the baseline |",
              "|---|---|---|---|---|---|"]
    for e in summary.get("ranking", [])[:top]:
        spread = "" if e["spread"] is None else f"{e['spread']:.3g}"
        gap = "" if e["gap"] is None else f"{e['gap']:+.4g}"
        what = "**baseline**" if e["baseline"] else (", ".join(f"{k}={_short(v)}" for k, v in e["diff"].items())
                                                     or "(same as the baseline)")
        mark = " (winner)" if e.get("winner") else ""
        lines.append(f"| {e['rank']}{mark} | {e['mean']:.4g} | {spread} | {e['n']} | {gap} | {what} |")
    lines += ["", "![best so far](best_so_far.png)", ""]
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
