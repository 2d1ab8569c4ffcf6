"""Through the real queue on one cpu slot: a trial preempted mid-run by a higher-priority job resumes from
its checkpoint and ends with bitwise the same metrics as an uninterrupted trial with the same params.

The uninterrupted trial is the preemptor itself: it is submitted at a higher priority once the first trial
has logged progress, takes the only slot, runs start to finish, and then the preempted one resumes.

Each experiment has a home and a one-slot service of its own, exactly as if it ran alone; the three run at
once (one module-scoped fixture), since a job spends most of its life importing torch and MLflow on one core.
Each parametrized test then checks its own experiment's outcome.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from tests.orchestrator.helpers import started

# One module fixture trains all four cases at once: under xdist its tests run on one worker, so it runs once.
pytestmark = pytest.mark.xdist_group("experiment-resume")

# Budgets sized so the victim is well past its first progress report and far from done when the
# preemptor arrives, while the whole test stays within seconds of training.
# A victim stops a few steps after its first report (charlm at about 33 of 300, digits 26 of 110, tabular about
# 400 of 1505), so each run still has most of its budget ahead, from scratch and when resumed.
CASES = {
    "charlm": ({"layers": 1, "heads": 2, "width": 32, "block_size": 32, "batch_size": 8, "dropout": 0.1,
                "max_steps": 300, "seed": 7}, re.compile(r"^step \d+/300:", re.M)),
    "digits": ({"epochs": 5, "dropout": 0.2, "seed": 3}, re.compile(r"^epoch 1/5 ", re.M)),
    "tabular": ({"rows": 12000, "epochs": 5, "batch_size": 32, "hidden": 32, "dropout": 0.1, "seed": 5},
                re.compile(r"^epoch 1/5 ", re.M)),
}
# charlm once more, reading tar shards packed from its files: preempted and resumed bitwise, and bitwise the same
# metrics as from the small files.
CASES["charlm-shards"] = ({**CASES["charlm"][0], "data": "shards"}, CASES["charlm"][1])
EXPERIMENT = {"charlm-shards": "charlm"}
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


def start_service(root: Path, mlflow_template: Path):
    """A one-slot service on a fresh home of its own (its jobs inherit that home in their environment), with its
    MLflow store a copy of the run's migrated empty one (three services migrating at once cost seconds)."""
    from orchestrator.service.daemon import Service

    root.mkdir()
    shutil.copy(mlflow_template, root / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:  # the service copies os.environ for its jobs when made
        mp.setenv("AUTORESEARCH_HOME", str(root))
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        for var in ("AUTORESEARCH_DB_URL", "AUTORESEARCH_DEVICES", "AUTORESEARCH_FAULTS", "OPENAI_API_KEY"):
            mp.delenv(var, raising=False)
        return Service(Settings.load(), devices="cpu:1", preempt_after=0.0, tick=0.2).start()


def stop_service(svc) -> None:
    svc.stop()
    for job in svc.store.unfinished():  # the service leaves jobs running when it stops: end ours
        if job.pid:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def preempt_and_resume(svc, name: str) -> dict:
    """Submit the victim, preempt it with the reference once it has made progress, wait for both to end."""
    params, progress = CASES[name]
    store = svc.store
    experiment = EXPERIMENT.get(name, name)
    victim, _ = api.submit(api.experiment_spec(experiment, params, priority=0, name=f"{name}-victim"),
                           settings=svc.settings, store=store)
    wait_for(lambda: progress.search(log_text(store.get(victim.id))) or store.get(victim.id).state in FINISHED,
             300, f"{name} victim to report progress")
    running = store.get(victim.id)
    if running.state != "RUNNING":
        return {"victim": running, "reference": None}
    reference, _ = api.submit(api.experiment_spec(experiment, params, priority=20, name=f"{name}-reference"),
                              settings=svc.settings, store=store)
    wait_for(lambda: all(store.get(j).state in FINISHED for j in (victim.id, reference.id)), 480,
             f"{name} victim and reference to finish")
    return {"victim": store.get(victim.id), "reference": store.get(reference.id)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, mlflow_template):
    """Every experiment preempted and resumed, each through its own service, all at once:
    {name: {"victim": Job, "reference": Job | None, "settings": Settings} or {"error": exception}}."""
    services = {name: start_service(tmp_path_factory.mktemp(f"resume-{name}") / "home", mlflow_template)
                for name in sorted(CASES)}
    results: dict[str, dict] = {name: {"settings": svc.settings, "store": svc.store} for name, svc in services.items()}

    def run(name: str) -> None:
        try:
            results[name].update(preempt_and_resume(services[name], name))
        except BaseException as exc:  # reported by that experiment's test
            results[name]["error"] = exc

    threads = [threading.Thread(target=run, args=(name,), name=f"resume-{name}") for name in services]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        yield results
    finally:
        for svc in services.values():
            stop_service(svc)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the module's fixture, in the first test's setup, runs all four (seconds to minutes)
@pytest.mark.parametrize("name", sorted(CASES))
def test_preempted_trial_resumes_bitwise(outcomes, name):
    from orchestrator.tracking.client import import_mlflow

    MlflowClient = import_mlflow().MlflowClient  # the service's warm-up may be importing mlflow right now

    from experiments import registry

    outcome = outcomes[name]
    if "error" in outcome:
        raise outcome["error"]
    victim, reference = outcome["victim"], outcome["reference"]
    assert reference is not None, f"the victim was {victim.state} before it reported progress: {log_text(victim)}"
    log = log_text(victim)
    assert (victim.state, reference.state) == ("SUCCEEDED", "SUCCEEDED"), log + log_text(reference)
    assert victim.preemptions == 1 and reference.preemptions == 0
    assert "stopped on request at step" in log
    resumed_at = int(re.search(r"resuming at step (\d+)", log).group(1))
    assert resumed_at > 0

    spec = registry.get(EXPERIMENT.get(name, name))
    client = MlflowClient(tracking_uri=outcome["settings"].tracking_uri)
    # How each attempt started, for a failure's message: a mismatch seen once (digits, epoch 1 of the reference)
    # equalled, bit for bit, what MKL's code path without FMA computes (benchmarks/RESULTS.md).
    how = {"preempted": started(outcome["store"], victim.id), "uninterrupted": started(outcome["store"], reference.id)}
    for key in {spec.metric, spec.progress_metric, "train_loss"}:
        got, want = history(client, victim.mlflow_run_id, key), history(client, reference.mlflow_run_id, key)
        assert got == want, f"{key}: preempted {got} != uninterrupted {want}; attempts started {how}"  # exact
    final = client.get_run(victim.mlflow_run_id).data.metrics[spec.metric]
    assert final == client.get_run(reference.mlflow_run_id).data.metrics[spec.metric]
    if name == "charlm-shards":
        files = outcomes["charlm"]
        assert "error" not in files and files["reference"] is not None, "the run from the small files"
        from_files = MlflowClient(tracking_uri=files["settings"].tracking_uri)
        for key in {spec.metric, "train_loss", spec.holdout_metric}:
            assert history(client, victim.mlflow_run_id, key) == history(from_files, files["reference"].mlflow_run_id,
                                                                         key), f"{key}: shards != small files"
