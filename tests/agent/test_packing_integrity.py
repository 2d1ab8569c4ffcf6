"""Research integrity of packing: a trial computes the same thing whether it shares its device or runs alone.

A session on the real digits experiment packs its trials 4 to one `cpu:1` slot (`trials_per_gpu=4`, through the
library call `autoresearch start --trials-per-gpu 4` makes); then each of its trials' params and seed runs again
alone on the same slot. The metric must match bit for bit: the budget is in epochs and seeds, never in k.
"""

from __future__ import annotations

import time

import pytest

from orchestrator.agent import runner
from orchestrator.agent.history import held_intervals
from orchestrator.agent.session import SessionConfig
from orchestrator.core.config import Settings
from orchestrator.queue.store import JobStore
from orchestrator.tracking.client import Tracker

pytestmark = pytest.mark.slow
K = 4


def _overlap(intervals: list[list[tuple[float, float | None]]]) -> bool:
    """Whether two jobs held their device at the same time."""
    spans = sorted((s, e) for job in intervals for s, e in job if e is not None)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_packed_trials_give_the_metric_they_give_alone_bit_for_bit(home):
    config = SessionConfig(goal="", experiment="digits", proposer="random", trials=1, baseline_seeds=2,
                           confirm_seeds=0, fixed={"epochs": 1, "scale": 1}, early_stopping=False, poll=0.2,
                           trials_per_gpu=K)
    summary = runner.start(config, devices="cpu:1")
    assert summary["packing"]["trials_per_gpu"] == K and summary["parallel"] == K
    settings = Settings.load()
    store, tracker = JobStore(settings.db_url), Tracker.from_settings(settings)
    packed = store.list(owner=summary["session"])
    assert len(packed) == 3 and all(j.state == "SUCCEEDED" for j in packed)
    assert all(j.gpu_share == pytest.approx(1 / K) for j in packed)
    assert _overlap([held_intervals(store, j) for j in packed])  # they did share the slot

    from experiments import registry
    from orchestrator.api import jobs as api

    from orchestrator.service.daemon import Service
    from tests.orchestrator.helpers import kill_leftovers

    spec = registry.get("digits")
    service = Service(settings, devices="cpu:1", tick=0.2).start()
    alone = []
    try:
        for job in packed:  # one at a time on the one slot: alone
            made, _ = api.submit(api.job_spec(spec, job.params, name=f"alone-{job.id}", priority=10, gpus=1,
                                              owner="human", max_attempts=1), settings=settings, store=store)
            deadline = time.monotonic() + 180
            while not store.get(made.id).final:
                assert time.monotonic() < deadline, f"job {made.id} did not finish"
                time.sleep(0.2)
            alone.append(store.get(made.id))
    finally:
        kill_leftovers(store)
        service.stop()
    for shared, single in zip(packed, alone):
        assert single.state == "SUCCEEDED" and single.gpu_share is None
        assert single.params == shared.params  # same params, same seed
        a = tracker.history(shared.mlflow_run_id, "val_accuracy")
        b = tracker.history(single.mlflow_run_id, "val_accuracy")
        assert a and a == b  # every epoch's value, bit for bit
