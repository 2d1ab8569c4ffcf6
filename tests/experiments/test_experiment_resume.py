"""Through the real queue on one cpu slot: a trial preempted mid-run by a higher-priority job resumes from
its checkpoint and ends with bitwise the same metrics as an uninterrupted trial with the same params.

The uninterrupted trial is the preemptor itself: it is submitted at a higher priority once the first trial
has logged progress, takes the only slot, runs start to finish, and then the preempted one resumes.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from orchestrator import api
from orchestrator.config import Settings

# Budgets sized so the victim is well past its first progress report and far from done when the
# preemptor arrives, while the whole test stays within seconds of training.
CASES = {
    "charlm": ({"layers": 1, "heads": 2, "width": 32, "block_size": 32, "batch_size": 8, "dropout": 0.1,
                "max_steps": 600, "seed": 7}, re.compile(r"^step \d+/600:", re.M)),
    "digits": ({"epochs": 10, "dropout": 0.2, "seed": 3}, re.compile(r"^epoch 1/10 ", re.M)),
    "tabular": ({"rows": 12000, "epochs": 10, "batch_size": 32, "hidden": 32, "dropout": 0.1, "seed": 5},
                re.compile(r"^epoch 1/10 ", re.M)),
}
FINISHED = {"SUCCEEDED", "FAILED", "CANCELLED"}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def log_text(job) -> str:
    try:
        return Path(job.log_path).read_text(errors="replace") if job.log_path else ""
    except FileNotFoundError:
        return ""


def history(client, run_id: str, key: str) -> dict[int, float]:
    points = client.get_metric_history(run_id, key)
    by_step = {m.step: m.value for m in points}
    assert len(by_step) == len(points), f"{key} logged twice at one step: {points}"
    return by_step


@pytest.fixture
def service(home):
    from orchestrator.service import Service

    svc = Service(Settings.load(), devices="cpu:1", preempt_after=0.0, tick=0.2).start()
    yield svc
    svc.stop()
    for job in svc.store.unfinished():  # the service leaves jobs running when it stops: end ours
        if job.pid:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_preempted_trial_resumes_bitwise(service, name):
    from orchestrator.tracking import import_mlflow

    MlflowClient = import_mlflow().MlflowClient  # the service's warm-up may be importing mlflow right now

    from experiments import registry

    params, progress = CASES[name]
    store = service.store
    victim, _ = api.submit(api.experiment_spec(name, params, priority=0, name=f"{name}-victim"), store=store)
    wait_for(lambda: progress.search(log_text(store.get(victim.id))) or store.get(victim.id).state in FINISHED,
             120, f"{name} victim to report progress")
    assert store.get(victim.id).state == "RUNNING", log_text(store.get(victim.id))
    reference, _ = api.submit(api.experiment_spec(name, params, priority=20, name=f"{name}-reference"),
                              store=store)
    wait_for(lambda: all(store.get(j).state in FINISHED for j in (victim.id, reference.id)), 240,
             f"{name} victim and reference to finish")

    victim, reference = store.get(victim.id), store.get(reference.id)
    log = log_text(victim)
    assert (victim.state, reference.state) == ("SUCCEEDED", "SUCCEEDED"), log + log_text(reference)
    assert victim.preemptions == 1 and reference.preemptions == 0
    assert "stopped on request at step" in log
    resumed_at = int(re.search(r"resuming at step (\d+)", log).group(1))
    assert resumed_at > 0

    spec = registry.get(name)
    client = MlflowClient(tracking_uri=service.settings.tracking_uri)
    for key in {spec.metric, spec.progress_metric, "train_loss"}:
        got, want = history(client, victim.mlflow_run_id, key), history(client, reference.mlflow_run_id, key)
        assert got == want, f"{key}: preempted {got} != uninterrupted {want}"  # exact float equality
    final = client.get_run(victim.mlflow_run_id).data.metrics[spec.metric]
    assert final == client.get_run(reference.mlflow_run_id).data.metrics[spec.metric]
