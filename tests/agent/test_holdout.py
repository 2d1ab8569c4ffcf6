"""The holdout: the search never reads it (every proposer, ASHA, the ranking and the gate), the verdict says both.

Finished trials are real queue jobs with real MLflow runs (validation `loss` over three steps, the holdout
`test_loss` once at the end). Each blindness test measures what the search produces, then rewrites every
holdout value to something no validation value could be (the best configurations get +1e6, the worst -1e6)
and measures again: proposals, prompts, observations, rungs and the ranking must not move.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from mlflow.entities import Metric

from orchestrator.agent import runner
from orchestrator.agent.history import Results
from orchestrator.agent.holdout import HoldoutLeak, search_view
from orchestrator.agent.outcome import reports
from orchestrator.agent.proposers.factory import PROPOSERS, make
from orchestrator.agent.stopping import ASHA
from orchestrator.core.config import Settings
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.tracking.client import TAG_PHASE, Tracker
from tests.agent.fake_llm import FakeLLM, ok
from tests.agent.synthetic import SPEC

EXP = "tests.agent.synthetic:SPEC"
GOAL = "minimise the synthetic loss"
# (phase, x, seed, validation loss, holdout loss): a baseline on 3 seeds, four search trials, and the best
# search trial's configuration re-run on 3 fresh seeds (it wins on validation by about 0.5).
RUNS = [("baseline", 0.0, 0, 1.00, 1.02), ("baseline", 0.0, 1, 1.03, 1.00), ("baseline", 0.0, 2, 0.98, 1.01),
        ("search", 1.0, 0, 0.50, 0.95), ("search", -1.0, 0, 1.60, 1.50), ("search", 3.0, 0, 2.10, 2.00),
        ("search", 2.0, 0, 0.90, 0.97),
        ("confirm", 1.0, 3, 0.51, 0.92), ("confirm", 1.0, 4, 0.49, 0.90), ("confirm", 1.0, 5, 0.52, 0.91)]


class World:
    """A home with finished jobs of the synthetic experiment: store, tracker, and the jobs' runs."""

    def __init__(self):
        settings = Settings.load()
        self.store = JobStore(settings.db_url)
        self.tracker = Tracker.from_settings(settings)
        self.runs: list[tuple[str, str, float]] = []  # (run id, phase, validation loss)
        for n, (phase, x, seed, val, test) in enumerate(RUNS):
            params = SPEC.space.validate({"x": x, "seed": seed})
            run = self.tracker.trial_run(None, SPEC.name, key=f"s-0000abcd:{n}", name=f"trial {n}",
                                         params={**params, "total_steps": 3},
                                         tags={TAG_PHASE: phase, "autoresearch.proposer": phase})
            self.tracker.client.log_batch(run, metrics=[Metric("loss", val + 0.5 * (3 - step), 0, step)
                                                        for step in (1, 2, 3)] + [Metric("test_loss", test, 0, 3)])
            job = self.store.submit(JobSpec(argv=["true"], experiment=SPEC.name, params=params, owner="s-0000abcd",
                                            mlflow_run_id=run, priority=0))
            self.store.claim([(job.id, ["cpu:0"])], "host")
            self.store.mark_running(job.id, 1, None)
            self.store.finish(job.id, 0)
            self.runs.append((run, phase, val))

        self.step = 3

    def set_holdout(self, poisoned: bool) -> None:
        """Holdout values no validation loss could be, in the opposite order (best on validation -> worst), or
        the true ones back (logged at a later step: the latest step is what a run's metric says)."""
        self.step += 1
        for (run, _, val), row in zip(self.runs, RUNS):
            value = (1e6 if val < 0.95 else -1e6) if poisoned else row[4]
            self.tracker.client.log_batch(run, metrics=[Metric("test_loss", value, 0, self.step)])

    def observations(self):
        return Results(self.store, search_view(self.tracker, SPEC), SPEC).observations()


@pytest.fixture(scope="module")
def world(tmp_path_factory, mlflow_template):
    """One home for the module (making the runs is most of the cost); each test leaves the holdout true."""
    import shutil

    root = tmp_path_factory.mktemp("holdout") / "home"
    root.mkdir()
    shutil.copy(mlflow_template, root / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTORESEARCH_HOME", str(root))
        mp.delenv("AUTORESEARCH_DB_URL", raising=False)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "AUTORESEARCH_DEVICES"):
            mp.delenv(var, raising=False)
        made = World()
        yield made
        made.set_holdout(False)


@pytest.fixture
def true_holdout(world):
    yield world
    world.set_holdout(False)


def test_the_search_tracker_refuses_the_holdout_and_has_no_raw_client(world):
    view = search_view(world.tracker, SPEC)
    run = world.runs[0][0]
    assert view.final(run, "loss") == pytest.approx(1.0)
    with pytest.raises(HoldoutLeak, match="holdout metric 'test_loss'"):
        view.final(run, "test_loss")
    with pytest.raises(HoldoutLeak):
        view.history(run, "test_loss")
    with pytest.raises(AttributeError):
        view.client  # noqa: B018 (the raw client would read every metric of a run)
    assert world.tracker.final(run, "test_loss") == pytest.approx(1.02)  # it is there, for the report only


def llm_answer(body: dict):
    return ok({"proposals": [{"params": {"x": 1.2 + i / 10, "y": -2.0, "kind": "b"}, "rationale": "near the best"}
                             for i in range(3)]})


@pytest.mark.parametrize("name", PROPOSERS)
def test_no_proposer_changes_when_the_holdout_does(world, true_holdout, name, monkeypatch):
    with FakeLLM(default=llm_answer) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)

        def measure():
            # As a session's own trials (the hybrid's LLM share counts agent-made trials only).
            history = [dataclasses.replace(o, proposer="tpe") for o in world.observations()]
            proposer = make(name, SPEC, GOAL, seed=0, baseline=SPEC.space.defaults())
            proposals = [(p.params, p.proposer, p.rationale) for p in proposer.propose(3, history)]
            prompts = [json.dumps(r["body"]["messages"]) for r in fake.requests]
            fake.requests.clear()
            return history, proposals, prompts

        before = measure()
        world.set_holdout(True)
        after = measure()
    assert after == before
    assert len(before[1]) == 3 and (name not in ("llm", "hybrid") or before[2])  # the LLM was asked
    assert not any("test_loss" in p or "1000000" in p for p in before[2] + after[2])


def test_asha_rungs_and_the_ranking_and_gate_do_not_change_when_the_holdout_does(world, true_holdout):
    view, asha = search_view(world.tracker, SPEC), ASHA(grace=1, eta=3, direction="minimize")

    def measure():
        rungs = [asha.rung_values(reports(view.history(run, SPEC.progress_metric))) for run, _, _ in world.runs]
        (board,) = runner.leaderboard(EXP)
        return rungs, board

    rungs, board = measure()
    world.set_holdout(True)
    rungs_after, board_after = measure()
    assert rungs_after == rungs
    for key in ("entries", "baseline", "winner", "verdict", "gated"):
        assert board_after[key] == board[key], key
    assert board["holdout"]["delta"] == pytest.approx(0.1, abs=0.02)  # what the holdout said before...
    assert board_after["holdout"]["delta"] < -1e5  # ...and after: it is read, but only for the verdict


def test_the_verdict_gives_both_figures_and_warns_when_the_holdout_lead_is_small(world):
    (board,) = runner.leaderboard(EXP)
    assert board["winner"]["params"]["x"] == 1.0 and board["holdout_metric"] == "test_loss"
    held = board["holdout"]
    assert held["n_baseline"] == 3 and held["n_winner"] == 3  # the baseline's runs and the fresh re-runs only
    assert held["confirmed"] and held["ci"][0] > 0
    head = board["headline"]
    assert re.match(r"improvement \+0\.\d+ \(95% CI \+[0-9.]+\.\.\+[0-9.]+\) over baseline [^;]+ on validation; "
                    r"holdout \+0\.\d+ \(95% CI \+[0-9.]+\.\.\+[0-9.]+\)\. Warning: the holdout lead is less "
                    r"than half the validation lead", head), head
    assert "includes zero" not in head
