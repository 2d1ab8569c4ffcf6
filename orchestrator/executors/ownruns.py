"""MLflow runs that a config-file job's script creates itself, beside the job's own run (`MLFLOW_RUN_ID`).

Loggers do not all honour MLFLOW_RUN_ID: Lightning's `MLFlowLogger` makes a run of its own unless given
`run_id`, and MLflow forgets the variable after its first `start_run`, so the Trainer's `evaluate()` after
`train()` opens a second run. Before the script starts, `context_env` marks every run it will create (MLflow
applies `MLFLOW_RUN_CONTEXT` tags to new runs, the fluent API's and Lightning's alike) and points new fluent runs
at the job's experiment (`MLFLOW_EXPERIMENT_ID`). When the script has ended, `adopt` copies the metrics of those
marked runs that the job's run lacks into it (so the agent, ASHA and the leaderboard find them where they look)
and deletes the marked runs (MLflow's soft delete): one run per job, no strays.

The default store (SQLite) is read with the standard library; MLflow is imported only when there is something
to copy.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field

from orchestrator.core.schemalock import sqlite_path

TAG = "autoresearch.job_run"  # on a run the job created: the job's own run id
CONTEXT_VAR, EXPERIMENT_VAR, RUN_VAR, URI_VAR = ("MLFLOW_RUN_CONTEXT", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID",
                                                 "MLFLOW_TRACKING_URI")


@dataclass
class Adopted:
    """What `adopt` found: the runs the job created (id, experiment name) and the metric names it copied."""

    runs: list[tuple[str, str]] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)


def _sqlite(env: dict[str, str]) -> str | None:
    return sqlite_path(env.get(URI_VAR, ""))


def context_env(env: dict[str, str]) -> dict[str, str]:
    """The variables to add to the script's environment (none without a job run)."""
    run_id = env.get(RUN_VAR)
    if not run_id:
        return {}
    try:
        context = json.loads(env.get(CONTEXT_VAR) or "{}")
    except ValueError:
        context = {}
    out = {CONTEXT_VAR: json.dumps({**(context if isinstance(context, dict) else {}), TAG: run_id})}
    path = _sqlite(env)
    if path and EXPERIMENT_VAR not in env:
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30) as db:
                row = db.execute("SELECT experiment_id FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
        except sqlite3.Error:
            row = None
        if row:
            out[EXPERIMENT_VAR] = str(row[0])
    return out


def _marked(env: dict[str, str]) -> list[str] | None:
    """Ids of the live runs marked as the job's (None: cannot tell without MLflow)."""
    path = _sqlite(env)
    if not path:
        return None
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30) as db:
            rows = db.execute("SELECT t.run_uuid FROM tags t JOIN runs r ON r.run_uuid = t.run_uuid WHERE t.key = ? "
                              "AND t.value = ? AND r.lifecycle_stage = 'active' AND t.run_uuid != ?",
                              (TAG, env[RUN_VAR], env[RUN_VAR])).fetchall()
    except sqlite3.Error:
        return None
    return [r[0] for r in rows]


def adopt(env: dict[str, str]) -> Adopted:
    """Copy into the job's run the metrics of the runs the job created that it lacks, then delete those runs."""
    found = Adopted()
    run_id = env.get(RUN_VAR)
    if not run_id or _marked(env) == []:
        return found
    try:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=env.get(URI_VAR) or None)
        exps = {e.experiment_id: e.name for e in client.search_experiments()}
        runs = client.search_runs(list(exps), f"tags.`{TAG}` = '{run_id}'") if exps else []
        have = set(client.get_run(run_id).data.metrics)
        for run in runs:
            if run.info.run_id == run_id:
                continue
            found.runs.append((run.info.run_id, exps.get(run.info.experiment_id, run.info.experiment_id)))
            for key in sorted(set(run.data.metrics) - have):
                history = client.get_metric_history(run.info.run_id, key)
                points = [Metric(key, m.value, m.timestamp, m.step) for m in history]
                for at in range(0, len(points), 1000):
                    client.log_batch(run_id, metrics=points[at:at + 1000])
                found.copied.append(key)
            have |= set(run.data.metrics)
            client.delete_run(run.info.run_id)
    except Exception as exc:  # noqa: BLE001 - the job's result must not depend on this tidying
        print(f"autoresearch: could not read the MLflow runs the job created: {exc}"[:300], flush=True)
    return found


def job_metrics(env: dict[str, str]) -> list[str]:
    """The metric names the job's run holds ([] when unknown), for a message that says where to look."""
    path, run_id = _sqlite(env), env.get(RUN_VAR)
    if not path or not run_id:
        return []
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30) as db:
            return [r[0] for r in db.execute("SELECT DISTINCT key FROM metrics WHERE run_uuid = ? ORDER BY key",
                                             (run_id,))]
    except sqlite3.Error:
        return []
