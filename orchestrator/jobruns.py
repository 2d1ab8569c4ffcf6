"""MLflow runs of queued jobs: one run per job, shared by every attempt (Contract 3's MLFLOW_RUN_ID)."""

from __future__ import annotations

from orchestrator.jobenv import image_tags
from orchestrator.queue.models import Job
from orchestrator.tracking import TAG_EXPERIMENT, TAG_JOB, Tracker

DEFAULT_EXPERIMENT = "jobs"


def ensure_job_run(tracker: Tracker, job: Job) -> str:
    """A new run for `job` in the MLflow experiment named after its experiment (or `jobs`), tagged with the
    job id, owner, experiment and container image (name and digest), its params logged; returns the run id."""
    exp_id = tracker.experiment_id(job.experiment or DEFAULT_EXPERIMENT)
    tags = {TAG_JOB: str(job.id), "autoresearch.owner": job.owner, "mlflow.runName": f"{job.name}-{job.id}"}
    if job.experiment:
        tags[TAG_EXPERIMENT] = job.experiment
    tags.update(image_tags(job))
    run = tracker.client.create_run(exp_id, tags=tags, run_name=f"{job.name}-{job.id}")
    if job.params:
        from mlflow.entities import Param

        tracker.client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in job.params.items()])
    return run.info.run_id


def discard_run(tracker: Tracker, run_id: str) -> None:
    """Delete a run made for a job that another host prepared first (so no empty run is left behind)."""
    try:
        tracker.client.delete_run(run_id)
    except Exception:  # best effort: an empty run tagged with the job is harmless
        pass
