"""A dispatch pass is one transaction: its records of starts and exits and its claim commit together, or none
does and the next pass records them again (nothing lost, nothing twice)."""

from __future__ import annotations

import pytest

from orchestrator.api import jobs as api
from orchestrator.queue.models import JobSpec
from orchestrator.queue.states import JobState
from orchestrator.queue.store import JobStore
from tests.orchestrator.helpers import wait_for

S = JobState


def test_store_calls_in_a_transaction_commit_together_and_read_their_own_writes(home):
    from orchestrator.core.config import Settings

    store = JobStore.from_settings(Settings.load())
    first = store.submit(JobSpec(argv=["true"], track=False))
    second = store.submit(JobSpec(argv=["true"], track=False))
    with pytest.raises(RuntimeError):
        with store.db.transaction():
            store.cancel(first.id)
            queued, _ = store.snapshot("host")  # inside: sees the cancel
            assert [row.id for row in queued] == [second.id]
            raise RuntimeError("the pass fails after its first write")
    assert store.get(first.id).job_state is S.QUEUED  # rolled back with the rest
    with store.db.transaction():
        store.cancel(first.id)
        store.cancel(second.id)
    assert store.get(first.id).job_state is S.CANCELLED and store.get(second.id).job_state is S.CANCELLED


def test_a_pass_that_fails_records_its_exits_on_the_next_one(make_service, home):
    service = make_service(devices="cpu:1")
    first, _ = api.submit(JobSpec(argv=["sleep", "0.5"], track=False), store=service.store)
    wait_for(lambda: service.store.get(first.id).job_state is S.RUNNING, what="the first job running")
    second, _ = api.submit(JobSpec(argv=["true"], track=False), store=service.store)
    claim, failures = service.store.claim, []
    outside = JobStore(service.settings.db_url)  # another connection: sees only what is committed

    def failing_once(starts, host, **kw):  # the pass that records the first job's exit fails at its claim
        if starts and not failures:
            failures.append(outside.get(first.id).job_state)
            raise RuntimeError("database went away mid-pass")
        return claim(starts, host, **kw)

    service.store.claim = failing_once
    for job in (first, second):
        wait_for(lambda: service.store.get(job.id).job_state is S.SUCCEEDED, what=f"job {job.id} succeeded")
    assert failures == [S.RUNNING]  # the exit was recorded in the failing pass, uncommitted, then rolled back
    ends = [e for e in service.store.events(first.id) if e.dst == S.SUCCEEDED.value]
    assert len(ends) == 1  # recorded once, by the pass after
    assert service.store.get(second.id).attempts == 1
