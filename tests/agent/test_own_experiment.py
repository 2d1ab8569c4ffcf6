"""A user's own training script searched end to end: real queue service, real processes, real MLflow and SQLite.

The scripts are written as a third party would (argparse, print the metric, no import of ours) into a temp
folder with an autoresearch.toml; each runs in a fraction of a second.
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.api import jobs as api
from orchestrator.core import outputmetrics
from orchestrator.agent import runner
from orchestrator.core.gate import gate
from orchestrator.agent.session import SessionConfig
from orchestrator.core.config import Settings
from orchestrator.queue.store import JobStore
from tests.support.own import BOWL_TOML, folder

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def config(experiment: str, **kw) -> SessionConfig:
    base = dict(goal="lower val_loss", experiment=experiment, proposer="tpe", trials=6, parallel=2, poll=0.2,
                baseline_seeds=2, confirm_seeds=2, confirm_top=1)
    return SessionConfig(**{**base, **kw})


def wait_for(predicate, timeout: float = 90.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_identical_reruns_are_judged_as_no_seed_noise_not_a_zero_width_interval():
    exact = gate([1.0, 1.0, 1.0], [0.9, 0.9], direction="minimize", exact=True)
    assert exact.win and exact.exact and "showed no seed noise" in exact.describe() and "CI" not in exact.describe()
    same = gate([1.0, 1.0], [1.0, 1.0], direction="minimize", exact=True)
    assert not same.win and "no improvement" in same.describe()
    # Seeded runs that happen to agree still get the floored interval; spread on either side means Welch.
    assert not gate([1.0, 1.0, 1.0], [0.9999, 0.9999], direction="minimize").exact
    assert not gate([1.0, 1.1], [0.9, 0.9], direction="minimize", exact=True).exact


def test_tpe_searches_a_third_party_script_and_judges_it_without_seed_noise(home, tmp_path):
    root = folder(tmp_path, BOWL_TOML.format(name="bowl"))
    # No early stopping: the script reports progress lines, and which peers ASHA sees at a rung depends on when
    # each trial reports (ASHA on output lines has a test of its own below).
    summary = runner.start(config(str(root), early_stopping=False), devices="cpu:2")
    assert summary["experiment"] == "bowl" and summary["counts"] == {"succeeded": 8}
    assert "the experiment showed no seed noise" in summary["headline"]
    store = JobStore(Settings.load().db_url)
    jobs = store.list(owner=summary["session"])
    assert {j.cwd for j in jobs} == {str(root.resolve())} and {j.experiment for j in jobs} == {"bowl"}
    # Two at a time, each in its own checkpoint dir: the script refuses a folder another live trial writes to.
    assert len({j.checkpoint_dir for j in jobs}) == len(jobs)
    assert all((Path(j.checkpoint_dir) / "out" / "owner").exists() for j in jobs)
    board = runner.leaderboard("bowl")[0]  # by its name afterwards
    assert board["experiment"] == "bowl" and board["baseline"]["n"] == 2 and len(board["entries"]) >= 3
    from orchestrator.agent import background as sessions

    assert [s["experiment"] for s in sessions.sessions(Settings.load())] == ["bowl"]


def test_random_searches_the_example_folder(home):
    # No early stopping: which peers ASHA sees at a rung depends on when each trial reports, and this test is
    # about the example folder being searched and judged, not about the stopping rule.
    summary = runner.start(config(str(ROOT / "examples" / "tinyreg"), proposer="random", trials=3, confirm_seeds=0,
                                  early_stopping=False), devices="cpu:2")
    assert summary["experiment"] == "tinyreg" and summary["counts"] == {"succeeded": 5}
    assert summary["baseline"]["n"] == 2 and summary["baseline"]["spread"] > 0  # seeded: real seed noise
    assert summary["headline"].startswith("no improvement over the baseline found")


def test_asha_pauses_losers_on_their_output_line_progress(home, tmp_path):
    from orchestrator.agent.proposers.base import Proposal

    toml = BOWL_TOML.format(name="slowbowl").replace("steps = 3", "steps = 8, sleep = 0.4")
    root = folder(tmp_path, toml)
    plan = [{"lr": 1e-2, "width": 20, "act": "gelu"}, {"lr": 1.2e-2, "width": 20, "act": "gelu"},
            {"lr": 1.0, "width": 64, "act": "relu"}, {"lr": 0.9, "width": 64, "act": "relu"}]

    class Scripted:
        name = "tpe"

        def propose(self, n, history):
            return [Proposal(plan.pop(0), "tpe") for _ in range(n)]

    summary = runner.start(config(str(root), trials=4, confirm_seeds=0), devices="cpu:2", proposer=Scripted())
    assert summary["counts"] == {"succeeded": 2 + 2, "stopped": 2}
    store = JobStore(Settings.load().db_url)
    bad = [j for j in store.list(owner=summary["session"]) if j.params["lr"] >= 0.9]
    for j in bad:
        assert any("ASHA" in e.reason for e in store.events(j.id))


LOGS_ITSELF = """
import argparse, mlflow
p = argparse.ArgumentParser()
p.add_argument("--lr", type=float)
a = p.parse_args()
mlflow.log_metric("val_loss", 0.25 + a.lr, step=1)   # the run autoresearch made: MLFLOW_RUN_ID is inherited
print("training done")
"""

RESUMABLE = """
import argparse, os, signal, sys, time
p = argparse.ArgumentParser()
p.add_argument("--lr", type=float)
p.add_argument("--steps", type=int)
p.add_argument("--out_dir")
p.add_argument("--init_from", default="scratch")
a = p.parse_args()
state = os.path.join(a.out_dir, "step.txt")
start = int(open(state).read()) if a.init_from == "resume" else 0
print("starting at step", start, flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
for step in range(start + 1, a.steps + 1):
    time.sleep(0.3)
    open(state, "w").write(str(step))
    print(f"step {step}: val loss {a.lr / step:.5f}", flush=True)
    if stop:
        sys.exit(0)
"""


def test_hand_runs_mlflow_metrics_missing_results_and_resume_after_preemption(home, tmp_path):
    from experiments import registry
    from orchestrator.agent.history import Results
    from orchestrator.queue.models import JobSpec
    from orchestrator.service.daemon import Service
    from orchestrator.tracking.client import Tracker

    space = '[space]\nlr = { type = "float", low = 0.0, high = 1.0, default = 0.5 }\n'
    logs = folder(tmp_path, textwrap.dedent("""
        [experiment]
        name = "logs"
        run = "python train.py {args}"
        metric = "val_loss"
        direction = "minimize"
        """) + space, LOGS_ITSELF, name="logs")
    silent = folder(tmp_path, textwrap.dedent("""
        [experiment]
        name = "silent"
        run = "python train.py {args}"
        metric = "val_loss"
        direction = "minimize"
        """) + space, "print('no metric here')", name="silent")
    resumable = folder(tmp_path, textwrap.dedent("""
        [experiment]
        name = "resumable"
        run = "python train.py --out_dir={checkpoint_dir} {args}"
        metric = "val_loss"
        direction = "minimize"
        pattern = 'step (?P<step>\\d+):.* val loss (?P<value>[0-9.]+)'
        resume = "--init_from=resume"
        fixed = { steps = 8 }
        """) + space, RESUMABLE, name="resumable")
    settings = Settings.load()
    service = Service(settings, devices="cpu:1", preempt_after=0).start()
    store = JobStore(settings.db_url)
    tracker = Tracker.from_settings(settings)
    try:
        first, _ = api.submit(api.experiment_spec(str(logs), {"lr": "0.1"}), settings)
        second, _ = api.submit(api.experiment_spec(str(silent), {}), settings)
        long, _ = api.submit(api.experiment_spec(str(resumable), {}, priority=0), settings)
        wait_for(lambda: len(outputmetrics.read(store.get(long.id).checkpoint_dir)) >= 2, what="two reports")
        urgent, _ = api.submit(JobSpec(argv=[sys.executable, "-c", "pass"], priority=20, track=False), settings)
        wait_for(lambda: store.get(long.id).state == "SUCCEEDED", timeout=120, what="the resumed run")
    finally:
        service.stop()
    assert store.get(first.id).state == "SUCCEEDED"
    assert Results(store, tracker, registry.get("logs")).value(store.get(first.id)) == pytest.approx(0.35)
    gone = store.get(second.id)
    assert gone.state == "FAILED"
    assert "no result: the run printed no line matching" in Path(gone.log_path).read_text()
    done = store.get(long.id)
    assert done.preemptions == 1 and store.get(urgent.id).state == "SUCCEEDED"
    log = Path(done.log_path).read_text()
    assert "resuming from the checkpoint dir" in log and "--init_from=resume" in log
    steps = [s for s, _ in outputmetrics.read(done.checkpoint_dir)]
    assert steps == list(range(1, 9))  # it continued its step count: none repeated, none lost
    spec = registry.get("resumable")
    assert Results(store, tracker, spec).value(done) == pytest.approx(0.5 / 8, abs=1e-5)
    assert [s for s, _ in tracker.history(done.mlflow_run_id, "val_loss")] == list(range(1, 9))
