"""An ASHA-paused trial waits in line; it is never restarted only to be cancelled when its session stops.

The graph's `decide` node runs against a real SQLite queue and MLflow store (the helpers of
`test_agent_trust`); the jobs' histories are made by hand through the store, as the service would make them.
"""

from __future__ import annotations

from tests.agent.test_agent_trust import SID, _submitted, _trial, agent, parts, state  # noqa: F401 (fixture)


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
