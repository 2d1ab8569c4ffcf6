"""The runs of queued jobs, made a batch per transaction (`orchestrator.tracking.jobruns.create_runs`), are the runs
`MlflowClient.create_run` and `log_batch` make: same fields, tags and params, found by the same searches,
resumable by the job's runtime; a run that cannot be made fails at that job with MLflow's own error. Runs end
with their jobs, and the queue (SQLite and PostgreSQL) lists exactly the runs still to end."""

from __future__ import annotations

import pytest

from orchestrator.tracking import jobruns
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.tracking.client import Tracker


def request(job_id: int, experiment: str = "jobs", **params) -> dict:
    name = f"noop-{job_id}"
    return {"id": job_id, "experiment": experiment, "name": name,
            "tags": {"autoresearch.job_id": str(job_id), "autoresearch.owner": "ana", "mlflow.runName": name},
            "params": {k: str(v) for k, v in params.items()}}


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """One store for the module (making one costs a second of migrations); each test has its experiments."""
    root = tmp_path_factory.mktemp("jobruns")
    return Tracker(f"sqlite:///{root}/mlflow.db", root / "artifacts")


def comparable(tracker: Tracker, run_id: str) -> dict:
    run = tracker.client.get_run(run_id)
    info = dict(vars(run.info))
    info = {k.lstrip("_"): v for k, v in info.items() if k.lstrip("_") not in ("run_id", "run_uuid", "start_time")}
    info["artifact_uri"] = info["artifact_uri"].replace(run_id, "<id>")
    return {"info": info, "tags": run.data.tags, "params": run.data.params, "metrics": run.data.metrics,
            "inputs": run.inputs.dataset_inputs}


def test_batched_runs_are_the_runs_the_client_makes(tracker):
    requests = [request(i, "same" if i % 3 else "other", lr=0.1 * i, note="a b/c") for i in range(1, 12)]
    made = list(jobruns.create_runs(tracker, requests))
    assert [job_id for job_id, _ in made] == [r["id"] for r in requests]  # in order, every one
    assert len({run_id for _, run_id in made}) == len(requests)
    assert jobruns._sql_store(tracker) is not None  # the batched path was the one taken
    found = tracker.client.search_runs([tracker.experiment_id("same")], "tags.`autoresearch.job_id` = '4'")
    assert [r.info.run_id for r in found] == [dict(made)[4]]
    for (job_id, run_id), req in zip(made, requests):
        by_client = jobruns.create_run(tracker, req)
        assert comparable(tracker, run_id) == comparable(tracker, by_client)
        assert tracker.client.get_run(run_id).info.experiment_id == tracker.experiment_id(req["experiment"])
    # The job's side of the job protocol: it logs into its run and ends it.
    run_id = dict(made)[2]
    tracker.client.log_metric(run_id, "loss", 0.5, step=1)
    tracker.client.set_terminated(run_id, "FINISHED")
    run = tracker.client.get_run(run_id)
    assert (run.info.status, run.data.metrics) == ("FINISHED", {"loss": 0.5})


def test_a_run_that_cannot_be_made_fails_at_its_job_and_keeps_the_runs_before_it(tracker):
    requests = [request(i, "partial") for i in range(1, 6)] + [{**request(6, "partial"), "params": {"bad*key": "1"}},
                                                              request(7, "partial")]
    made = []
    with pytest.raises(Exception, match="bad\\*key"):
        for job_id, run_id in jobruns.create_runs(tracker, requests):
            made.append(job_id)
    assert made == [1, 2, 3, 4, 5]
    runs = tracker.client.search_runs([tracker.experiment_id("partial")])
    assert sorted(int(r.data.tags["autoresearch.job_id"]) for r in runs) == [1, 2, 3, 4, 5]


def test_a_long_batch_is_made_in_order_in_growing_transactions_up_to_its_first_bad_run(tracker):
    """40 requests: transactions of 8, 16 and then 32 runs; the 31st is refused, so the 30 before it are made
    (the last transaction's first six through the client's path) and none after it."""
    requests = [request(i, "long") for i in range(1, 41)]
    requests[30] = {**requests[30], "params": {"bad*key": "1"}}
    made = []
    with pytest.raises(Exception, match="bad\\*key"):
        for job_id, run_id in jobruns.create_runs(tracker, requests):
            made.append((job_id, run_id))
    assert [job_id for job_id, _ in made] == list(range(1, 31))
    runs = tracker.client.search_runs([tracker.experiment_id("long")], max_results=100)
    assert sorted((int(r.data.tags["autoresearch.job_id"]), r.info.run_id) for r in runs) == made
    assert comparable(tracker, made[20][1]) == comparable(tracker, jobruns.create_run(tracker, request(21, "long")))


def test_a_deleted_experiment_gets_mlflows_own_error(tracker):
    experiment_id = tracker.experiment_id("gone")
    tracker.client.delete_experiment(experiment_id)
    with pytest.raises(Exception, match="(?i)active|deleted"):
        list(jobruns.create_runs(tracker, [request(1, "gone")]))
    assert tracker.client.search_runs([experiment_id], run_view_type=3) == []


def test_long_param_values_are_clipped_as_mlflow_clips_them(tracker):
    [(_, run_id)] = jobruns.create_runs(tracker, [request(1, "clipped", long="x" * 5999 + "yz")])
    assert tracker.client.get_run(run_id).data.params["long"] == "x" * 5999 + "y"


def test_ending_runs_sets_the_jobs_outcome_and_leaves_runs_already_ended(tracker):
    made = dict(jobruns.create_runs(tracker, [request(i, "ends") for i in range(1, 5)]))
    tracker.client.set_terminated(made[3], "FAILED", end_time=123)  # the job ended its run itself
    ends = [{"run": made[1], "status": "FINISHED", "end": 1_000}, {"run": made[2], "status": "KILLED", "end": 2_000},
            {"run": made[3], "status": "FINISHED", "end": 3_000}, {"run": "0" * 32, "status": "FAILED", "end": 1}]
    jobruns.end_runs(tracker, ends)
    got = {job_id: (tracker.client.get_run(run_id).info.status, tracker.client.get_run(run_id).info.end_time)
           for job_id, run_id in made.items()}
    assert got == {1: ("FINISHED", 1_000), 2: ("KILLED", 2_000), 3: ("FAILED", 123), 4: ("RUNNING", None)}


def start(store: JobStore, job_id: int) -> None:
    store.claim([(job_id, ["cpu:0"])], "h1")
    store.mark_running(job_id, 4242, None, "h1")


def test_runs_the_service_made_are_listed_to_end_once_their_jobs_end_for_good(db_url):
    """`runs_to_close` lists the jobs finished for good whose run the service made (set_run_ids), and only
    until `runs_closed`: not a job still running, nor one awaiting a retry, nor a run its submitter brought."""
    store = JobStore(db_url)
    done, retrying, running, cancelled = (store.submit(JobSpec(argv=["true"], max_attempts=2 if i == 1 else 1))
                                          for i in range(4))
    brought = store.submit(JobSpec(argv=["true"], mlflow_run_id="r-brought"))
    assert store.runs.set_run_ids({j.id: f"r{j.id}" for j in (done, retrying, running, cancelled)}) == \
        {done.id, retrying.id, running.id, cancelled.id}
    assert store.runs.set_run_ids({done.id: "another host's"}) == set()  # set once
    for job in (done, retrying, running, brought):
        start(store, job.id)
    store.finish(done.id, 0, "h1")
    store.finish(brought.id, 0, "h1")
    assert store.finish(retrying.id, 1, "h1").retrying
    store.cancel(cancelled.id)
    listed = store.runs.runs_to_close()
    assert [(job_id, run_id, state) for job_id, run_id, state, _ in listed] == \
        [(done.id, f"r{done.id}", "SUCCEEDED"), (cancelled.id, f"r{cancelled.id}", "CANCELLED")]
    assert [at for *_, at in listed] == [store.get(done.id).finished_at, store.get(cancelled.id).finished_at]
    assert store.runs.runs_to_close(limit=1) == listed[:1]
    store.runs.runs_closed([done.id])
    assert [row[0] for row in store.runs.runs_to_close()] == [cancelled.id]
    store.requeue_due(now=10 ** 12)  # the retry fails too: now the job has ended for good
    start(store, retrying.id)
    assert store.finish(retrying.id, 1, "h1").final
    assert [row[:3] for row in store.runs.runs_to_close()] == [(cancelled.id, f"r{cancelled.id}", "CANCELLED"),
                                                         (retrying.id, f"r{retrying.id}", "FAILED")]
    store.close()


def test_runs_made_and_not_recorded_are_found_on_a_store_that_is_not_a_database(tmp_path, monkeypatch):
    """Adoption's other path (an MLflow server, a file store: MLflow's client, a search per job) finds the same
    runs the database path does: open, tagged with the job, named as its request, started after submission."""
    import time

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracker = Tracker((tmp_path / "mlruns").as_uri(), None)
    assert jobruns._sql_store(tracker) is None
    now = int(time.time() * 1000)
    requests = [{"id": i, "experiment": "jobs", "name": f"job-{i}", "tags": {jobruns.TAG_JOB: str(i)}, "params": {},
                 "submitted": now - 1000} for i in (1, 2, 3)]
    made = dict(jobruns.create_runs(tracker, requests[:2]))
    tracker.client.set_terminated(made[2], "FAILED")  # ended: not a run waiting for its job
    assert jobruns.made_runs(tracker, None, requests) == {1: made[1]}
    again = dict(jobruns.create_runs(tracker, requests, adopt=True))
    assert again[1] == made[1] and again[2] != made[2] and set(again) == {1, 2, 3}
