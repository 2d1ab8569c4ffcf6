"""The LLM budget: a session pauses at its cap (the trials in flight finish and are judged), resumes under a
higher one, and a dollar cap on a model without a price is refused before anything starts.

Real queue service, real jobs of the synthetic experiment, real MLflow; the LLM is the local fake OpenAI server,
which reports token usage (about a token per four characters) like the real API.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.agent import runner
from orchestrator.agent.session import Registry, SessionConfig
from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.queue.store import JobStore
from orchestrator.tracking.client import Tracker
from tests.agent.fake_llm import FakeLLM, ok

pytestmark = pytest.mark.slow
EXP = "tests.agent.synthetic:SPEC"
ROOT = Path(__file__).resolve().parents[2]


def answer(body: dict):
    rng = random.Random(len(json.dumps(body)))
    return ok({"proposals": [{"params": {"x": rng.uniform(-3, 3), "y": -2.0, "kind": "b"}, "rationale": "a try"}
                             for _ in range(3)]})


def test_a_dollar_budget_needs_a_price(home, monkeypatch):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    done = subprocess.run([sys.executable, "-m", "orchestrator.faces.fastcli", "start", "--goal", "g", "--experiment", EXP,
                           "--proposer", "llm", "--model", "my-local-model", "--llm-budget-usd", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "no price is known for model 'my-local-model'" in done.stderr
    assert Registry(Settings.load().home).all() == []  # nothing was started
    config = SessionConfig(goal="g", experiment=EXP, proposer="llm", model="my-local-model", llm_budget_usd=1.0)
    monkeypatch.setenv("AUTORESEARCH_LLM_PRICE", "0.2,0.8")
    runner.check(config, Settings.load(), "cpu:2")  # with a price it is accepted
    with pytest.raises(BadInput, match="llm-budget-tokens must be > 0"):
        SessionConfig(goal="g", experiment=EXP, llm_budget_tokens=0)


def test_the_session_pauses_at_its_token_cap_and_resumes_under_a_higher_one(home, monkeypatch):
    monkeypatch.setenv("STEP_SECONDS", "0.05")
    with FakeLLM(default=answer) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        # 6 jobs (4 search, 2 re-runs) after one baseline run; a cap the first call's prompt alone crosses, so
        # the pause comes before the search's 4 trials are all proposed, however the first trials' ends fall. A poor
        # baseline (x=-4), so the resumed session ends with a winner and its holdout verdict; no early
        # stopping, so that every trial's end is its full budget.
        config = SessionConfig(goal="minimise the synthetic loss", experiment=EXP, proposer="llm", trials=6,
                               parallel=2, poll=0.2, baseline_seeds=1, llm_budget_tokens=100,
                               baseline={"x": -4.0}, confirm_top=1, early_stopping=False)
        paused = runner.start(config, devices="cpu:2")
        assert paused.get("status") == "paused", (paused.get("stop_reason"), paused.get("usage"), paused["counts"])
        assert "LLM token budget reached" in paused["stop_reason"]
        calls = len(fake.requests)
        used = paused["usage"]["prompt_tokens"] + paused["usage"]["completion_tokens"]
        # Within one call of the cap: it was crossed by the last call made, and no call came after it.
        assert paused["usage"]["calls"] == calls >= 1 and used >= 100
        last = fake.requests[-1]["body"]
        assert used - (len(json.dumps(last["messages"])) // 4 + 200) < 100
        store = JobStore(Settings.load().db_url)
        jobs = store.list(owner=paused["session"])
        # Nothing in flight was lost: every submitted trial ran to its end and was judged.
        assert jobs and all(j.state == "SUCCEEDED" for j in jobs)
        assert paused["counts"] == {"succeeded": len(jobs)} and paused["baseline"]["n"] == 1
        row = Registry(Settings.load().home).get(paused["session"])
        assert row["status"] == "paused" and row["summary"]["usage"]["calls"] == calls
        assert row["llm_usage"] == paused["usage"]  # recorded as it was spent: `usage` shows it while running
        tags = Tracker.from_settings(Settings.load()).tags(paused["mlflow_run_id"])
        assert tags["autoresearch.status"] == "paused" and tags["autoresearch.llm_calls"] == str(calls)

        with pytest.raises(BadInput, match="higher --llm-budget"):  # the same cap would pause again at once
            runner.resumable(paused["session"])
        done = runner.resume(paused["session"], devices="cpu:2", llm_budget_tokens=10**6)
    assert done.get("status") != "paused" and done["stop_reason"] == "trial budget used"
    assert done["usage"]["calls"] > calls and len(fake.requests) == done["usage"]["calls"]
    later = JobStore(Settings.load().db_url).list(owner=paused["session"])
    assert len(later) == 1 + 6 and [j.id for j in later[:len(jobs)]] == [j.id for j in jobs]  # no re-run
    row = Registry(Settings.load().home).get(paused["session"])
    assert row["status"] == "finished" and row["llm_usage"]["calls"] == done["usage"]["calls"]
    # The finished session's verdict carries both figures, read once at its end.
    held = done["holdout"]
    assert held["metric"] == "test_loss" and held["n_baseline"] == 1 and held["n_winner"] == 2 and held["confirmed"]
    assert re.match(r"improvement \+[0-9.]+ \(95% CI \+[0-9.]+\.\.\+[0-9.]+\) over baseline [^;]+ on validation; holdout \+[0-9.]+ "
                    r"\(95% CI [-+][0-9.]+\.\.\+[0-9.]+\)", done["headline"]), done["headline"]
    tracker = Tracker.from_settings(Settings.load())
    tags = tracker.tags(done["mlflow_run_id"])
    assert tags["autoresearch.holdout"] == held["text"] and tags["autoresearch.verdict"] == done["headline"]
    report = tracker.client.download_artifacts(done["mlflow_run_id"], "report.md")
    assert "Holdout (test_loss" in Path(report).read_text()
    from orchestrator.agent.background import sessions

    (listed,) = sessions(session_id=paused["session"])  # what `sessions --json` and MCP session_status show
    assert listed["holdout"] == held and listed["usage"]["calls"] == done["usage"]["calls"]
