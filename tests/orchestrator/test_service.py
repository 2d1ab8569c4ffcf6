"""The queue service end to end with real processes on cpu slots: preemption, cancel, retries, exit 75,
torchrun for multi-device jobs, leftover processes, and the job protocol's environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from orchestrator.api import jobs as api
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import SCRIPTS, ckpt_job, proc_state, wait_for
from tests.support.dispatch import wait_for_dispatch

ROOT = str(Path(__file__).resolve().parents[2])


def state(service, job_id):
    return service.store.get(job_id).state


def log_of(service, job_id) -> str:
    path = service.store.get(job_id).log_path
    return Path(path).read_text() if path and os.path.exists(path) else ""


def test_preemption_end_to_end(make_service):
    service = make_service("cpu:2", preempt_after=0)
    low = [api.submit(ckpt_job(400, priority=0, name=f"low{i}"))[0].id for i in range(2)]
    # Running and past start-up (its SIGTERM handler installed), as a real trainer would be after a while.
    wait_for(lambda: all("starts at step" in log_of(service, j) for j in low), what="both low jobs running")
    high = api.submit(ckpt_job(10, priority=50, name="high"))[0].id
    wait_for(lambda: state(service, high) == "RUNNING", what="the high job to start")
    victims = [j for j in low if service.store.get(j).preemptions == 1]
    assert len(victims) == 1, "exactly one victim"
    victim = victims[0]
    assert "checkpointed at step" in log_of(service, victim)
    events = [(e.src, e.dst) for e in service.store.events(victim)]
    assert ("RUNNING", "PREEMPTING") in events and ("PREEMPTING", "QUEUED") in events
    assert service.store.get(victim).priority == 0
    wait_for(lambda: state(service, high) == "SUCCEEDED", what="the high job to finish")
    # The victim resumes from its checkpoint on the freed device and succeeds.
    text = wait_for(lambda: "attempt 2 starts" in log_of(service, victim) and log_of(service, victim),
                    what="the victim to run again")
    assert "attempt 2 starts at step" in text and "starts at step 0" in text.split("attempt 2")[0]
    resumed_at = int(text.split("attempt 2 starts at step ")[1].split()[0])
    assert resumed_at > 0
    for job_id in low:
        service.store.cancel(job_id)  # no need to wait 20 s for the rest
    wait_for(lambda: all(state(service, j) == "CANCELLED" for j in low), what="cancels")


def test_cancel_queued_and_running(make_service):
    service = make_service("cpu:1")
    running = api.submit(ckpt_job(1000))[0].id
    queued = api.submit(ckpt_job(1000))[0].id
    wait_for(lambda: "starts at step" in log_of(service, running))
    assert api.cancel(queued).state == "CANCELLED"
    assert api.cancel(running).state == "CANCELLING"
    wait_for(lambda: state(service, running) == "CANCELLED", what="cancel of the running job")
    job = service.store.get(running)
    assert job.exit_code == 143 and "checkpointed" in log_of(service, running)


def test_cancel_escalates_to_sigkill_after_grace(make_service):
    service = make_service("cpu:1")
    stubborn = JobSpec(argv=["sh", "-c", "trap '' TERM; sleep 60"], grace=0.5, track=False)
    job_id = api.submit(stubborn)[0].id
    wait_for(lambda: state(service, job_id) == "RUNNING")
    api.cancel(job_id)
    wait_for(lambda: state(service, job_id) == "CANCELLED", timeout=15, what="SIGKILL after the grace")


def test_a_plain_sigterm_handler_that_exits_0_is_requeued_and_resumes(make_service):
    # Issue 12's repro: two copies of a script whose SIGTERM handler saves and calls sys.exit(0) fill cpu:2,
    # then a priority-50 job arrives.
    service = make_service("cpu:2", preempt_after=0)
    plain = JobSpec(argv=[sys.executable, str(SCRIPTS / "plain_sigterm_job.py"), "400"], priority=0, track=False)
    low = [api.submit(plain)[0].id for _ in range(2)]
    wait_for(lambda: all("starts at step" in log_of(service, j) for j in low), what="both low jobs running")
    wait_for(lambda: all("trained 10 steps" in log_of(service, j) for j in low),
             what="some training to lose if the preemption dropped it")
    high = api.submit(ckpt_job(10, priority=50, name="high"))[0].id
    wait_for(lambda: any(service.store.get(j).preemptions for j in low), what="a low job to be preempted")
    [victim] = [j for j in low if service.store.get(j).preemptions == 1]
    job = service.store.get(victim)
    assert job.state in ("QUEUED", "STARTING", "RUNNING") and job.exit_code == 0 and job.failures == 0
    assert ("PREEMPTING", "QUEUED") in [(e.src, e.dst) for e in service.store.events(victim)]
    wait_for(lambda: state(service, high) == "SUCCEEDED", what="the high job")
    text = wait_for(lambda: "attempt 2 starts" in log_of(service, victim) and log_of(service, victim),
                    what="the preempted job to resume")
    saved = int(text.split("saved at step ")[1].split()[0])
    assert saved > 0 and f"attempt 2 starts at step {saved}" in text
    for job_id in low:
        api.cancel(job_id)
    wait_for(lambda: all(state(service, j) == "CANCELLED" for j in low), what="cancels")


def test_a_runtime_job_that_finished_during_its_grace_succeeds_and_is_not_run_again(make_service):
    service = make_service("cpu:2", preempt_after=0)
    # The other slot is busy with work that may not be preempted, so the runtime job is the one victim.
    blocker = api.submit(ckpt_job(1000, priority=0, preemptible=False))[0].id
    spec = JobSpec(argv=[sys.executable, str(SCRIPTS / "finish_in_grace_job.py")], priority=0, track=False,
                   env={"PYTHONPATH": ROOT})
    job_id = api.submit(spec)[0].id
    wait_for(lambda: "training" in log_of(service, job_id), what="the runtime job running")
    high = api.submit(JobSpec(argv=["true"], priority=50, track=False))[0].id
    wait_for(lambda: state(service, high) == "SUCCEEDED", what="the high job")
    job = service.store.get(job_id)
    assert (job.state, job.attempts, job.preemptions, job.exit_code) == ("SUCCEEDED", 1, 0, 0)
    assert [(e.src, e.dst) for e in service.store.events(job_id)][-2:] == [("RUNNING", "PREEMPTING"),
                                                                           ("PREEMPTING", "SUCCEEDED")]
    assert log_of(service, job_id).count("training") == 1 and "last step done" in log_of(service, job_id)
    api.cancel(blocker)


def test_an_unreachable_tracking_store_leaves_the_job_queued_without_spending_an_attempt(make_service,
                                                                                        monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    store = api.open_store()
    ended = api.submit(JobSpec(argv=["true"]), store=store)[0].id  # its run was made before the store went down
    store.runs.set_run_ids({ended: "0" * 32})
    store.cancel(ended)
    service = make_service("cpu:1")
    tracked = api.submit(JobSpec(argv=["true"]))[0].id
    job = wait_for(lambda: (j := service.store.get(tracked)).reason.startswith("waiting: MLflow") and j,
                   timeout=60, what="the tracked job's reason")  # MLflow's first import is slow
    assert "127.0.0.1" in job.reason and "no attempt spent" in job.reason
    untracked = api.submit(JobSpec(argv=["true"], track=False))[0].id  # needs no MLflow: not held up
    wait_for(lambda: state(service, untracked) == "SUCCEEDED", what="the untracked job")
    job = service.store.get(tracked)
    assert (job.state, job.attempts, job.failures, job.mlflow_run_id) == ("QUEUED", 0, 0, None)
    assert [(e.src, e.dst) for e in service.store.events(tracked)] == [(None, "QUEUED")]
    # The cancelled job's run could not be ended either: it stays listed, to be ended when the store is back.
    wait_for(lambda: "could not end the MLflow runs of 1 finished jobs" in caplog.text, timeout=30,
             what="a try to end the run")
    assert [row[0] for row in service.store.runs.runs_to_close()] == [ended]


def test_retries_with_backoff_and_exit_75(make_service, monkeypatch):
    monkeypatch.setenv("AUTORESEARCH_RETRY_BACKOFF", "0.2")  # a setting, read when a job fails
    service = make_service("cpu:1")
    flaky = JobSpec(argv=["sh", "-c", 'test "$AUTORESEARCH_ATTEMPT" -ge 3 || exit 1'], max_attempts=3, track=False)
    flaky_id = api.submit(flaky)[0].id
    wait_for(lambda: state(service, flaky_id) == "SUCCEEDED", timeout=20, what="the flaky job to succeed")
    job = service.store.get(flaky_id)
    assert (job.attempts, job.failures) == (3, 2)
    hopeless = api.submit(JobSpec(argv=["sh", "-c", "exit 3"], max_attempts=2, track=False))[0].id
    wait_for(lambda: service.store.get(hopeless).failures == 2, timeout=20)
    assert service.store.get(hopeless).state == "FAILED" and service.store.get(hopeless).exit_code == 3
    tempfail = JobSpec(argv=["sh", "-c", 'test "$AUTORESEARCH_ATTEMPT" -ge 2 || exit 75'], max_attempts=1,
                       track=False)
    temp_id = api.submit(tempfail)[0].id
    wait_for(lambda: state(service, temp_id) == "SUCCEEDED", timeout=20, what="requeue after exit 75")
    job = service.store.get(temp_id)
    assert job.attempts == 2 and job.failures == 0


def test_contract_3_environment_and_one_mlflow_run_for_all_attempts(make_service, tmp_path):
    service = make_service("cpu:2")
    out = tmp_path / "env.jsonl"
    code = (f"import json,os; open({str(out)!r},'a').write(json.dumps(dict(os.environ))+'\\n'); "
            "raise SystemExit(75 if os.environ['AUTORESEARCH_ATTEMPT']=='1' else 0)")
    job_id = api.submit(JobSpec(argv=[sys.executable, "-c", code], params={"lr": 0.1}, env={"EXTRA": "1"}))[0].id
    wait_for(lambda: state(service, job_id) == "SUCCEEDED", timeout=60)
    first, second = [__import__("json").loads(line) for line in out.read_text().splitlines()]
    job = service.store.get(job_id)
    for env, attempt in ((first, "1"), (second, "2")):
        assert env["AUTORESEARCH_JOB_ID"] == str(job_id) and env["AUTORESEARCH_ATTEMPT"] == attempt
        assert env["AUTORESEARCH_CHECKPOINT_DIR"] == job.checkpoint_dir
        assert env["AUTORESEARCH_PARAMS"] == '{"lr": 0.1}'
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert env["MLFLOW_RUN_ID"] == job.mlflow_run_id and env["EXTRA"] == "1"
        assert env["MLFLOW_TRACKING_URI"] == os.environ["MLFLOW_TRACKING_URI"]
    assert job.mlflow_run_id


def test_multi_device_job_runs_under_torchrun_all_or_nothing(make_service, tmp_path):
    service = make_service("cpu:2")
    blocker = api.submit(ckpt_job(1000, priority=0, preemptible=False))[0].id
    wait_for(lambda: state(service, blocker) == "RUNNING")
    # One write(2) per rank: both ranks share the log, and print() may split a line into several writes.
    code = "import os; os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())"
    pair = api.submit(JobSpec(argv=[sys.executable, "-c", code], gpus=2, priority=20, track=False))[0].id
    small = api.submit(JobSpec(argv=["true"], priority=5, track=False))[0].id
    # The pair cannot get both slots while the non-preemptible blocker runs, and it reserves the free one.
    wait_for_dispatch(service)
    assert state(service, pair) == "QUEUED" and state(service, small) == "QUEUED"
    api.cancel(blocker)
    wait_for(lambda: state(service, pair) == "SUCCEEDED", timeout=90, what="the torchrun job")
    job = service.store.get(pair)
    assert sorted(job.devices) == ["cpu:0", "cpu:1"]
    text = log_of(service, pair)
    assert "rank 0 of 2" in text and "rank 1 of 2" in text
    wait_for(lambda: state(service, small) == "SUCCEEDED")


def test_leftover_processes_are_killed_before_the_device_is_reused(make_service, tmp_path):
    service = make_service("cpu:1")
    pidfile = tmp_path / "bg.pid"
    # The job exits at once but leaves a background process in its group.
    job_id = api.submit(JobSpec(argv=["sh", "-c", f"sleep 300 & echo $! > {pidfile}; exit 0"], track=False))[0].id
    wait_for(lambda: state(service, job_id) == "SUCCEEDED", timeout=20)
    pid = int(pidfile.read_text())
    wait_for(lambda: proc_state(pid) in (None, "Z"), timeout=5, what="the leftover process to be killed")


def test_disabled_device_gets_no_new_jobs(make_service):
    service = make_service("cpu:2")
    service.store.hosts.set_device_state(service.host, "cpu:0", "disabled", "maintenance")
    ids = [api.submit(JobSpec(argv=["true"], track=False))[0].id for _ in range(3)]
    wait_for(lambda: all(state(service, j) == "SUCCEEDED" for j in ids), timeout=20)
    assert {tuple(service.store.get(j).devices) for j in ids} == {("cpu:1",)}


def test_a_job_submitted_to_an_idle_service_starts_on_its_wake_up_not_on_the_tick(home, monkeypatch):
    """With the timer tick an hour long, only the submit's wake-up (and the exit's) can start and record the
    jobs: each one submitted to the idle service runs, one after the other, and a long one is recorded RUNNING
    without any other wake-up."""
    from orchestrator.core.config import Settings
    from orchestrator.service.daemon import Service

    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")  # no start-up check: the service is idle at once
    service = Service(Settings.load(), devices="cpu:1", preempt_after=0.0, tick=3600.0).start()
    try:
        for _ in range(3):
            job, served = api.submit(JobSpec(argv=["true"], track=False))
            assert served
            wait_for(lambda: state(service, job.id) == "SUCCEEDED", timeout=60, what="the job to run")
        # A long job: nothing wakes the service after its start, yet the store soon has it RUNNING, pid and all.
        job, _ = api.submit(JobSpec(argv=["sleep", "30"], track=False))
        wait_for(lambda: state(service, job.id) == "RUNNING", timeout=10, what="the long job recorded RUNNING")
        running = service.store.get(job.id)
        assert running.pid and running.proc_start
        api.cancel(job.id)
        wait_for(lambda: state(service, job.id) == "CANCELLED", timeout=30, what="the long job cancelled")
    finally:
        service.stop()


def test_the_mlflow_runs_the_service_made_end_with_their_jobs(make_service, home):
    """A tracked job's run ends with the job (FINISHED, FAILED, KILLED, at the job's end time), even when the
    job never ran or ended while no service watched; a run the submitter brought is the submitter's to end."""
    from orchestrator.core.config import Settings
    from orchestrator.tracking.client import Tracker

    tracker = Tracker.from_settings(Settings.load())
    store = api.open_store()
    # Left open by a service that died: the run was made and recorded, then the job was cancelled unseen.
    orphan = api.submit(JobSpec(argv=["true"]), store=store)[0]
    store.runs.set_run_ids({orphan.id: tracker.client.create_run(tracker.experiment_id("jobs")).info.run_id})
    store.cancel(orphan.id)
    brought = tracker.client.create_run(tracker.experiment_id("jobs")).info.run_id

    service = make_service("cpu:1")
    ok = api.submit(JobSpec(argv=["true"]))[0].id
    bad = api.submit(JobSpec(argv=["false"], max_attempts=1))[0].id
    theirs = api.submit(JobSpec(argv=["true"], mlflow_run_id=brought))[0].id
    for job_id in (ok, bad, theirs):
        wait_for(lambda: service.store.get(job_id).final, timeout=60, what=f"job {job_id}")
    blocker = api.submit(JobSpec(argv=["sleep", "30"], grace=1))[0].id
    waiting = api.submit(JobSpec(argv=["true"]))[0].id  # its run is made ahead while the blocker runs
    wait_for(lambda: state(service, blocker) == "RUNNING" and service.store.get(waiting).mlflow_run_id,
             timeout=30, what="the waiting job's run")
    api.cancel(waiting)
    api.cancel(blocker)

    def status(job_id):
        run = tracker.client.get_run(service.store.get(job_id).mlflow_run_id).info
        return run.status, run.end_time

    expected = {orphan.id: "KILLED", ok: "FINISHED", bad: "FAILED", waiting: "KILLED", blocker: "KILLED"}
    wait_for(lambda: all(status(j)[0] == s for j, s in expected.items()), timeout=30,
             what="the runs' ends", interval=0.2)
    for job_id in expected:
        assert status(job_id)[1] == int(service.store.get(job_id).finished_at * 1000)
    assert status(theirs) == ("RUNNING", None)
    assert service.store.runs.runs_to_close() == []
