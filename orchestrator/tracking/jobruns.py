"""MLflow runs of queued jobs: one run per job, shared by every attempt (the job protocol's MLFLOW_RUN_ID).

A run is described by a plain request (`run_request`: what the service knows about the job, JSON-ready) and
made from it by `create_run` in the process that holds the MLflow client (the tracking worker,
`orchestrator.tracking.worker`), so the service itself never imports MLflow.

`create_runs` makes a batch. On a database-backed store (SQLite, PostgreSQL, MySQL: MLflow's
`SqlAlchemyStore`) it writes the runs in transactions of MLflow's own session, `RUNS_PER_COMMIT` runs in the
first and twice as many in each next one up to `MAX_RUNS_PER_COMMIT` (the first jobs of a burst get their runs
soon, the rest cheaply), with MLflow's own table models and validation, the same rows `MlflowClient.create_run`
and `log_batch` write (a test compares them): `create_run` re-reads the experiment, commits and builds the
returned run's inputs for every run, many times the CPU a run costs here (`benchmarks/run_creation.py`; the
figures in benchmarks/RESULTS.md). Anything else (an MLflow server over HTTP, a store whose models no longer
take these columns, an inactive experiment) takes the client's path, one run at a time, with MLflow's own errors.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Iterator, Optional, Sequence

from orchestrator.queue.models import Job
from orchestrator.tracking.client import OPEN, TAG_EXPERIMENT, TAG_JOB, Tracker

DEFAULT_EXPERIMENT = "jobs"
RUNS_PER_COMMIT = 8  # runs in a batch's first transaction: its first job waits for the others to be written
MAX_RUNS_PER_COMMIT = 32  # ... doubling up to this: bigger transactions cost less CPU a run (benchmarks/RESULTS.md)
log = logging.getLogger(__name__)


TAG_IMAGE = "autoresearch.image"
TAG_IMAGE_DIGEST = "autoresearch.image_digest"


def image_tags(job) -> dict[str, str]:
    """MLflow tags naming the environment a result came from: the image as given and the content id that
    ran (empty for a job in the service's own environment). `job`: a Job or a JobSpec."""
    if not getattr(job, "image", None):
        return {}
    return {TAG_IMAGE: job.image, TAG_IMAGE_DIGEST: job.image_id or ""}


def run_request(job: Job) -> dict[str, Any]:
    """What the run of `job` is made of: its MLflow experiment (the job's experiment or `jobs`), run name,
    tags (job id, owner, project, experiment, container image name and digest) and params (as text, clipped)."""
    name = f"{job.name}-{job.id}"
    tags = {TAG_JOB: str(job.id), "autoresearch.owner": job.owner, "mlflow.runName": name,
            "autoresearch.project": getattr(job, "project", None) or "default"}
    if job.experiment:
        tags[TAG_EXPERIMENT] = job.experiment
    tags.update(image_tags(job))
    params = {str(k): str(v)[:6000] for k, v in (job.params or {}).items()}
    return {"id": job.id, "experiment": job.experiment or DEFAULT_EXPERIMENT, "name": name, "tags": tags,
            "params": params, "submitted": int(job.submitted_at * 1000)}


def create_run(tracker: Tracker, request: dict[str, Any]) -> str:
    """Make the run a `run_request` describes, its params logged; returns the run id. Params MLflow would
    refuse fail before the run is made (no empty run is left behind)."""
    _checked_params(request)
    run = tracker.client.create_run(tracker.experiment_id(request["experiment"]), tags=request["tags"],
                                    run_name=request["name"])
    if request["params"]:
        from mlflow.entities import Param

        tracker.client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in request["params"].items()])
    return run.info.run_id


def create_runs(tracker: Tracker, requests: Sequence[dict[str, Any]], *,
                adopt: bool = False) -> Iterator[tuple[int, str]]:
    """Make the runs of `requests` in order, yielding `(job id, run id)` as each is committed. Raises at the
    first run that cannot be made (MLflow's error); the runs before it are made, those after it are not.

    `adopt`: first look for runs already made for these jobs and not recorded by the queue (a worker killed,
    or a service killed, between the commit of a run and its answer); those are answered instead of being
    made twice (`made_runs`)."""
    store = _sql_store(tracker)
    if adopt:
        found = made_runs(tracker, store, requests)
        yield from found.items()
        requests = [request for request in requests if request["id"] not in found]
    size, start = (RUNS_PER_COMMIT if store is not None else 1), 0
    while start < len(requests):
        chunk = requests[start:start + size]
        start += len(chunk)
        run_ids = None
        if store is not None:
            try:
                run_ids = _insert_runs(tracker, store, chunk)
            except Exception as exc:  # nothing of the chunk was committed: the client's path says why, or makes them
                log.debug("batched runs fell back to MlflowClient.create_run: %s", exc)
        if run_ids is None:
            run_ids = (create_run(tracker, request) for request in chunk)  # made one by one as they are taken
        yield from zip((request["id"] for request in chunk), run_ids)
        if store is not None:
            size = min(2 * size, MAX_RUNS_PER_COMMIT)


ADOPT_SKEW_MS = 60_000  # a run made up to this long before its job's submission time (another host's clock) is its


def made_runs(tracker: Tracker, store: Optional[Any], requests: Sequence[dict[str, Any]]) -> dict[int, str]:
    """The runs already made for `requests`' jobs: open, tagged with the job's id, named as `run_request` names
    them, in the job's experiment and started after the job was submitted (so a run of an earlier queue whose
    job ids are reused is never taken). One query on a database store, one search per job elsewhere."""
    wanted = {str(request["id"]): request for request in requests}
    if not wanted:
        return {}

    def fits(request: dict[str, Any], name: str, experiment_id: str, start_ms: int) -> bool:
        return (name == request["name"] and str(experiment_id) == str(tracker.experiment_id(request["experiment"]))
                and start_ms >= request.get("submitted", 0) - ADOPT_SKEW_MS)

    found: dict[int, str] = {}
    if store is not None:
        from mlflow.entities import LifecycleStage
        from mlflow.store.tracking.dbmodels.models import SqlRun, SqlTag

        with store.ManagedSessionMaker() as session:
            rows = (session.query(SqlTag.value, SqlRun.run_uuid, SqlRun.name, SqlRun.experiment_id, SqlRun.start_time)
                    .join(SqlRun, SqlRun.run_uuid == SqlTag.run_uuid)
                    .filter(SqlTag.key == TAG_JOB, SqlTag.value.in_(list(wanted)), SqlRun.status.in_(OPEN),
                            SqlRun.lifecycle_stage == LifecycleStage.ACTIVE)
                    .order_by(SqlRun.start_time).all())
        for job, run_id, name, experiment_id, start_ms in rows:
            if int(job) not in found and fits(wanted[job], name, experiment_id, start_ms or 0):
                found[int(job)] = run_id
        return found
    for job, request in wanted.items():
        for run in tracker.client.search_runs([tracker.experiment_id(request["experiment"])],
                                              f"tags.`{TAG_JOB}` = '{job}'", order_by=["attributes.start_time"]):
            if run.info.status in OPEN and fits(request, run.info.run_name, run.info.experiment_id,
                                                run.info.start_time or 0):
                found[int(job)] = run.info.run_id
                break
    return found


def _checked_params(request: dict[str, Any]) -> list[Any]:
    """The request's params as MLflow's `log_batch` takes them (values clipped to its limit); raises MLflow's
    error for a key it refuses."""
    from mlflow.entities import Param

    params = [Param(k, v) for k, v in request["params"].items()]
    try:
        from mlflow.utils.validation import _validate_batch_log_data, _validate_param_keys_unique
    except ImportError:  # another MLflow: its log_batch still checks them
        return params
    checked = _validate_batch_log_data([], params, [])  # older MLflow returns nothing (and clips nothing)
    params = checked[1] if checked is not None else params
    _validate_param_keys_unique(params)
    return params


def _sql_store(tracker: Tracker) -> Optional[Any]:
    """The tracker's MLflow store when it is a database (`SqlAlchemyStore`), else None."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = getattr(getattr(tracker.client, "_tracking_client", None), "store", None)
    return store if isinstance(store, SqlAlchemyStore) else None


def _insert_runs(tracker: Tracker, store: Any, requests: Sequence[dict[str, Any]]) -> list[str]:
    """Write the runs of `requests` in one transaction, as `create_run` plus `log_batch` of the params would
    (status RUNNING, user `unknown`, artifacts under the experiment's location); returns their ids. The rows
    go in as three multi-row inserts through MLflow's models (the ORM's unit of work per run cost more than
    the rest of the run), and each experiment is read once, in the same session."""
    from mlflow.entities import LifecycleStage, RunStatus, SourceType, ViewType
    from mlflow.store.tracking.dbmodels.models import SqlParam, SqlRun, SqlTag
    from mlflow.utils.time import get_current_time_millis
    from mlflow.utils.uri import append_to_uri_path
    from sqlalchemy import insert

    checked = [(request, _checked_params(request), tracker.experiment_id(request["experiment"]))
               for request in requests]
    runs: list[dict[str, Any]] = []
    tags: list[dict[str, Any]] = []
    params: list[dict[str, Any]] = []
    with store.ManagedSessionMaker() as session:
        locations: dict[str, str] = {}
        for request, checked_params, experiment_id in checked:
            if experiment_id not in locations:
                experiment = store._get_experiment(session, experiment_id, ViewType.ALL)
                if experiment.lifecycle_stage != LifecycleStage.ACTIVE:
                    raise ValueError(f"experiment {experiment_id} is not active")  # the client's path says so
                locations[experiment_id] = experiment.artifact_location
            if request["tags"].get("mlflow.runName", request["name"]) != request["name"]:
                raise ValueError("the run name and the mlflow.runName tag differ")  # the client's path says so
            run_id = uuid.uuid4().hex
            runs.append(dict(
                name=request["name"], run_uuid=run_id, experiment_id=int(experiment_id),
                artifact_uri=append_to_uri_path(locations[experiment_id], run_id, store.ARTIFACTS_FOLDER_NAME),
                source_type=SourceType.to_string(SourceType.UNKNOWN), source_name="", entry_point_name="",
                user_id=request["tags"].get("mlflow.user", "unknown"), status=RunStatus.to_string(RunStatus.RUNNING),
                start_time=get_current_time_millis(), end_time=None, deleted_time=None, source_version="",
                lifecycle_stage=LifecycleStage.ACTIVE))
            tags.extend(dict(key=key, value=value, run_uuid=run_id)
                        for key, value in {"mlflow.runName": request["name"], **request["tags"]}.items())
            params.extend(dict(key=param.key, value=param.value, run_uuid=run_id) for param in checked_params)
        session.execute(insert(SqlRun), runs)
        session.execute(insert(SqlTag), tags)
        if params:
            session.execute(insert(SqlParam), params)
    return [run["run_uuid"] for run in runs]


def end_runs(tracker: Tracker, ends: Sequence[dict[str, Any]]) -> None:
    """End the runs of jobs that ended for good: each `{"run": run id, "status": FINISHED | FAILED | KILLED,
    "end": end time in ms}`. A run already ended (by its job or its submitter) is left as it is. On a database
    store, one transaction of MLflow's own models; elsewhere, `Tracker.finish` each."""
    store = _sql_store(tracker)
    if store is not None:
        try:
            _update_runs(store, ends)
            return
        except Exception as exc:  # nothing was committed: the client's path says why, or ends them
            log.debug("batched run ends fell back to MlflowClient.set_terminated: %s", exc)
    for end in ends:
        try:
            tracker.finish(end["run"], end["status"], end["end"])
        except Exception as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                raise  # a store that is down: the ends are asked for again
            log.debug("run %s not ended: it does not exist", end["run"])  # deleted: nothing to end


def log_run_metrics(tracker: Tracker, runs: Sequence[dict[str, Any]]) -> None:
    """Log `{"run": run id, "metrics": {name: value}}` on each run (a finished run takes metrics too). A run
    that was deleted is skipped; a store that is down raises (the service asks again later)."""
    for item in runs:
        try:
            tracker.log_metrics(item["run"], item["metrics"])
        except Exception as exc:
            if getattr(exc, "error_code", "") not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            log.debug("metrics not logged on run %s (deleted): %s", item["run"], exc)


def _update_runs(store: Any, ends: Sequence[dict[str, Any]]) -> None:
    from mlflow.entities import RunStatus
    from mlflow.store.tracking.dbmodels.models import SqlRun

    by_id = {end["run"]: end for end in ends}
    for status in {end["status"] for end in ends}:
        RunStatus.from_string(status)  # MLflow's own check of the name
    with store.ManagedSessionMaker() as session:
        for run in session.query(SqlRun).filter(SqlRun.run_uuid.in_(list(by_id)), SqlRun.status.in_(OPEN)):
            run.status = by_id[run.run_uuid]["status"]
            run.end_time = by_id[run.run_uuid]["end"]


def ensure_job_run(tracker: Tracker, job: Job) -> str:
    """A new run for `job` (see `run_request`), made in this process; returns the run id."""
    return create_run(tracker, run_request(job))


def discard_run(tracker: Tracker, run_id: str) -> None:
    """Delete a run made for a job that another host prepared first (so no empty run is left behind)."""
    try:
        tracker.client.delete_run(run_id)
    except Exception:  # best effort: an empty run tagged with the job is harmless
        pass
