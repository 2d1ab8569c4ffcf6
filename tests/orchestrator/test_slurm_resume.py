"""Through Slurm on one cpu slot: a digits trial preempted mid-run by a higher-priority one (our preemption:
`scancel --batch --signal=TERM`, the wrapper forwarding it to the trial) checkpoints, goes back in line and,
resumed as a new Slurm job, ends with bitwise the same metrics as the uninterrupted trial with the same params.
The scenario and its checks are the local executor's (tests/experiments/test_experiment_resume.py).
"""

from __future__ import annotations

import re
import signal

import pytest

from orchestrator.core.config import Settings
from orchestrator.queue.states import HOLDING
from tests.experiments.test_experiment_resume import history, log_text, preempt_and_resume
from tests.support import slurm as cluster

pytestmark = pytest.mark.usefixtures("slurm_exclusive")  # the shared cluster, one test at a time


@pytest.mark.slow
def test_preempted_digits_trial_resumes_bitwise_through_slurm(home, monkeypatch):
    from experiments import registry
    from orchestrator.service.daemon import Service
    from orchestrator.tracking.client import import_mlflow

    cluster.slurm_node()
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")
    svc = Service(Settings.load(devices="cpu:1", executor="slurm"), preempt_after=0.0, tick=0.2).start()
    try:
        outcome = preempt_and_resume(svc, "digits")
    finally:
        for job in svc.store.list(HOLDING):
            svc.executor.signal(job, signal.SIGKILL)
        svc.stop()
        cluster.cancel_jobs(svc.store)
    victim, reference = outcome["victim"], outcome["reference"]
    assert reference is not None, f"the victim was {victim.state} before it reported progress: {log_text(victim)}"
    log = log_text(victim)
    assert (victim.state, reference.state) == ("SUCCEEDED", "SUCCEEDED"), log + log_text(reference)
    assert victim.preemptions == 1 and victim.attempts == 2 and reference.preemptions == 0
    assert "stopped on request at step" in log and "on slurm (autoresearch-" in log
    assert int(re.search(r"resuming at step (\d+)", log).group(1)) > 0

    spec = registry.get("digits")
    client = import_mlflow().MlflowClient(tracking_uri=svc.settings.tracking_uri)
    for key in {spec.metric, spec.progress_metric, "train_loss"}:
        got, want = history(client, victim.mlflow_run_id, key), history(client, reference.mlflow_run_id, key)
        assert got == want, f"{key}: preempted {got} != uninterrupted {want}"  # exact float equality
