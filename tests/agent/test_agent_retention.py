"""Retention on a real agent session: the session records its trials' phases and ranking on their jobs, `gc`
keeps the best three and the baselines' latest, the leaderboard still lists every trial, and the session's end
is notified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.agent import runner
from orchestrator.agent.session import SessionConfig
from orchestrator.core.config import Settings
from orchestrator.service.gc import run_gc
from orchestrator.queue.store import JobStore

pytestmark = pytest.mark.slow
EXP = "tests.agent.synthetic:SPEC"


def test_a_finished_session_keeps_its_best_three_and_says_it_ended(home, monkeypatch, tmp_path):
    monkeypatch.setenv("STEP_SECONDS", "0.05")
    got = tmp_path / "events.jsonl"
    (home / "config.toml").write_text(f'[[notify]]\ncommand = "cat >> {got}; echo >> {got}"\n'
                                      'events = ["session.finished"]\n')
    summary = runner.start(SessionConfig(goal="minimise the synthetic loss", experiment=EXP, proposer="random",
                                         trials=4, parallel=2, poll=0.2, baseline_seeds=2, confirm_seeds=0,
                                         early_stopping=False),
                           devices="cpu:2")
    store = JobStore(Settings.load().db_url)
    jobs = store.list(owner=summary["session"])
    assert {j.phase for j in jobs} <= {"baseline", "search", "confirm"}
    assert sum(j.phase == "baseline" for j in jobs) == 2
    scored = [j for j in jobs if j.score is not None]
    # The session recorded each succeeded trial's place in its ranking (ASHA's paused-then-cancelled ones
    # have none: they keep nothing once the session has ended).
    assert len(scored) == sum(j.state == "SUCCEEDED" for j in jobs) >= 4
    for job in jobs:  # stand-ins for what a real trial would leave: two complete steps
        for step in (1, 2):
            d = Path(job.checkpoint_dir) / f"step_{step:010d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "__0_0.distcp").write_bytes(b"x" * 1000)
            (d / ".metadata").write_bytes(b"m")
    report = run_gc(Settings.load())
    best = sorted(scored, key=lambda j: (-j.score, j.id))[:3]
    for job in jobs:
        left = sorted(p.name for p in Path(job.checkpoint_dir).iterdir()) if Path(job.checkpoint_dir).exists() else []
        if job in best:
            assert len(left) == 2, job.id
        elif job.phase in ("baseline", "confirm"):
            assert left == ["step_0000000002"], job.id
        else:
            assert left == [], job.id
    assert report.checkpoint_bytes > 0
    board = runner.leaderboard(EXP)[0]
    assert len(board["entries"]) >= len(scored) - 2  # removed checkpoints leave their runs on the board
    event = json.loads(got.read_text().splitlines()[0])
    assert event["event"] == "session.finished" and event["session"] == summary["session"]
    assert event["verdict"] == summary["headline"]
