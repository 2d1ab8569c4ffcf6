"""Pure parts of the agent: ASHA rungs and decisions, the leaderboard's noise flag, the searched space, budgets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.registry import get
from orchestrator.agent.search import confirm_seeds, fixed_params, full, reduced
from orchestrator.agent.session import SessionConfig
from orchestrator.agent.stopping import ASHA
from orchestrator.core.errors import BadInput
from orchestrator.tracking.client import best_so_far, leaderboard
from tests.agent.synthetic import SPEC


def test_rungs_follow_grace_times_eta_powers_below_the_budget():
    assert ASHA(grace=1, eta=3, max_step=15).rungs() == [1, 3, 9]
    assert ASHA.for_budget(300, "minimize").rungs() == [11, 33, 99]
    assert ASHA(grace=2, eta=2, max_step=20).rungs() == [2, 4, 8]


def test_rung_value_is_the_first_logged_at_or_past_the_rung():
    asha = ASHA(grace=2, eta=3, max_step=30)
    assert asha.rung_values([(1, 9.0), (3, 5.0), (5, 4.0), (7, 3.0)]) == {2: 5.0, 6: 3.0}


def test_stop_outside_top_third_only_with_enough_peers():
    asha = ASHA(grace=1, eta=3, max_step=15, direction="minimize")
    trials = [{"rungs": {"1": v}, "judged": []} for v in (1.0, 2.0)]
    assert [asha.judge(t, trials) for t in trials] == [None, None]  # two peers < eta: no decision yet
    trials = [{"rungs": {"1": v}, "judged": []} for v in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)]
    assert [asha.judge(t, trials) for t in trials] == [None, None, 1, 1, 1, 1]
    assert asha.judge({"rungs": {"1": 6.0}, "judged": [1]}, trials) is None  # judged once per rung


def test_maximize_keeps_the_largest():
    asha = ASHA(grace=1, eta=3, max_step=15, direction="maximize")
    trials = [{"rungs": {"1": v}} for v in (0.1, 0.9, 0.5)]
    assert [asha.judge(t, trials) for t in trials] == [1, None, 1]


def test_paused_trial_is_promoted_when_later_peers_did_worse():
    asha = ASHA(grace=1, eta=3, max_step=15, direction="minimize")
    paused = {"rungs": {"1": 2.0}, "stopped_at": 1}
    early = [paused] + [{"rungs": {"1": v}} for v in (1.0, 1.5)]
    assert asha.promotable([paused], early) == []
    later = early + [{"rungs": {"1": v}} for v in (5.0, 6.0, 7.0, 8.0, 9.0, 10.0)]  # now in the top 3 of 9
    assert asha.promotable([paused], later) == [paused]


def test_the_most_promising_paused_trial_got_furthest_then_did_best_there():
    a = {"n": 0, "rungs": {"1": 0.1}, "stopped_at": 1}  # the best value, but only at the first rung
    b = {"n": 1, "rungs": {"1": 0.5, "3": 0.4}, "stopped_at": 3}
    c = {"n": 2, "rungs": {"1": 0.6, "3": 0.3}, "stopped_at": 3}
    unjudged = {"n": 3, "rungs": {}, "stopped_at": None}
    assert [t["n"] for t in ASHA(direction="minimize").most_promising([a, b, c, unjudged])] == [2, 1, 0]
    assert [t["n"] for t in ASHA(direction="maximize").most_promising([a, b, c])] == [1, 2, 0]


@given(st.lists(st.floats(-1e6, 1e6), min_size=3, max_size=40))
@settings(max_examples=60, deadline=None)
def test_at_least_the_top_fraction_always_continues(values):
    asha = ASHA(grace=1, eta=3, max_step=15)
    trials = [{"rungs": {"1": v}} for v in values]
    kept = [t for t in trials if asha.judge(t, trials) is None]
    assert len(kept) >= max(1, len(values) // 3)
    assert min(values) in [t["rungs"]["1"] for t in kept]


def test_leaderboard_pools_seeds_and_flags_a_lead_within_noise():
    rows = [{"params": {"a": 1, "seed": s}, "value": v, "job_id": i, "source": "session s-1"}
            for i, (s, v) in enumerate([(0, 0.90), (1, 0.80), (2, 0.85)])]
    rows.append({"params": {"a": 2, "seed": 0}, "value": 0.84, "job_id": 9, "source": "by hand (ann)"})
    board = leaderboard(rows, "maximize")
    top = board["entries"][0]
    assert top["params"] == {"a": 1} and top["n"] == 3 and top["mean"] == pytest.approx(0.85)
    assert top["spread"] == pytest.approx(0.05)
    assert board["lead_within_noise"] is True  # 0.85 vs 0.84 is inside a 0.05 spread
    clear = leaderboard(rows[:3] + [{"params": {"a": 2}, "value": 0.5}], "maximize")
    assert clear["lead_within_noise"] is False
    single = leaderboard([{"params": {"a": 1}, "value": 1.0}, {"params": {"a": 2}, "value": 2.0}], "minimize")
    assert single["entries"][0]["params"] == {"a": 1} and single["lead_within_noise"] is None


def test_best_so_far_skips_failures():
    assert best_so_far([3.0, None, 2.0, 4.0], "minimize") == [3.0, 3.0, 2.0, 2.0]
    assert best_so_far([None, 0.5, 0.4], "maximize") == [None, 0.5, 0.5]


def test_search_space_holds_seed_and_budget_fixed():
    digits = get("digits")
    fixed = fixed_params(digits, {"scale": "1", "arch": "mlp"}, seed=0)
    assert fixed == {"epochs": digits.budget["epochs"], "seed": 0, "scale": 1, "arch": "mlp"}
    searched = reduced(digits, fixed)
    assert "seed" not in searched.space and "epochs" not in searched.space and "channels" not in searched.space
    assert searched.space.dims["hidden"].when is None  # its condition is settled by the fixed arch
    params = full(digits, searched.space.validate({}), fixed)
    assert params["epochs"] == digits.budget["epochs"] and params["arch"] == "mlp"
    with pytest.raises(BadInput):
        fixed_params(digits, {"nope": 1}, seed=0)
    with pytest.raises(BadInput):
        fixed_params(digits, {"epochs": "many"}, seed=0)


def test_confirm_seeds_are_fresh_and_stable():
    seeds = confirm_seeds("s-1", 3, avoid=0)
    assert len(set(seeds)) == 3 and 0 not in seeds and seeds == confirm_seeds("s-1", 3, avoid=0)


def test_trial_budget_includes_the_confirmation_reruns():
    # Three re-runs for each of the top two candidates, at most half of what is left after two trials.
    assert SessionConfig(goal="g", experiment="x", trials=14).split() == (8, 6)  # the demo
    assert SessionConfig(goal="g", experiment="x", trials=10).split() == (6, 4)
    assert SessionConfig(goal="g", experiment="x", trials=10, confirm_top=1).split() == (7, 3)
    assert SessionConfig(goal="g", experiment="x", trials=10, confirm_seeds=2).split() == (6, 4)
    assert SessionConfig(goal="g", experiment="x", trials=4).split() == (3, 1)
    assert SessionConfig(goal="g", experiment="x", trials=2).split() == (2, 0)
    assert SessionConfig(goal="g", experiment="x").split() == (14, 6)  # no budget at all: 20 trials
    assert SessionConfig(goal="g", experiment="x", budget_minutes=5).split() == (None, 6)
    for bad in (dict(trials=0), dict(budget_minutes=-1), dict(parallel=0), dict(goal=" ", proposer="llm"), dict(baseline_seeds=0),
                dict(confirm_top=0)):
        with pytest.raises(BadInput):
            SessionConfig(**{"goal": "g", "experiment": "x", **bad})
    assert SPEC.metric == "loss"


def test_a_stopped_trial_whose_result_resume_kept_counts_as_done(home):
    """A session's `stop` cancels its trials in flight; `resume` runs each again, but for one whose job had
    finished its budget as the cancel landed: its result is kept and scored. The queue's count (top, sessions,
    MCP, the Python API) then says what the session's own count says: done, once, and not lost."""
    from orchestrator.agent import background, tally
    from orchestrator.agent.session import stopped_reason
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.queue.store import JobStore

    store = JobStore(Settings.load().db_url)
    sid = "s-kept"
    jobs = {name: store.submit(JobSpec(argv=["true"], owner=sid, phase="search", idempotency_key=f"{sid}:{name}",
                                       track=False)) for name in ("kept", "cut", "cut~1", "queued")}
    for name in ("kept", "cut"):
        store.cancel(jobs[name].id, f"{stopped_reason(sid)} (trial {name})")
    row = {"id": sid, "config": {"goal": "", "experiment": "digits", "proposer": "random", "trials": 4}}
    # before resume: both cancelled trials are neither done nor lost
    assert background.trial_counts(row, store)["search"] == {"done": 0, "submitted": 2, "planned": 3}
    store.keeping.set_scores({jobs["kept"].id: -0.5})  # resume kept its result ("finished its full budget")
    counts = background.trial_counts(row, store)
    assert counts["search"] == {"done": 1, "submitted": 3, "planned": 3}
    trials = [{"phase": "search", "status": "succeeded", "job_id": jobs["kept"].id},
              {"phase": "search", "status": "queued", "job_id": jobs["cut~1"].id},
              {"phase": "search", "status": "queued", "job_id": jobs["queued"].id}]
    assert counts == tally.of_trials(trials, tally.planned(row["config"]))  # the session's own count agrees


def test_reports_number_distinct_steps():
    from orchestrator.agent.outcome import reports

    assert reports([(22, 0.5), (44, 0.7), (44, 0.7), (66, 0.8)]) == [(1, 0.5), (2, 0.7), (3, 0.8)]


def test_trial_counts_are_one_definition_for_the_session_and_the_queue():
    """`--trials 4`: three search trials and one re-run out of the 4, the baseline's 3 seeds on top; the count
    from the session's trials (its output and report) equals the count from its jobs (top, sessions, MCP)."""
    from orchestrator.agent import tally

    plan = tally.planned({"goal": "", "experiment": "digits", "proposer": "random", "trials": 4})
    assert plan == {"baseline": 3, "search": 3, "confirm": 1}
    trials = [{"phase": "baseline", "status": "succeeded", "job_id": i} for i in range(3)]
    trials += [{"phase": "search", "status": s, "job_id": 3 + i} for i, s in enumerate(("succeeded", "stopped",
                                                                                          "running"))]
    trials += [{"phase": "confirm", "status": "cancelled", "job_id": None}]  # recorded, never submitted
    jobs = [("baseline", "SUCCEEDED", 3), ("search", "SUCCEEDED", 1), ("search", "CANCELLED", 1),
            ("search", "RUNNING", 1)]
    assert tally.of_trials(trials, plan) == tally.count(jobs, plan)
    assert tally.text(tally.count(jobs, plan)) == "baseline 3/3, search 2/3, confirm 0/1"
    assert tally.text(tally.count(jobs, plan), short=True) == "b3/3 s2/3 c0/1"  # `sessions` at 80 columns
    assert tally.planned({"program": "/p", "trials": 8})["search"] == 8 and tally.text(tally.count([], {})) == \
        "no trials yet"
