"""Fixtures for queue tests: an in-process service on cpu slots, and a poller."""

from __future__ import annotations

import pytest

from orchestrator.core.config import Settings
from tests.orchestrator.helpers import kill_leftovers


@pytest.fixture
def make_service(home):
    """Start in-process services on this test's home: make_service(devices="cpu:2", preempt_after=0)."""
    from orchestrator.service.daemon import Service

    started = []

    def make(devices="cpu:2", preempt_after=0.0, **kw):
        service = Service(Settings.load(), devices=devices, preempt_after=preempt_after, tick=0.2, **kw).start()
        started.append(service)
        return service

    yield make
    for service in started:
        kill_leftovers(service.store)
        if service._home_lock.fh is not None:
            service.stop()
        kill_leftovers(service.store)  # an attempt the running service started after the first pass (a retry)
