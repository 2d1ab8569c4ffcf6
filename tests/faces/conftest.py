"""Fixtures for the faces tests: the environment a spawned `autoresearch` needs to see this test's home."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def tracked_home(home):
    """`home`, whose MLflow store is already created (every home's is: see tests/conftest.py)."""
    return home


@pytest.fixture
def child_env(home):
    """Environment for `autoresearch` subprocesses: this home, this checkout first on PYTHONPATH, no preflight."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTORESEARCH_")}
    env.update(AUTORESEARCH_HOME=str(home), MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p]),
               AUTORESEARCH_PREFLIGHT="off")
    return env


@pytest.fixture
def make_service(home):
    """In-process services on this test's home (as tests/orchestrator's fixture): make_service("cpu:2")."""
    from orchestrator.core.config import Settings
    from orchestrator.service.daemon import Service
    from tests.orchestrator.helpers import kill_leftovers

    started = []

    def make(devices="cpu:2", preempt_after=0.0):
        service = Service(Settings.load(), devices=devices, preempt_after=preempt_after, tick=0.2).start()
        started.append(service)
        return service

    yield make
    for service in started:
        kill_leftovers(service.store)
        service.stop()
