"""A session's trials counted by phase against what it plans: the one count every view of a session shows.

A session runs the baseline (`baseline_seeds` runs, on top of `--trials`), search trials and confirmation re-runs
(both out of `--trials`: `SessionConfig.split`). A trial counts as done once its job has finished, whatever the
ending (a stopped or cancelled trial is done too); a trial recorded but never submitted has no job and is not
counted. The session's own output and report (from its trials), `sessions`, `top` and MCP `session_status` (from
the queue's jobs owned by the session, by their `phase`) all go through `count` and `text`, so they agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional

PHASES = ("baseline", "search", "confirm")
FINISHED = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


def planned(config: Mapping[str, Any]) -> dict[str, Optional[int]]:
    """Jobs a session plans per phase, from its recorded config (None where it sets no number: a time or
    target budget). A program session's `trials` counts every job; they are all shown as its search."""
    from orchestrator.agent.session import SessionConfig

    if "program" in config:
        trials = config.get("trials")
        return {"baseline": None, "search": None if trials is None else int(trials), "confirm": None}
    names = {f.name for f in dataclasses.fields(SessionConfig)} - {"goal", "experiment"}
    try:
        cfg = SessionConfig(goal="-", experiment="-", **{k: v for k, v in config.items() if k in names})
    except Exception:  # a config of an older or newer shape: a view shows what it can
        return {p: None for p in PHASES}
    search, confirm = cfg.split()
    return {"baseline": cfg.baseline_seeds, "search": search, "confirm": confirm}


def count(jobs: Iterable[tuple[Optional[str], str, int]], plan: Mapping[str, Optional[int]]
          ) -> dict[str, dict[str, Optional[int]]]:
    """{phase: {"done", "submitted", "planned"}} over (phase, job state, how many) rows; a job without a phase
    (a program session's) is a search trial."""
    out = {p: {"done": 0, "submitted": 0, "planned": plan.get(p)} for p in PHASES}
    for phase, state, n in jobs:
        row = out[phase if phase in out else "search"]
        row["submitted"] += n
        if state in FINISHED:
            row["done"] += n
    return out


def of_trials(trials: Iterable[Mapping[str, Any]], plan: Mapping[str, Optional[int]]) -> dict[str, dict]:
    """`count` over a session's checkpointed trials (those with a job; a final trial's job has finished)."""
    from orchestrator.agent.trial import TrialStatus

    return count(((t.get("phase"), "SUCCEEDED" if TrialStatus(t["status"]).final else "RUNNING", 1)
                  for t in trials if t.get("job_id") is not None), plan)


def text(counts: Mapping[str, Mapping[str, Optional[int]]], *, short: bool = False) -> str:
    """`baseline 3/3, search 2/3, confirm 0/1`: done of planned (of those submitted where no number is planned);
    a phase with nothing planned or submitted is left out. `short`: `b3/3 s2/3 c0/1`, for tables at 80 columns."""
    parts = []
    for phase in PHASES:
        row = counts.get(phase) or {}
        done, of = row.get("done") or 0, row.get("planned")
        if of is None:
            of = row.get("submitted") or 0
        if of or done:
            parts.append(f"{phase[0]}{done}/{of}" if short else f"{phase} {done}/{of}")
    return (" " if short else ", ").join(parts) or ("none yet" if short else "no trials yet")
