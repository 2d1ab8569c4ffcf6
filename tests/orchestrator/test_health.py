"""Device health through the service, end to end with injected faults on cpu slots (AUTORESEARCH_FAULTS):
preflight quarantine, the run-time monitor, hang detection, idle re-checks, and `gpus enable`."""

from __future__ import annotations

import sys
import time

from orchestrator.api import jobs as api
from orchestrator.service.health import HealthConfig
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import ckpt_job, wait_for


def test_preflight_failure_quarantines_the_device_and_the_job_lands_on_a_healthy_one(make_service, monkeypatch):
    service = make_service("cpu:2", health=HealthConfig(preflight="quick", recheck_every=3600))
    # The start-up check passes both slots; then cpu:0 develops a fault before any job arrives.
    wait_for(lambda: all(d.last_check for d in service.store.hosts.devices(service.host)), timeout=60)
    monkeypatch.setenv("AUTORESEARCH_FAULTS", "cpu:0:matmul")
    ids = [api.submit(JobSpec(argv=["true"], track=False))[0].id for _ in range(3)]
    wait_for(lambda: all(service.store.get(j).state == "SUCCEEDED" for j in ids), timeout=60)
    for job_id in ids:
        job = service.store.get(job_id)
        # No failure spent; each placement takes a fresh attempt number (never reused), one per bad device met.
        given_back = sum("preflight failed" in e.reason for e in service.store.events(job_id))
        assert job.devices == ["cpu:1"] and job.failures == 0 and job.attempts == 1 + given_back
    devs = {d.name: d for d in service.store.hosts.devices(service.host)}
    assert devs["cpu:0"].state == "quarantined" and "matmul" in devs["cpu:0"].reason
    assert devs["cpu:0"].last_check["status"] == "fail"
    assert any("preflight failed on cpu:0" in e.reason for j in ids for e in service.store.events(j))
    # A person returns the device once it is fixed.
    monkeypatch.delenv("AUTORESEARCH_FAULTS")
    service.store.hosts.set_device_state(service.host, "cpu:0", "available")
    service.store.hosts.set_device_state(service.host, "cpu:1", "disabled", "test")
    # A pass that read the devices before these changes may still be under way: submit once one that began
    # after them has ended (its successor cannot have read the old states).
    passes = service.passes
    wait_for(lambda: service.passes >= passes + 2, timeout=30)
    job = api.submit(JobSpec(argv=["true"], track=False))[0].id
    wait_for(lambda: service.store.get(job).state == "SUCCEEDED", timeout=30)
    assert service.store.get(job).devices == ["cpu:0"]


def test_a_fault_under_a_running_job_checkpoints_it_and_moves_it(make_service, monkeypatch):
    service = make_service("cpu:2", health=HealthConfig(preflight="off", monitor_every=0.2, recheck_every=3600))
    job_id = api.submit(ckpt_job(120))[0].id
    wait_for(lambda: service.store.get(job_id).state == "RUNNING")
    first = service.store.get(job_id).devices[0]
    wait_for(lambda: "starts at step" in open(service.store.get(job_id).log_path).read())
    monkeypatch.setenv("AUTORESEARCH_FAULTS", f"{first}:ecc")
    wait_for(lambda: service.store.get(job_id).preemptions == 1, timeout=30, what="the monitor to act")
    wait_for(lambda: service.store.get(job_id).state == "SUCCEEDED", timeout=60)
    job = service.store.get(job_id)
    assert job.devices != [first]
    log = open(job.log_path).read()
    assert "checkpointed at step" in log and "attempt 2 starts at step" in log
    assert {d.name: d.state for d in service.store.hosts.devices(service.host)}[first] == "quarantined"


HANGS_ONCE = """
import json, os, sys, time
path = os.environ["AUTORESEARCH_HEARTBEAT_FILE"]
json.dump({"step": 1, "time": time.time(), "pid": os.getpid()}, open(path, "w"))
if os.environ["AUTORESEARCH_ATTEMPT"] == "1":
    time.sleep(300)  # hung: no more heartbeats
"""


def test_a_job_without_progress_is_stopped_and_requeued(make_service):
    service = make_service("cpu:1", health=HealthConfig(preflight="off", monitor_every=0.2, hang_timeout=1.0,
                                                        recheck_every=3600))
    job_id = api.submit(JobSpec(argv=[sys.executable, "-c", HANGS_ONCE], grace=1.0, track=False))[0].id
    wait_for(lambda: service.store.get(job_id).state == "SUCCEEDED", timeout=60, what="requeue after the hang")
    job = service.store.get(job_id)
    assert job.attempts == 2 and job.preemptions == 1
    assert any("no progress" in e.reason for e in service.store.events(job_id))


def test_idle_devices_are_rechecked_on_a_schedule(make_service, monkeypatch):
    monkeypatch.setenv("AUTORESEARCH_FAULTS", "cpu:1:alloc")
    service = make_service("cpu:2", health=HealthConfig(preflight="off", recheck_level="quick", recheck_every=0.5))
    wait_for(lambda: {d.name: d.state for d in service.store.hosts.devices(service.host)}["cpu:1"] == "quarantined",
             timeout=30, what="the idle re-check")
    devs = {d.name: d for d in service.store.hosts.devices(service.host)}
    assert devs["cpu:0"].state == "available" and devs["cpu:0"].last_check["status"] == "pass"
    assert "idle check" in devs["cpu:1"].reason


def test_a_device_failing_at_start_up_is_quarantined_before_any_job(make_service, monkeypatch):
    monkeypatch.setenv("AUTORESEARCH_FAULTS", "cpu:1:alloc")
    service = make_service("cpu:2", health=HealthConfig(preflight="quick", recheck_every=3600))
    wait_for(lambda: {d.name: d.state for d in service.store.hosts.devices(service.host)}["cpu:1"] == "quarantined",
             timeout=60, what="the start-up preflight")
    job = api.submit(JobSpec(argv=["true"], track=False))[0].id
    wait_for(lambda: service.store.get(job).state == "SUCCEEDED", timeout=30)
    assert service.store.get(job).devices == ["cpu:0"]


def _states(service):
    return {d.name: d for d in service.store.hosts.devices(service.host)}


def test_a_restart_does_not_check_the_devices_of_adopted_jobs(make_service, monkeypatch):
    first = make_service("cpu:3", health=HealthConfig(preflight="quick", recheck_every=3600))
    for name in ("cpu:0", "cpu:1"):
        first.store.hosts.set_device_state(first.host, name, "disabled", "steer the job to cpu:2")
    job_id = api.submit(ckpt_job(1200))[0].id  # a minute of steps: still running across the restart
    wait_for(lambda: first.store.get(job_id).state == "RUNNING", timeout=60)
    assert first.store.get(job_id).devices == ["cpu:2"]
    for name in ("cpu:0", "cpu:1"):
        first.store.hosts.set_device_state(first.host, name, "available")
    first.stop()
    before = _states(first)["cpu:2"].checked_at
    # A check of cpu:2 now would fail it (on a GPU: the adopted job is a foreign process, its memory is taken).
    monkeypatch.setenv("AUTORESEARCH_FAULTS", "cpu:2:alloc")
    second = make_service("cpu:3", health=HealthConfig(preflight="quick", recheck_every=3600))
    wait_for(lambda: all(_states(second)[n].checked_at for n in ("cpu:0", "cpu:1")), timeout=60,
             what="the start-up preflight of the free devices")
    devs = _states(second)
    assert devs["cpu:2"].state == "available" and devs["cpu:2"].checked_at == before
    assert second.store.get(job_id).state == "RUNNING" and second.store.get(job_id).attempts == 1


def test_a_device_under_an_idle_check_gets_no_job_until_the_check_ends(make_service, monkeypatch):
    import threading

    service = make_service("cpu:1", health=HealthConfig(preflight="off", recheck_level="quick", recheck_every=3600))
    started, release = threading.Event(), threading.Event()
    real = service.health.recheck

    def slow_recheck(devices):  # the real check, held open as a GPU's tens of seconds would be
        started.set()
        release.wait(30)
        return real(devices)

    monkeypatch.setattr(service.health, "recheck", slow_recheck)
    checker = threading.Thread(target=service.guard.recheck_idle)
    checker.start()
    try:
        assert started.wait(10) and service.guard.checking == {"cpu:0"}
        passes = service.passes
        job_id = api.submit(JobSpec(argv=["true"], track=False))[0].id
        # Three dispatch passes that saw the job (the first may have begun before the submit) left it waiting.
        wait_for(lambda: service.passes >= passes + 3, timeout=30, what="three dispatch passes")
        assert service.store.get(job_id).state == "QUEUED"
    finally:
        release.set()
        checker.join(30)
    wait_for(lambda: service.store.get(job_id).state == "SUCCEEDED", timeout=30, what="the start after the check")
    job, dev = service.store.get(job_id), _states(service)["cpu:0"]
    assert service.guard.checking == frozenset() and dev.state == "available"
    assert dev.checked_at <= job.started_at  # the check ended, then the job started


def test_a_throttle_acts_only_after_consecutive_samples(make_service, monkeypatch):
    service = make_service("cpu:1", health=HealthConfig(preflight="off", monitor_every=0, monitor_hits=3,
                                                        recheck_every=3600))
    job_id = api.submit(ckpt_job(1200))[0].id
    wait_for(lambda: service.store.get(job_id).state == "RUNNING", timeout=60)
    for faulty in (True, True, False, True, True):  # a pass in between resets the count
        monkeypatch.setenv("AUTORESEARCH_FAULTS", "cpu:0:throttle" if faulty else "")
        service.guard.monitor()
        assert _states(service)["cpu:0"].state == "available"
        assert service.store.get(job_id).state == "RUNNING"
    monkeypatch.setenv("AUTORESEARCH_FAULTS", "cpu:0:throttle")
    service.guard.monitor()  # the third failing sample in a row
    assert _states(service)["cpu:0"].state == "quarantined" and "throttle" in _states(service)["cpu:0"].reason
    assert service.store.get(job_id).state in ("PREEMPTING", "QUEUED")


def test_a_hung_nvml_neither_stalls_the_heartbeat_nor_acts_on_one_sample(make_service):
    import threading

    from runtime.nvml import Nvml
    from tests.support.fake_nvml import FakeNvml

    gate = threading.Event()  # never set while the test watches: the driver call is wedged for good
    fake = FakeNvml(["GPU-aaaa", "GPU-bbbb"], hang=gate)
    service = make_service("0,1", health=HealthConfig(preflight="off", monitor_every=0.2, monitor_hits=3,
                                                      nvml_timeout=0.5, recheck_every=3600))
    service.guard.open_nvml = lambda: Nvml(fake, timeout_s=0.5).open()
    try:
        job_id = api.submit(JobSpec(argv=["sleep", "60"], grace=1.0, track=False))[0].id
        wait_for(lambda: service.store.get(job_id).state == "RUNNING", timeout=30)
        device = service.store.get(job_id).devices[0]
        hung_at = time.time()
        wait_for(lambda: _states(service)[device].state == "quarantined", timeout=30, what="the monitor to act")
        reason = _states(service)[device].reason
        assert "took over 0.5s" in reason or "still hung" in reason
        wait_for(lambda: any("device fault" in e.reason for e in service.store.events(job_id)), timeout=10,
                 what="the job to be stopped for the fault")
        # Housekeeping (the heartbeat other hosts judge us by) kept its pace while NVML was stuck.
        wait_for(lambda: service.store.hosts.services()[0].heartbeat_at > hung_at + 1.5, timeout=10,
                 what="a heartbeat after the hang")
        assert fake.inits == 1  # one long-lived session, not one per sample
    finally:
        gate.set()
