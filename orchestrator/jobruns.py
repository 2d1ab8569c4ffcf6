"""MLflow runs of queued jobs: one run per job, shared by every attempt (Contract 3's MLFLOW_RUN_ID)."""

from __future__ import annotations

import threading
from pathlib import Path

from orchestrator.queue.models import Job

DEFAULT_EXPERIMENT = "jobs"


class JobRuns:
    """Creates each job's MLflow run in the experiment named after the job's experiment (or `jobs`)."""

    def __init__(self, tracking_uri: str, artifacts: Path):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.artifacts = Path(artifacts)
        self._experiments: dict[str, str] = {}
        self._lock = threading.Lock()

    def experiment_id(self, name: str) -> str:
        with self._lock:
            if name in self._experiments:
                return self._experiments[name]
            found = self.client.get_experiment_by_name(name)
            if found is None:
                try:
                    exp_id = self.client.create_experiment(name, artifact_location=(self.artifacts / name).as_uri())
                except Exception:  # another process created it first
                    found = self.client.get_experiment_by_name(name)
                    if found is None:
                        raise
                    exp_id = found.experiment_id
            else:
                exp_id = found.experiment_id
            self._experiments[name] = exp_id
            return exp_id

    def ensure_job_run(self, job: Job) -> str:
        """A new run for `job` tagged with its id, owner and experiment; returns the run id."""
        exp_id = self.experiment_id(job.experiment or DEFAULT_EXPERIMENT)
        tags = {"autoresearch.job_id": str(job.id), "autoresearch.owner": job.owner,
                "mlflow.runName": f"{job.name}-{job.id}"}
        if job.experiment:
            tags["autoresearch.experiment"] = job.experiment
        run = self.client.create_run(exp_id, tags=tags, run_name=f"{job.name}-{job.id}")
        if job.params:
            from mlflow.entities import Param

            self.client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in job.params.items()])
        return run.info.run_id
