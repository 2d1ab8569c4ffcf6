"""The MLflow runs of queued jobs, as the queue records them: the tracked jobs that wait for a run made ahead
of time, the run each job got, and the runs the service made that are still open after their job ended.

A run the service made (`set_run_ids`) is open (`run_open_at`, the time it was recorded) until the service has
ended it in MLflow with its job's outcome (`runs_to_close`, `runs_closed`): a job that ends for good leaves no
run "running" in the MLflow UI, and neither does a job cancelled while it waited with its run made. A run the
submitter brought (`JobSpec.mlflow_run_id`: the agent's trials) is the submitter's to end and is never listed here.
"""

from __future__ import annotations

import time

from sqlalchemy import bindparam, select as core_select, text, update

from orchestrator.queue.db import Database
from orchestrator.queue.models import RETRYING_SQL, Job
from orchestrator.queue.rows import detached_jobs
from orchestrator.queue.states import FINISHED, JobState

S = JobState
JOBS = Job.__table__
_NEEDING_RUNS = (core_select(JOBS)
                 .where(JOBS.c.state == S.QUEUED.value, JOBS.c.gpus <= bindparam("capacity"), Job.needs_run_sql())
                 .order_by(JOBS.c.priority.desc(), JOBS.c.submitted_at, JOBS.c.id).limit(bindparam("limit")))
_SET_RUN = (update(JOBS).where(JOBS.c.id == bindparam("job_id"), JOBS.c.mlflow_run_id.is_(None))
            .values(mlflow_run_id=bindparam("run_id"), run_open_at=bindparam("now")))
# Through the partial index ix_jobs_runs_open (its condition spelled the same): the jobs with open runs are
# the few in line or running with their run made, plus those that ended since the last look.
_TO_CLOSE = (core_select(JOBS.c.id, JOBS.c.mlflow_run_id, JOBS.c.state, JOBS.c.finished_at)
             .where(JOBS.c.run_open_at.is_not(None), text(f"NOT ({RETRYING_SQL})"),
                    # `|| ''`: an expression, so SQLite does not read every finished job through ix_jobs_line
                    JOBS.c.state.concat("").in_([s.value for s in FINISHED]))
             .order_by(JOBS.c.finished_at).limit(bindparam("limit")))
_CLOSED = update(JOBS).where(JOBS.c.id.in_(bindparam("ids", expanding=True))).values(run_open_at=None)


class RunRecords:
    """The queue's side of the jobs' MLflow runs (made by the service's run preparer,
    `orchestrator.tracking.preparer`; `JobStore.runs`)."""

    def __init__(self, db: Database):
        self.db = db

    def needing_runs(self, *, capacity: int, limit: int) -> list[Job]:
        """The first `limit` QUEUED jobs in line order that need at most `capacity` devices, are tracked and
        have no MLflow run yet (the service makes their runs ahead of time). One cached Core statement, its rows
        made `Job`s as the ORM loads them (the ORM's loading was a third of the run preparer's CPU)."""
        with self.db.lone_read() as conn:
            return detached_jobs(conn.execute(_NEEDING_RUNS, {"capacity": capacity, "limit": limit}))

    def set_run_ids(self, runs: dict[int, str]) -> set[int]:
        """Record the MLflow run every attempt of each job logs to (set once, before the first claim), for many
        jobs in one commit; each run is open until `runs_closed`. Returns the ids of the jobs set: a job left
        out already had a run (another host prepared it first)."""
        done: set[int] = set()
        if not runs:
            return done
        now = time.time()
        with self.db.tx() as session:
            conn = session.connection()
            for job_id, run_id in runs.items():
                if conn.execute(_SET_RUN, {"job_id": job_id, "run_id": run_id, "now": now}).rowcount:
                    done.add(job_id)
        return done

    def runs_to_close(self, limit: int = 256) -> list[tuple[int, str, str, float]]:
        """Jobs finished for good whose run the service made and has not ended yet, the longest finished first:
        (job id, run id, state, finished_at)."""
        with self.db.lone_read() as conn:
            return [tuple(row) for row in conn.execute(_TO_CLOSE, {"limit": limit})]

    def runs_closed(self, job_ids: list[int]) -> None:
        """Note that these jobs' runs were ended in MLflow."""
        if job_ids:
            with self.db.tx() as session:
                session.connection().execute(_CLOSED, {"ids": list(job_ids)})
