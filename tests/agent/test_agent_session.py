"""Agent sessions end to end through the real queue service, real processes, real MLflow and SQLite.

The experiment is `tests.agent.synthetic` (a noisy bowl logged over a few fast steps), so a session of a handful
of trials takes seconds; `test_agent_digits.py` runs the real digits experiment.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent import runner
from orchestrator.agent.session import Registry, SessionConfig
from orchestrator.core.config import Settings
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from tests.agent.fake_llm import FakeLLM, ok, sleep, status
from tests.agent.synthetic import SPEC

pytestmark = pytest.mark.slow
EXP = "tests.agent.synthetic:SPEC"
KEY = "sk-test-DO-NOT-LEAK-91ab7c"
ROOT = Path(__file__).resolve().parents[2]
INJECT = ["$(touch /tmp/pwned-by-llm)", "1; rm -rf ~", "`id`"]


@pytest.fixture(autouse=True)
def _quick_steps(monkeypatch):
    """The synthetic job's pace (STEP_SECONDS, inherited by jobs from the embedded service) at 0.05 s a step:
    these sessions depend on how many trials run and in what order, not on how long one lasts. A test that
    needs slow trials sets its own."""
    monkeypatch.setenv("STEP_SECONDS", "0.05")


POLL = 0.2  # the sessions' seconds between looks at the queue


def config(**kw) -> SessionConfig:
    base = dict(goal="minimise the synthetic loss", experiment=EXP, proposer="tpe", trials=6, parallel=2, poll=POLL,
                baseline_seeds=2)
    return SessionConfig(**{**base, **kw})


def session_jobs(home: Path, session: str):
    return JobStore(Settings.load().db_url).list(owner=session)


def llm_answer(body: dict) -> object:
    x = random.uniform(-4, 4)
    return ok({"proposals": [{"params": {"x": x, "y": -2.0, "kind": "b"}, "rationale": f"try x={x:.2f}"}]})


def phase(job) -> str:
    return tracker_tag(job.mlflow_run_id, "autoresearch.phase")


def tracker_tag(run_id: str, tag: str) -> str:
    from orchestrator.tracking.client import Tracker

    return Tracker.from_settings(Settings.load()).client.get_run(run_id).data.tags[tag]


def test_llm_session_submits_only_valid_params_and_never_stores_the_key(home, monkeypatch):
    script = [
        status(429), status(500), sleep(6.0, ok("{}")),                 # retried with backoff, then answered:
        ok({"proposals": [{"params": {"x": 1.0, "y": -1.0, "kind": "b"}, "rationale": "near the centre"}]}),
        ok("Sure! Here are some params: x=3"),                          # 2 short; malformed JSON: re-asked,
        ok({"proposals": [{"params": {"x": 50.0, "y": 0.0, "kind": "a"}}]}),   # out of range: re-asked,
        ok({"proposals": [{"params": {"x": INJECT[0], "y": INJECT[1], "kind": INJECT[2]}}]}),  # re-asks used up: the sampler fills 2
    ]
    with FakeLLM(script, default=llm_answer) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        llm = {"timeout": 3.0, "backoff": 0.01, "max_reasks": 3}
        # One baseline run and K=3 in flight (one waits for a device): the first ask is for 3 proposals.
        summary = runner.start(config(proposer="llm", trials=4, llm=llm, baseline_seeds=1, parallel=3),
                               devices="cpu:2")
    assert summary["trials"] == 1 + 4 and summary["baseline"]["n"] == 1 and summary["headline"]
    from orchestrator.agent.background import sessions

    (listed,) = sessions(session_id=summary["session"])  # what `top`, `sessions` and MCP session_status show
    assert summary["tally"] == listed["tally"] == "baseline 1/1, search 3/3, confirm 1/1"
    jobs = session_jobs(home, summary["session"])
    assert len(jobs) == 5
    assert ["baseline", "llm", "tpe", "tpe", "confirm"] == [
        tracker_tag(j.mlflow_run_id, "autoresearch.proposer") for j in jobs]
    for job in jobs:
        assert SPEC.space.validate(job.params) == job.params
        assert not any(s in json.dumps(job.params) + json.dumps(job.argv) for s in INJECT)
    assert not Path("/tmp/pwned-by-llm").exists()
    assert all(r["authorization"] == f"Bearer {KEY}" for r in fake.requests)
    usage = summary["usage"]
    assert usage["calls"] == 4 and usage["prompt_tokens"] > 0 and usage["retries"] >= 3  # more if the box is slow
    assert usage["rejected"] == 3 and usage["fallbacks"] == 2
    # Tokens and cost are on the session's MLflow run; rationales on the trials' runs.
    from orchestrator.tracking.client import Tracker

    tracker = Tracker.from_settings(Settings.load())
    parent = tracker.client.get_run(summary["mlflow_run_id"])
    assert parent.data.metrics["llm_prompt_tokens"] > 0 and "llm_cost_usd" in parent.data.metrics
    first = tracker.client.get_run(jobs[1].mlflow_run_id)
    assert first.data.tags["autoresearch.rationale"] == "near the centre"
    assert first.data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"]
    # The key never reaches a file under the home: queue, MLflow, agent checkpoints, logs, artifacts.
    leaks = [p for p in home.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaks == []


def test_hand_submitted_run_informs_the_sampler_and_the_leaderboard(home):
    from orchestrator.service.daemon import Service

    settings = Settings.load()
    service = Service(settings, devices="cpu:2").start()
    try:
        store = JobStore(settings.db_url)
        hand = store.submit(JobSpec(argv=SPEC.argv(), name="by-hand", experiment=SPEC.name, owner="ann",
                                    params=SPEC.space.validate({"x": 1.5, "y": -2.0, "kind": "b"}),
                                    cwd=str(ROOT)))
        deadline = time.time() + 60
        while store.get(hand.id).state != "SUCCEEDED" and time.time() < deadline:
            time.sleep(0.2)
        assert store.get(hand.id).state == "SUCCEEDED"

        seen: list[list] = []

        class Recording:
            name = "tpe"

            def __init__(self):
                from orchestrator.agent.proposers.optuna_ import SamplerProposer
                from orchestrator.agent.search import fixed_params, reduced

                self.inner = SamplerProposer(reduced(SPEC, fixed_params(SPEC, {}, 0)), "tpe")

            def propose(self, n, history):
                seen.append(list(history))
                return self.inner.propose(n, history)

        # One baseline run and one proposal start together: the first ask already sees the hand run.
        summary = runner.start(config(trials=1, parallel=2, baseline_seeds=1, confirm_seeds=0),
                               proposer=Recording())
    finally:
        service.stop()
    first = seen[0]
    assert any(o.state == "complete" and o.source == "by hand (ann)" and o.params["x"] == 1.5 for o in first)
    board = runner.leaderboard(EXP)[0]
    assert board["entries"][0]["sources"] == ["by hand (ann)"]  # the hand run sits at the optimum
    assert {s for e in board["entries"] for s in e["sources"]} >= {"by hand (ann)", f"session {summary['session']}"}


def test_target_stops_the_search_then_confirms_on_fresh_seeds(home):
    from orchestrator.agent.proposers.base import Proposal

    class NearTheOptimum:  # so the target is surely reached by the first trials
        name = "tpe"

        def propose(self, n, history):
            return [Proposal({"x": 1.5 + 0.01 * len(history) + 0.001 * i, "y": -2.0, "kind": "b"}, "tpe")
                    for i in range(n)]

    summary = runner.start(config(trials=10, target=1.0, confirm_seeds=2), devices="cpu:2",
                           proposer=NearTheOptimum())
    assert summary["stop_reason"] == "target reached"
    jobs = session_jobs(home, summary["session"])
    assert len(jobs) < 2 + 10
    no_seed = lambda p: {k: v for k, v in p.items() if k != "seed"}  # noqa: E731
    search = {json.dumps(no_seed(j.params), sort_keys=True): j for j in jobs if phase(j) == "search"}
    confirm = [j for j in jobs if phase(j) == "confirm"]
    # The top candidates by mean (two at most; those still running at the target were stopped) are re-run,
    # two fresh seeds each, on the seeds the baseline ran on.
    rerun = {json.dumps(no_seed(j.params), sort_keys=True) for j in confirm}
    assert rerun <= search.keys() and len(rerun) in (1, 2) and len(confirm) == 2 * len(rerun)
    base_seeds = {j.params["seed"] for j in jobs if phase(j) == "baseline"}
    assert base_seeds - {0} <= {j.params["seed"] for j in confirm} and 0 not in {j.params["seed"] for j in confirm}
    winner = summary["winner"]
    assert winner is not None and winner["n"] == 3 and winner["spread"] is not None
    assert summary["headline"].startswith("improvement +") and "over baseline" in summary["headline"]
    board = runner.leaderboard(EXP)[0]
    (marked,) = [e for e in board["entries"] if e["winner"]]  # a lucky single run may rank above it, never win
    assert marked["params"] == winner["params"] and marked["n"] == 3
    assert all(j.state in ("SUCCEEDED", "CANCELLED", "FAILED") for j in jobs)


def test_time_budget_is_honoured(home):
    """The budget logic, not wall-clock tightness: the session ends for the budget, submits nothing after it
    ran out, and leaves no job behind."""
    budget = 0.1 * 60
    summary = runner.start(config(trials=None, budget_minutes=budget / 60, confirm_seeds=0), devices="cpu:2")
    assert summary["stop_reason"] == "time budget reached"
    assert summary["elapsed_s"] >= budget  # it used its budget rather than stopping early
    jobs = session_jobs(home, summary["session"])
    assert jobs and all(j.state in ("SUCCEEDED", "CANCELLED", "FAILED") for j in jobs)
    # The session's clock starts before its first submit (the baseline's), so no proposal made within the budget
    # is submitted later than that submit + the budget + one poll; one made after it would be.
    start = min(j.submitted_at for j in jobs)
    late = [round(j.submitted_at - start - budget, 2) for j in jobs if j.submitted_at > start + budget + POLL]
    assert not late, late


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from orchestrator.faces.cli import main; main()", *args]


def test_kill_9_then_resume_without_duplicates_or_overrun(home):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(_cli("start", "--goal", "g", "--experiment", EXP, "--trials", "4", "--parallel", "2",
                                 "--devices", "cpu:2", "--confirm-seeds", "1", "--baseline-seeds", "2", "--json"),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    store = JobStore(Settings.load().db_url)
    deadline = time.time() + 90
    while time.time() < deadline:
        jobs = [j for j in store.list() if j.owner.startswith("s-")]
        if len(jobs) >= 4:  # three went in at once (2 devices + 1 waiting); the 4th after a trial finished
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the session submitted fewer than 4 trials in 90 s: " + proc.stderr.read().decode()[-2000:])
    os.killpg(proc.pid, signal.SIGKILL)  # the session and its embedded service, mid-flight
    proc.wait()
    registry = Registry(Settings.load().home)
    (row,) = registry.all()
    assert row["status"] == "interrupted"
    done = subprocess.run(_cli("resume", row["id"], "--devices", "cpu:2", "--json"), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    jobs = store.list(owner=row["id"])
    keys = [j.idempotency_key for j in jobs]
    assert len(keys) == len(set(keys)) == 2 + 4  # the baseline plus exactly the budget: nothing twice or extra
    assert sorted(keys) == sorted(f"{row['id']}:{n}" for n in range(6))
    assert summary["trials"] == 6 and registry.get(row["id"])["status"] == "finished"
    # One MLflow child run per trial, even for trials whose run was made just before the kill.
    from orchestrator.tracking.client import Tracker

    tracker = Tracker.from_settings(Settings.load())
    runs = tracker.client.search_runs([tracker.experiment_id(SPEC.name)], "tags.`autoresearch.kind` = 'trial'")
    assert sorted(r.data.tags["autoresearch.key"] for r in runs) == sorted(keys)
    again = subprocess.run(_cli("resume", row["id"]), cwd=ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "already finished" in again.stderr


def test_a_session_killed_as_soon_as_it_names_itself_can_be_resumed(home):
    """`start` names the session (and says how to resume it) only once the registry has it: a kill -9 right after
    that line leaves a session `resume` continues to its verdict, never "no session"."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(_cli("start", "--goal", "g", "--experiment", EXP, "--trials", "2", "--parallel", "2",
                                 "--devices", "cpu:2", "--confirm-seeds", "0", "--baseline-seeds", "1", "--json"),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        line = proc.stderr.readline().decode()
        while line and not line.startswith("session "):
            line = proc.stderr.readline().decode()
        os.killpg(proc.pid, signal.SIGKILL)  # at once: before its first trial, its MLflow run, its checkpoint
    finally:
        proc.kill()
        proc.wait()
    session_id = line.split()[1]
    assert Registry(Settings.load().home).get(session_id)["status"] == "interrupted"
    done = subprocess.run(_cli("resume", session_id, "--devices", "cpu:2", "--json"), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["trials"] == 1 + 2 and Registry(Settings.load().home).get(session_id)[
        "status"] == "finished"


def test_submit_after_a_crash_adopts_what_was_already_made(home):
    """The submit node re-run after a crash: a run made but no job, and a job made but not checkpointed."""
    from orchestrator.agent.graph import Agent
    from orchestrator.tracking.client import Tracker

    settings = Settings.load()
    store, tracker = JobStore(settings.db_url), Tracker.from_settings(settings)
    sid = "s-0000abcd"
    agent = Agent(session_id=sid, config=config(), spec=SPEC, store=store, tracker=tracker, parallel=2,
                  proposer=object())
    parent = tracker.session_run(sid, SPEC.name, {})
    a, b, fresh = (SPEC.space.validate({"x": x}) for x in (1.0, 2.0, 3.0))
    run0 = tracker.trial_run(parent, SPEC.name, key=f"{sid}:0", name="t0", params=a)
    job1 = store.submit(JobSpec(argv=["true"], owner=sid, experiment=SPEC.name, params=b, idempotency_key=f"{sid}:1"))
    state = {"session": sid, "parent_run": parent, "phase": "search", "elapsed": 0.0,
             "trials": [agent._record(0, "search", fresh, "tpe", ""), agent._record(1, "search", fresh, "tpe", "")]}
    t0, t1 = agent.submit(state)["trials"]
    assert t0["params"] == a and t0["run_id"] == run0 and store.get(t0["job_id"]).params == a
    assert t1["params"] == b and t1["job_id"] == job1.id
    again = agent.submit({**state, "trials": [dict(t0, status="proposed"), dict(t1, status="proposed")]})
    assert [t["job_id"] for t in again["trials"]] == [t0["job_id"], job1.id]
    assert len(store.list()) == 2


def test_asha_demotes_losers_and_the_session_cleans_them_up(home, monkeypatch):
    """Two good trials finish; two bad ones meet them at the first rung and are demoted (not killed)."""
    from orchestrator.agent.proposers.base import Proposal

    monkeypatch.setenv("STEP_SECONDS", "0.5")  # jobs inherit the embedded service's environment
    plan = [{"x": 1.5, "y": -2.0, "kind": "b"}, {"x": 1.4, "y": -2.0, "kind": "b"},
            {"x": -5.0, "y": 5.0, "kind": "a"}, {"x": -4.9, "y": 5.0, "kind": "a"}]

    class Scripted:
        name = "tpe"

        def propose(self, n, history):
            return [Proposal(plan.pop(0), "tpe") for _ in range(n)]

    summary = runner.start(config(trials=4, parallel=2, confirm_seeds=0), devices="cpu:2", proposer=Scripted())
    assert summary["counts"] == {"succeeded": 2 + 2, "stopped": 2}  # the baseline's two runs, two good, two bad
    jobs = session_jobs(home, summary["session"])
    good, bad = jobs[2:4], jobs[4:]
    assert all(j.state == "SUCCEEDED" for j in good)
    for j in bad:  # demoted below the session's priority, preempted (checkpointed), cancelled at the end
        assert j.state == "CANCELLED" and j.priority == -1
        events = [e.reason for e in JobStore(Settings.load().db_url).events(j.id)]
        assert any("ASHA" in r for r in events)
