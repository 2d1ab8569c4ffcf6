"""An ASHA-paused trial waits in line; it is never restarted only to be cancelled when its session stops.

The graph's `decide` node runs against a real SQLite queue and MLflow store (the helpers of
`test_agent_trust`); the jobs' histories are made by hand through the store, as the service would make them.
"""

from __future__ import annotations

from tests.agent.test_agent_trust import SID, _log, _submitted, _trial, agent, parts, state  # noqa: F401 (fixture)


def _run(store, job_id: int) -> None:
    store.claim([(job_id, ["cpu0"])], "h")
    store.mark_running(job_id, 4242, None, host="h")


def _paused(a, store, t: dict, value: float) -> None:
    """What ASHA does to a loser: demoted while running, it checkpoints, exits, and waits in line at -1."""
    _run(store, t["job_id"])
    store.demote(t["job_id"], -1, "ASHA: outside the top 1/3 at step 1")
    store.finish(t["job_id"], 0, host="h")
    t.update(status="paused", stopped_at=1, rungs={"1": value}, judged=[1])


def _baseline(a, values=(0.5, 0.6, 0.7)) -> list:
    out = [_trial(a, i, "baseline", {"seed": s}, v) for i, (s, v) in enumerate(zip(a.seeds[:3], values))]
    for t, v in zip(out, values):
        t.rungs = {"1": v}
    return out


def test_the_session_end_stops_a_paused_trial_before_freeing_any_device(parts):
    """A running trial listed first, a paused one after it: the paused one goes QUEUED -> CANCELLED before the
    running one is asked to stop, so no service pass can hand it the device that cancel frees."""
    store, tracker = parts
    a = agent(parts, trials=2, budget_minutes=1)
    parent = tracker.session_run(SID, "synthetic", {})
    running, paused = _submitted(a, parent, 3, 1.0), _submitted(a, parent, 4, 1.1)
    _run(store, running["job_id"])
    running.update(status="running")
    _paused(a, store, paused, 9.0)
    s = {**state(parent, _baseline(a) + [running, paused]), "elapsed": 120.0}  # the time budget is spent
    out = a.decide(s)
    assert out["phase"] == "done" and out["stop_reason"] == "time budget reached"
    stop_paused = store.events(paused["job_id"])[-1]
    stop_running = store.events(running["job_id"])[-1]
    assert (stop_paused.src, stop_paused.dst) == ("QUEUED", "CANCELLED")  # straight from the line
    assert stop_running.dst == "CANCELLING" and stop_paused.id < stop_running.id
    assert [e.dst for e in store.events(paused["job_id"])].count("RUNNING") == 1  # its first run only


def test_finish_stops_paused_trials_first(parts):
    store, tracker = parts
    a = agent(parts, trials=2)
    parent = tracker.session_run(SID, "synthetic", {})
    queued, paused = _submitted(a, parent, 3, 1.0), _submitted(a, parent, 4, 1.1)
    _paused(a, store, paused, 9.0)
    out = a.finish(state(parent, [queued, paused]))
    assert [t["status"] for t in out["trials"]] == ["cancelled", "stopped"]
    stop_queued, stop_paused = store.events(queued["job_id"])[-1], store.events(paused["job_id"])[-1]
    assert (stop_paused.src, stop_paused.dst) == ("QUEUED", "CANCELLED") and stop_paused.id < stop_queued.id


def test_a_paused_trial_no_later_report_can_promote_is_stopped_while_it_waits(parts):
    """The search has proposed its last trial and every peer has reported at the paused trial's rung: it can no
    longer be promoted, so it is stopped now rather than resumed by the next idle device and cancelled later."""
    store, tracker = parts
    a = agent(parts, trials=2)
    parent = tracker.session_run(SID, "synthetic", {})
    running, paused = _submitted(a, parent, 3, 1.0), _submitted(a, parent, 4, 1.1)
    _run(store, running["job_id"])
    _paused(a, store, paused, 9.0)
    running.update(status="running", rungs={})  # not yet at rung 1: its report there may still promote it
    a.decide(state(parent, _baseline(a) + [running, paused]))
    assert store.get(paused["job_id"]).state == "QUEUED"
    running.update(rungs={"1": 0.4})  # now every peer has a value at rung 1, and the paused one is last there
    out = a.decide(state(parent, _baseline(a) + [running, paused]))
    assert out["phase"] == "search" and store.get(running["job_id"]).state == "RUNNING"  # the search goes on
    last = store.events(paused["job_id"])[-1]
    assert (last.src, last.dst, last.reason) == ("QUEUED", "CANCELLED", "ASHA: no later trial can promote it")


def test_a_budgeted_search_with_no_finished_trial_finishes_its_best_paused_one(parts):
    """Near the end of a time budget, no search trial has finished and the paused ones wait for promotions that
    no new peer will bring: the session stops widening and resumes the paused trial that got furthest (rung 3
    over rung 1, whatever their values), so it ends with a candidate to confirm. Earlier, the same state only
    proposes new trials and promotes nothing (ASHA's rule: too few peers)."""
    from tests.agent.test_agent_trust import Recording

    store, tracker = parts
    rec = Recording()
    parent = tracker.session_run(SID, "synthetic", {})

    def session(elapsed: float, n: int):
        a = agent(parts, proposer=rec, trials=None, budget_minutes=10, confirm_top=1, confirm_seeds=2)
        near, far = _submitted(a, parent, n, 1.0), _submitted(a, parent, n + 1, 1.1)  # new jobs each case
        _paused(a, store, near, 5.0)
        _paused(a, store, far, 6.0)
        far.update(stopped_at=3, rungs={"1": 6.5, "3": 6.0})
        base = _baseline(a)
        for t in base:
            t.device_s = 60.0  # 2 re-runs on 2 slots: one round, 75 s kept; winding down from 150 s left
        return a, {**state(parent, base + [near, far]), "elapsed": elapsed}, near, far

    a, s, near, far = session(elapsed=100.0, n=3)  # 500 s left
    out = a.propose(s)
    assert [t["status"] for t in out["trials"][3:5]] == ["paused", "paused"]
    assert len(out["trials"]) == 5 + 3 and len(rec.seen) == 1  # three new trials fill the free slots

    a, s, near, far = session(elapsed=460.0, n=10)  # 140 s left
    events = []
    a.on_event = events.append
    out = a.propose(s)
    assert len(out["trials"]) == 5 and len(rec.seen) == 1  # nothing new
    assert [t["status"] for t in out["trials"][3:5]] == ["paused", "queued"]  # the furthest one, only it
    assert [store.get(t["job_id"]).priority for t in (near, far)] == [a.cfg.priority - 1, a.cfg.priority]
    (promoted,) = [e for e in events if e["event"] == "promoted"]
    assert promoted["trial"] == far["n"] and promoted["reason"].startswith("promoted to finish")


def test_winding_down_pauses_no_running_search_trial(parts):
    """A running search trial worse than every baseline run at its rung is ASHA's loser early in the budget;
    once the session is winding down it runs on, since it may be the only candidate the session gets."""
    store, tracker = parts
    parent = tracker.session_run(SID, "synthetic", {})
    outcomes = {}
    for n, elapsed in ((3, 100.0), (4, 460.0)):
        a = agent(parts, trials=None, budget_minutes=10, confirm_top=1, confirm_seeds=2)
        running = _submitted(a, parent, n, 1.0)
        _run(store, running["job_id"])
        _log(tracker, running["run_id"], [9.0], total=3)
        running.update(status="running", rungs={"1": 9.0})
        base = _baseline(a)
        for t in base:
            t.device_s = 60.0
        out = a.analyse({**state(parent, base + [running]), "elapsed": elapsed})
        outcomes[elapsed] = (out["trials"][3]["status"], store.get(running["job_id"]).priority)
    assert outcomes[100.0] == ("paused", a.cfg.priority - 1)
    assert outcomes[460.0] == ("running", a.cfg.priority)
