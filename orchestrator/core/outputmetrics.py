"""Metric reports read from a job's output lines: written by the job's wrapper, logged to MLflow by the reader.

Every job-side wrapper that reads metric lines (a config-file experiment's, `orchestrator.executors.scriptjob`;
a program run's, `orchestrator.programs.wrap`) appends each report, `{"step": S, "value":
V}` a line, to `.autoresearch-metric.jsonl` in the job's checkpoint directory as the line appears: the
standard library only, so a job pays no MLflow import (seconds of CPU) for its metric. Whoever reads the job's
metric next (the agent watching its trials, a session judging them, the leaderboard for runs by hand) first
calls `sync`, which logs the reports MLflow does not have yet to the job's run, so ASHA, the UI and the
leaderboard all read MLflow as for any other job. A script that logs the metric to MLflow itself is left alone:
its run has the metric without this module's tag.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

FILE = ".autoresearch-metric.jsonl"
SOURCE_TAG = "autoresearch.metric_source"


def path(checkpoint_dir: str | os.PathLike) -> Path:
    """Where a job's output-line reports are kept."""
    return Path(checkpoint_dir) / FILE


def append(checkpoint_dir: str | os.PathLike, step: int, value: float) -> None:
    """Record one report (the job side; one short append per line, whole lines only)."""
    with open(path(checkpoint_dir), "a") as fh:
        fh.write(json.dumps({"step": int(step), "value": float(value)}) + "\n")


def read(checkpoint_dir: str | os.PathLike | None) -> list[tuple[int, float]]:
    """Every report recorded so far, in order ([] when none); a half-written last line is skipped."""
    if not checkpoint_dir:
        return []
    try:
        text = path(checkpoint_dir).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
            step, value = int(item["step"]), float(item["value"])
        except (ValueError, KeyError, TypeError):
            continue
        if math.isfinite(value):
            out.append((step, value))
    return out


def sync(tracker: Any, job: Any, metric: str) -> int:
    """Log the job's recorded reports that its MLflow run lacks (by step); how many were logged.

    Nothing is logged when the script logged `metric` to the run itself (the run has it, untagged).
    """
    run_id = getattr(job, "mlflow_run_id", None)
    reports = read(getattr(job, "checkpoint_dir", None))
    if not run_id or not reports:
        return 0
    history = tracker.history(run_id, metric)
    if history and tracker.tags(run_id).get(SOURCE_TAG) != "output":
        return 0
    if not history:
        tracker.set_tags(run_id, {SOURCE_TAG: "output"})
    have = {step for step, _ in history}
    latest: dict[int, float] = {}
    for step, value in reports:  # a step seen twice (a restarted attempt): its latest value
        if step not in have:
            latest[step] = value
    if not latest:
        return 0
    tracker.log_points(run_id, metric, sorted(latest.items()))
    return len(latest)
