"""The queue service end to end with real processes on cpu slots: preemption, cancel, retries, exit 75,
torchrun for multi-device jobs, leftover processes, and the Contract 3 environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from orchestrator import api
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import ckpt_job, wait_for
from tests.support.dispatch import wait_for_dispatch


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


def test_retries_with_backoff_and_exit_75(make_service, monkeypatch):
    import orchestrator.queue.store as store_mod

    monkeypatch.setattr(store_mod, "BACKOFF_BASE", 0.2)
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
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
             timeout=5, what="the leftover process to be killed")


def test_disabled_device_gets_no_new_jobs(make_service):
    service = make_service("cpu:2")
    service.store.set_device_state(service.host, "cpu:0", "disabled", "maintenance")
    ids = [api.submit(JobSpec(argv=["true"], track=False))[0].id for _ in range(3)]
    wait_for(lambda: all(state(service, j) == "SUCCEEDED" for j in ids), timeout=20)
    assert {tuple(service.store.get(j).devices) for j in ids} == {("cpu:1",)}
