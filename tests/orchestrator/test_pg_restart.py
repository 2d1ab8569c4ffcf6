"""A PostgreSQL restart is a pause, not a crash: a process holding a queue store waits for its server to come back.

Runs on a PostgreSQL cluster of its own (initdb on a free port in a temp dir), since it stops the server: the
shared test server is never touched."""

from __future__ import annotations

import threading

import pytest

from orchestrator.core.errors import StoreUnavailable
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from tests.support.requires import require


@pytest.fixture
def own_cluster():
    from benchmarks.chaos.cluster import Cluster, _bin

    try:
        _bin("initdb")
    except RuntimeError as exc:
        require("PostgreSQL's initdb and pg_ctl", str(exc))
    cluster = Cluster().create()
    yield cluster
    cluster.destroy()


def test_a_store_waits_through_a_restart_of_its_server_and_carries_on(own_cluster):
    store = JobStore(own_cluster.url)
    job = store.submit(JobSpec(argv=["true"]))
    store.db.engine.dispose()  # no pooled connection left: the next call must connect while the server is down
    own_cluster.halt()
    back = threading.Timer(1.5, own_cluster.start)  # the restart's downtime
    back.start()
    try:
        assert store.get(job.id).state == "QUEUED"  # waited for the server instead of raising
        assert store.submit(JobSpec(argv=["true"])).id == job.id + 1
    finally:
        back.join()
    store.close()


def test_a_server_that_never_answered_is_a_clear_error_at_once(own_cluster):
    url = own_cluster.url
    own_cluster.halt()
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        JobStore(url)
