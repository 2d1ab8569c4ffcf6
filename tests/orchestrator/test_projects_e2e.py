"""Projects end to end on cpu slots with real processes: an owner reclaims its quota from a project that flooded
the box, the flooders resume from their checkpoints; a job that cannot meet its deadline ends unstarted."""

from __future__ import annotations

import time

from orchestrator.api import jobs as api
from orchestrator.agent import usage as ledger
from orchestrator.api import sharing
from orchestrator.core.config import Settings
from tests.orchestrator.helpers import ckpt_job, wait_for

PREEMPT_AFTER = 1.0
GRACE = 2.0


def log_of(service, job_id) -> str:
    path = service.store.get(job_id).log_path
    try:
        return open(path).read() if path else ""
    except FileNotFoundError:
        return ""


def test_the_owner_runs_within_preempt_after_plus_grace_and_the_flooders_resume(make_service):
    settings = Settings.load()
    sharing.set_project(settings, "owner", share=1, quota=1)
    sharing.set_project(settings, "flood", share=1, quota=1)
    service = make_service("cpu:2", preempt_after=PREEMPT_AFTER)
    # The flood fills both slots (its quota and the owner's unused one), at a priority far above the owner's.
    flood = [api.submit(ckpt_job(2000, priority=90, project="flood", grace=GRACE, name=f"flood{i}"))[0].id
             for i in range(3)]
    wait_for(lambda: sum("starts at step" in log_of(service, j) for j in flood) == 2, what="the flood running")
    submitted = time.time()
    owner = api.submit(ckpt_job(5, priority=0, project="owner", grace=GRACE, name="owner"))[0].id
    wait_for(lambda: service.store.get(owner).state in ("RUNNING", "SUCCEEDED"), timeout=60,
             what="the owner's job to run")
    started = next(e.at for e in service.store.events(owner) if e.dst == "STARTING")
    # Reclaim needs the borrower to have run preempt_after and to checkpoint within its grace; the rest is the
    # service's passes (a few ticks), with room for a loaded machine.
    assert started - submitted <= PREEMPT_AFTER + GRACE + 5.0
    [victim] = [j for j in flood if service.store.get(j).preemptions == 1]
    reasons = [e.reason for e in service.store.events(victim) if e.dst == "PREEMPTING"]
    assert reasons and "reclaim" in reasons[0]
    assert "checkpointed at step" in log_of(service, victim)
    wait_for(lambda: service.store.get(owner).state == "SUCCEEDED", what="the owner's job to finish")
    # The flooder takes the slot back and continues where it stopped.
    text = wait_for(lambda: "attempt 2 starts" in log_of(service, victim) and log_of(service, victim),
                    timeout=60, what="the victim to resume")
    assert int(text.split("attempt 2 starts at step ")[1].split()[0]) > 0
    rows = {r["project"]: r for r in ledger.usage(settings, store=service.store)}
    assert rows["owner"]["device_seconds"] > 0 and rows["flood"]["attempts"] >= 3
    for job_id in flood:
        service.store.cancel(job_id)
    wait_for(lambda: all(service.store.get(j).final for j in flood), what="cancels")


def test_a_job_that_cannot_meet_its_deadline_is_cancelled_unstarted(make_service):
    service = make_service("cpu:1")
    late = api.submit(ckpt_job(5, deadline=time.time() + 30, time_limit=600.0))[0].id
    fine = api.submit(ckpt_job(5, deadline=time.time() + 600, time_limit=60.0))[0].id
    wait_for(lambda: service.store.get(late).final and service.store.get(fine).final, what="both to end")
    job = service.store.get(late)
    assert (job.state, job.attempts) == ("CANCELLED", 0) and job.reason.startswith("deadline")
    assert [(e.src, e.dst) for e in service.store.events(late)] == [(None, "QUEUED"), ("QUEUED", "CANCELLED")]
    assert service.store.get(fine).state == "SUCCEEDED"
