"""MLflow runs of queued jobs: one run per job, shared by every attempt (Contract 3's MLFLOW_RUN_ID).

A run is described by a plain request (`run_request`: what the service knows about the job, JSON-ready) and
made from it by `create_run` in the process that holds the MLflow client (the tracking worker,
`orchestrator.trackworker`), so the service itself never imports MLflow.
"""

from __future__ import annotations

from typing import Any

from orchestrator.jobenv import image_tags
from orchestrator.queue.models import Job
from orchestrator.tracking import TAG_EXPERIMENT, TAG_JOB, Tracker

DEFAULT_EXPERIMENT = "jobs"


def run_request(job: Job) -> dict[str, Any]:
    """What the run of `job` is made of: its MLflow experiment (the job's experiment or `jobs`), run name,
    tags (job id, owner, experiment, container image name and digest) and params (as text, clipped)."""
    name = f"{job.name}-{job.id}"
    tags = {TAG_JOB: str(job.id), "autoresearch.owner": job.owner, "mlflow.runName": name}
    if job.experiment:
        tags[TAG_EXPERIMENT] = job.experiment
    tags.update(image_tags(job))
    params = {str(k): str(v)[:6000] for k, v in (job.params or {}).items()}
    return {"id": job.id, "experiment": job.experiment or DEFAULT_EXPERIMENT, "name": name, "tags": tags,
            "params": params}


def create_run(tracker: Tracker, request: dict[str, Any]) -> str:
    """Make the run a `run_request` describes, its params logged; returns the run id."""
    run = tracker.client.create_run(tracker.experiment_id(request["experiment"]), tags=request["tags"],
                                    run_name=request["name"])
    if request["params"]:
        from mlflow.entities import Param

        tracker.client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in request["params"].items()])
    return run.info.run_id


def ensure_job_run(tracker: Tracker, job: Job) -> str:
    """A new run for `job` (see `run_request`), made in this process; returns the run id."""
    return create_run(tracker, run_request(job))


def discard_run(tracker: Tracker, run_id: str) -> None:
    """Delete a run made for a job that another host prepared first (so no empty run is left behind)."""
    try:
        tracker.client.delete_run(run_id)
    except Exception:  # best effort: an empty run tagged with the job is harmless
        pass
