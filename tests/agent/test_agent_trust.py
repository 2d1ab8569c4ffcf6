"""Research you can trust: the baseline goes first, only gated wins count, no finished result is lost.

The graph's nodes run here against a real SQLite queue and a real MLflow store with hand-made job histories,
so the races (a trial finishing between ASHA's rung report and its SIGTERM) are reproduced deterministically;
`test_only_worse_candidates_report_no_improvement` runs a whole session through real processes.
"""

from __future__ import annotations

import pytest

from orchestrator.agent import runner
from orchestrator.agent.graph import Agent
from orchestrator.agent.report import markdown, session_board
from orchestrator.agent.session import SessionConfig
from orchestrator.core.config import Settings
from orchestrator.queue.store import JobStore
from orchestrator.tracking.client import NO_IMPROVEMENT, Tracker, leaderboard
from tests.agent.synthetic import SPEC

EXP = "tests.agent.synthetic:SPEC"
SID = "s-0000beef"


def config(**kw) -> SessionConfig:
    base = dict(goal="minimise the synthetic loss", experiment=EXP, proposer="tpe", trials=10, parallel=2, poll=0.05,
                baseline_seeds=3)
    return SessionConfig(**{**base, **kw})


class Never:
    """A proposer the test must not reach."""

    name = "tpe"

    def propose(self, n, history):  # pragma: no cover - called only if the test is wrong
        raise AssertionError("no proposal expected")


class Recording:
    """Proposes a fixed point and records the history it was shown."""

    name = "tpe"

    def __init__(self):
        self.seen = []

    def propose(self, n, history):
        from orchestrator.agent.proposers.base import Proposal

        self.seen.append(list(history))
        return [Proposal({"x": 1.0 + 0.1 * i, "y": -2.0, "kind": "b"}, "tpe") for i in range(n)]


@pytest.fixture
def parts(home):
    settings = Settings.load()
    return JobStore(settings.db_url), Tracker.from_settings(settings)


def agent(parts, proposer=None, **kw) -> Agent:
    store, tracker = parts
    return Agent(session_id=SID, config=config(**kw), spec=SPEC, store=store, tracker=tracker, parallel=2,
                 proposer=proposer or Never())


def state(parent: str, trials: list[dict], phase: str = "search") -> dict:
    return {"session": SID, "parent_run": parent, "phase": phase, "trials": trials, "elapsed": 0.0, "best": None,
            "usage": {}}


def test_baseline_goes_first_on_distinct_seeds_and_every_proposer_sees_it(parts):
    rec = Recording()
    a = agent(parts, proposer=rec, baseline_seeds=3)
    parent = parts[1].session_run(SID, SPEC.name, {})
    first = a.propose(state(parent, []))["trials"]
    base = [t for t in first if t["phase"] == "baseline"]
    assert [t["n"] for t in base] == [0, 1, 2]  # recorded before anything else
    assert all(t["params"] == SPEC.space.validate({"seed": t["params"]["seed"]}) for t in base)  # the defaults
    assert len({t["params"]["seed"] for t in base}) == 3 and base[0]["params"]["seed"] == 0
    assert len(first) == 3 and rec.seen == []  # capacity (2 slots + 1) is the baseline's: no proposal yet
    first = a.submit(state(parent, first))["trials"]
    assert [j.id for j in parts[0].list(owner=SID)] == [t["job_id"] for t in first]  # queued in that order
    tags = [parts[1].tags(t["run_id"]) for t in first]
    assert all(t["autoresearch.baseline"] == "true" and t["autoresearch.phase"] == "baseline" for t in tags)
    # A slot frees up: the next proposal is made with the baseline in the history.
    first[0].update(status="succeeded", value=6.6)
    first[1].update(status="running")
    nxt = a.propose(state(parent, first))["trials"]
    assert [t["phase"] for t in nxt] == ["baseline"] * 3 + ["search"]
    assert [o.proposer for o in rec.seen[0]].count("baseline") == 3
    assert any(o.proposer == "baseline" and o.state == "complete" and o.value == 6.6 for o in rec.seen[0])


def test_llm_prompt_shows_the_baseline_and_its_noise():
    from orchestrator.agent.proposers.base import Observation
    from orchestrator.agent.proposers.llm import baseline_line

    runs = [Observation({"x": 0.0}, "complete", v, proposer="baseline") for v in (6.5, 6.6, 6.7)]
    line = baseline_line(runs + [Observation({"x": 1.0}, "complete", 1.0, proposer="tpe")], "loss")
    assert "3 seeds" in line and "6.6 ± 0.1" in line and "noise" in line and "0.2" in line


def _trial(a: Agent, n: int, phase: str, params: dict, value: float | None, status: str = "succeeded") -> dict:
    t = a._record(n, phase, SPEC.space.validate(params), phase if phase != "search" else "tpe", "")
    t.update(status=status, value=value)
    return t


def test_confirm_reruns_go_to_the_top_candidates_by_mean_on_the_baselines_seeds(parts):
    a = agent(parts, confirm_top=2, confirm_seeds=2, trials=10)
    parent = parts[1].session_run(SID, SPEC.name, {})
    trials = [_trial(a, i, "baseline", {"seed": s}, 6.6) for i, s in enumerate(a.seeds[:3])]
    # Candidate A has two runs (mean 0.5); B one lucky run (0.4); C one (0.45); D is worse.
    trials += [_trial(a, 3, "search", {"x": 1.0, "seed": 0}, 0.4), _trial(a, 4, "search", {"x": 1.2, "seed": 0}, 0.45),
               _trial(a, 5, "search", {"x": 0.5, "seed": 0}, 0.3), _trial(a, 6, "search", {"x": 0.5, "seed": 7}, 0.7),
               _trial(a, 7, "search", {"x": -3.0, "seed": 0}, 9.0)]
    out = a.propose(state(parent, trials, phase="confirm"))
    confirm = [t for t in out["trials"] if t["phase"] == "confirm"]
    assert out["candidates"] == [3, 4] and out["confirm_planned"]  # ranked by mean: 0.4, 0.45 (0.5 is third)
    assert [t["params"]["x"] for t in confirm] == [1.0, 1.0, 1.2, 1.2]
    assert [t["params"]["seed"] for t in confirm] == a.seeds[1:3] * 2  # the seeds the baseline ran on


def _log(tracker: Tracker, run_id: str, values: list[float], total: int) -> None:
    """What a job logs: its full budget (`total_steps`) when it starts, then the metric at each step."""
    from mlflow.entities import Metric, Param

    tracker.client.log_batch(run_id, params=[Param("total_steps", str(total))],
                             metrics=[Metric("loss", v, 0, i + 1) for i, v in enumerate(values)])


def _submitted(a: Agent, parent: str, n: int, x: float) -> dict:
    return a.submit(state(parent, [_trial(a, n, "search", {"x": x, "kind": "b"}, None, status="proposed")]))[
        "trials"][0]


def test_a_trial_that_finished_before_its_stop_took_effect_counts(parts):
    """The race from the issue: ASHA demotes a trial on its rung value, the trial finishes its last steps
    before the SIGTERM lands, and the session's end then cancels it. Its final value must count."""
    store, tracker = parts
    a = agent(parts)
    parent = tracker.session_run(SID, SPEC.name, {})
    finished, unfinished = _submitted(a, parent, 0, 1.4), _submitted(a, parent, 1, 1.3)
    for t in (finished, unfinished):
        t.update(status="paused", stopped_at=1, rungs={"1": 3.0})  # demoted at its first report
    _log(tracker, finished["run_id"], [3.0, 1.0, 0.2], total=3)  # ... but it reached its full budget
    _log(tracker, unfinished["run_id"], [3.0], total=3)
    for t in (finished, unfinished):
        store.cancel(t["job_id"], f"session {SID}: trial budget used")
    s = state(parent, [finished, unfinished])
    s["trials"] = a.monitor(s)["trials"]
    done, stopped = a.analyse(s)["trials"]
    assert done["status"] == "succeeded" and done["value"] == pytest.approx(0.2)
    assert stopped["status"] == "stopped" and stopped["value"] is None  # it had not finished: it does not count
    assert tracker.client.get_run(done["run_id"]).info.status == "FINISHED"
    # ... and it is on the leaderboard, ranked with the rest.
    board = runner.leaderboard(EXP)[0]
    assert [(e["mean"], e["job_ids"]) for e in board["entries"]] == [(pytest.approx(0.2), [done["job_id"]])]


def test_demotion_reads_the_latest_history_not_a_stale_rung(parts):
    store, tracker = parts
    a = agent(parts)
    parent = tracker.session_run(SID, SPEC.name, {})
    peers = [_trial(a, i, "baseline", {"seed": s}, 0.5) for i, s in enumerate(a.seeds[:3])]
    for p, v in zip(peers, (0.5, 0.6, 0.7)):
        p.rungs = {"1": v}
    trials = [_submitted(a, parent, 3 + i, 1.0 + i / 10) for i in range(3)]
    for t, (curve, total) in zip(trials, (([5.0, 1.0, 0.3], 3), ([5.0, 0.4], 9), ([5.0], 9))):
        t.update(status="running", rungs={"1": 5.0})  # what the last look saw: a loser at rung 1
        _log(tracker, t["run_id"], curve, total)  # since then: finished / now in the top third / still bad
    out = a.analyse(state(parent, peers + trials))["trials"][3:]
    assert [t["status"] for t in out] == ["running", "running", "paused"]
    assert [store.get(t["job_id"]).priority for t in out] == [0, 0, -1]


def test_a_trial_ahead_of_the_baseline_is_not_demoted(parts):
    """Outside the top third at its rung (three better peers), but better than every baseline run there."""
    store, tracker = parts
    a = agent(parts)
    parent = tracker.session_run(SID, SPEC.name, {})
    peers = [_trial(a, i, "baseline", {"seed": s}, 0.5) for i, s in enumerate(a.seeds[:3])]
    for p, v in zip(peers, (2.0, 2.1, 2.2)):
        p.rungs = {"1": v}
    leaders = [_trial(a, 3 + i, "search", {"x": 1.4 + i / 100}, 0.1) for i in range(3)]
    for p in leaders:
        p.rungs = {"1": 0.5}
    (t,) = [_submitted(a, parent, 6, 1.0)]
    t.update(status="running", rungs={"1": 1.5})
    _log(tracker, t["run_id"], [1.5], total=9)
    out = a.analyse(state(parent, peers + leaders + [t]))["trials"][-1]
    assert out["status"] == "running" and store.get(t["job_id"]).priority == 0


def test_leaderboard_shows_changes_from_the_baseline_and_the_gate():
    base = [{"params": {"lr": 0.003, "width": 64, "seed": s}, "value": v, "baseline": True, "job_id": i}
            for i, (s, v) in enumerate([(0, 0.961), (1, 0.961), (2, 0.964)])]
    better = [{"params": {"lr": 0.01, "width": 64, "seed": s}, "value": v, "job_id": 10 + s}
              for s, v in [(0, 0.967), (1, 0.969), (2, 0.972)]]
    lucky = [{"params": {"lr": 0.02, "width": 128, "seed": 0}, "value": 0.99, "job_id": 20}]
    board = leaderboard(base + better + lucky, "maximize")
    top, second, third = board["entries"]
    assert top["n"] == 1 and not top["winner"] and top["diff"] == {"lr": 0.02, "width": 128}  # one run: no win
    assert second["winner"] and second["diff"] == {"lr": 0.01} and second["gap"] == pytest.approx(0.0073, abs=1e-4)
    assert third["baseline"] and third["diff"] == {} and third["gap"] == 0
    assert board["headline"].startswith("improvement +0.00733 (95% CI +")
    assert "over baseline 0.962 ± 0.0017, 3 seeds" in board["headline"]
    assert board["baseline"]["n"] == 3 and board["winner"]["params"] == {"lr": 0.01, "width": 64}
    noise = leaderboard(base + [{**r, "value": r["value"] - 0.006} for r in better], "maximize")
    assert noise["winner"] is None and noise["headline"].startswith(NO_IMPROVEMENT)


def test_leaderboard_table_fits_100_columns_with_diffs(capsys):
    from orchestrator.faces.cli.agent import show

    long = {f"param_{i}": 0.123456 * i for i in range(12)}
    rows = [{"params": {**long, "seed": s}, "value": 0.9 + s / 1000, "baseline": True, "job_id": s} for s in range(3)]
    rows += [{"params": {**long, "param_3": 9.0, "param_7": 1.5, "seed": s}, "value": 0.95 + s / 1000,
              "job_id": 100 + s} for s in range(3)]
    board = {"experiment": "x", "metric": "acc", **leaderboard(rows, "maximize")}
    show([board])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "param_3=9, param_7=1.5" in out and "(baseline)" in out and "param_0" not in out
    assert "improvement +0.05" in out


def test_report_markdown_has_verdict_baseline_and_ranking():
    trials = [{"params": {"x": 0.0, "seed": s}, "value": 6.6 + s / 100, "job_id": s, "status": "succeeded",
               "phase": "baseline"} for s in range(3)]
    trials += [{"params": {"x": 1.5, "seed": s}, "value": 0.1 + s / 100, "job_id": 10 + s, "status": "succeeded",
                "phase": "search" if s == 0 else "confirm"} for s in range(4)]
    board = session_board(SID, trials, "minimize", defaults={"x": 0.0})
    text = markdown({"session": SID, "experiment": "synthetic", "goal": "g", "proposer": "tpe", "stop_reason": "",
                     "trials": 6, "elapsed_s": 1.0, "device_seconds": 2.0, "metric": "loss",
                     "headline": board["headline"], "baseline": board["baseline"], "verdict": board["verdict"],
                     "ranking": board["entries"]})
    assert "**improvement +6.49" in text and "fresh-seed re-runs only" in text
    assert "Baseline (the experiment's defaults): loss 6.61" in text
    assert "| 1 (winner) |" in text and "x=1.5" in text and "**baseline**" in text and "Welch" in text


@pytest.mark.slow
def test_only_worse_candidates_report_no_improvement(home, monkeypatch):
    from orchestrator.agent.proposers.base import Proposal

    monkeypatch.setenv("STEP_SECONDS", "0.05")  # the verdict needs finished trials, not long ones

    class Worse:
        name = "tpe"

        def propose(self, n, history):
            return [Proposal({"x": -3.0 - 0.1 * len(history) - 0.01 * i, "y": 0.0, "kind": "a"}, "tpe")
                    for i in range(n)]

    summary = runner.start(config(trials=4, confirm_seeds=1, confirm_top=1, baseline_seeds=2, poll=0.2),
                           devices="cpu:2", proposer=Worse())
    assert summary["winner"] is None and summary["baseline"]["n"] == 2
    assert summary["headline"].startswith(NO_IMPROVEMENT)
    tracker = Tracker.from_settings(Settings.load())
    parent = tracker.client.get_run(summary["mlflow_run_id"])
    assert parent.data.tags["autoresearch.verdict"].startswith(NO_IMPROVEMENT)
    arts = {a.path for a in tracker.client.list_artifacts(summary["mlflow_run_id"])}
    assert {"report.md", "best_so_far.png"} <= arts
    exp = tracker.client.get_experiment(parent.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_resume_of_an_unknown_session_is_one_line_and_exit_2(home):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", "from orchestrator.faces.cli import main; main()", "resume", "s-unknown"],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "s-unknown" in done.stderr


@pytest.mark.parametrize("baseline,seeds,match", [
    ({"nope": 1}, 3, "no such parameter"),
    ({"steps": 3}, 3, "held fixed"),
    ({"x": 99}, 3, "out of range"),
    ({}, 0, "--baseline-seeds"),
])
def test_bad_baseline_is_refused_before_anything_runs(home, baseline, seeds, match):
    from orchestrator.core.errors import BadInput

    with pytest.raises(BadInput, match=match):
        runner.check(config(baseline=baseline, baseline_seeds=seeds), devices="cpu:2")
    assert JobStore(Settings.load().db_url).list() == []


# -- the winner's curse and multiple comparisons -----------------------------------------------------------------

BASE_ACC = [0.9611, 0.9583, 0.9639]  # digits defaults over 3 seeds: mean 0.9611, std 0.0028
FRESH_ACC = [0.9652, 0.9666, 0.9659]  # a candidate's fresh-seed re-runs: +0.005, inside the seed noise
SELECTED_ACC = 0.9705  # the search run that made it the top candidate: the best of many draws


def _rows(selection_marked: bool) -> list[dict]:
    base = [{"params": {"lr": 0.003, "seed": s}, "value": v, "baseline": True} for s, v in enumerate(BASE_ACC)]
    cand = [{"params": {"lr": 0.01, "seed": 0}, "value": SELECTED_ACC, "selection": selection_marked}]
    cand += [{"params": {"lr": 0.01, "seed": 10 + s}, "value": v} for s, v in enumerate(FRESH_ACC)]
    return base + cand


def test_a_high_selection_run_does_not_make_fresh_reruns_that_match_the_baseline_a_win():
    """Pooled with the run that selected it, the candidate would pass the gate; judged on its fresh re-runs alone
    (what the gate must do: the selecting run is biased upward), it is not a winner."""
    pooled = leaderboard(_rows(selection_marked=False), "maximize")
    assert pooled["winner"] is not None  # the flaw: the selecting run tips the gate
    board = leaderboard(_rows(selection_marked=True), "maximize")
    assert board["winner"] is None
    top = board["entries"][0]
    assert top["params"] == {"lr": 0.01} and top["n"] == 4 and top["n_fresh"] == 3  # ranked on all four runs
    assert not top["winner"] and top["gated"]
    assert board["headline"].startswith(NO_IMPROVEMENT)
    assert "candidate 0.9659 ± 0.0007, 3 seeds" in board["headline"]  # the fresh runs, not the selecting one


def test_only_confirmed_candidates_are_gated_at_a_bonferroni_level():
    """Two confirmed candidates: each is judged at 97.5% (1 - 0.05/2); an unconfirmed one is not gated at all."""
    from orchestrator.core.gate import gate

    base = [{"params": {"lr": 0.003, "seed": s}, "value": v, "baseline": True} for s, v in enumerate(BASE_ACC)]
    # Clears the gate at 95% but not at 97.5%: one of two candidates tested, so not a win.
    edge = [0.9680, 0.9690, 0.9685]
    assert gate(BASE_ACC, edge).win and not gate(BASE_ACC, edge, level=0.975).win
    a = [{"params": {"lr": 0.01, "seed": 0}, "value": 0.975, "selection": True}]
    a += [{"params": {"lr": 0.01, "seed": 10 + s}, "value": v} for s, v in enumerate(edge)]
    b = [{"params": {"lr": 0.02, "seed": 0}, "value": 0.972, "selection": True}]
    b += [{"params": {"lr": 0.02, "seed": 10 + s}, "value": v} for s, v in enumerate(BASE_ACC)]
    lucky = [{"params": {"lr": 0.05, "seed": 0}, "value": 0.99, "selection": True},
             {"params": {"lr": 0.05, "seed": 11}, "value": 0.99}]  # one fresh run: not confirmed, not gated
    board = leaderboard(base + a + b + lucky, "maximize")
    assert board["winner"] is None and "97.5% CI" in board["headline"]
    assert board["gated"] == 2
    assert [e["gated"] for e in board["entries"]] == [False, True, True, False]
    assert "97.5% CI" in board["headline"] and "2 candidates gated, Bonferroni" in board["headline"]
    # Alone (one candidate, no correction) the same re-runs are a win at 95%.
    alone = leaderboard(base + a, "maximize")
    assert alone["gated"] == 1 and alone["winner"]["params"] == {"lr": 0.01}
    assert alone["verdict"]["level"] == 0.95 and alone["headline"].startswith("improvement +")
    assert alone["winner"]["fresh"] == edge


def test_the_cli_leaderboard_reads_selection_runs_from_mlflow_and_agrees_with_the_session(parts):
    """`autoresearch leaderboard` learns which runs selected a candidate from their MLflow phase tags, so it
    reaches the same verdict as the session's own report."""
    store, tracker = parts
    a = agent(parts)
    parent = tracker.session_run(SID, SPEC.name, {})
    loss = lambda acc: round(1 - acc, 4)  # noqa: E731 - the synthetic metric is a loss (minimized)
    planned = [("baseline", {"seed": s}, loss(v)) for s, v in zip(a.seeds[:3], BASE_ACC)]
    planned += [("search", {"x": 1.0, "kind": "b", "seed": 0}, loss(SELECTED_ACC))]
    planned += [("confirm", {"x": 1.0, "kind": "b", "seed": s}, loss(v)) for s, v in zip(a.seeds[1:4], FRESH_ACC)]
    trials = [_trial(a, n, phase, params, None, status="proposed") for n, (phase, params, _) in enumerate(planned)]
    trials = a.submit(state(parent, trials))["trials"]
    for t, (_, _, value) in zip(trials, planned):
        _log(tracker, t["run_id"], [value], total=1)  # a complete run: its full budget reached
        store.cancel(t["job_id"], "test: finished")
        t.update(status="succeeded", value=value)
    board = runner.leaderboard(EXP)[0]
    own = session_board(SID, trials, "minimize")
    assert board["winner"] is None and own["winner"] is None
    assert board["headline"] == own["headline"] and board["headline"].startswith(NO_IMPROVEMENT)
    (cand,) = [e for e in board["entries"] if e["params"].get("x") == 1.0]
    assert cand["n"] == 4 and cand["n_fresh"] == 3
