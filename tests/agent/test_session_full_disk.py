"""A session whose home's disk fills waits for space and goes on to its verdict, instead of dying with a
traceback: the home on a small tmpfs that a ballast file fills (real ENOSPC and SQLite's "database or disk is
full", no mock), then the ballast removed. Skipped with the reason where mounting is impossible (not root);
under CI=true that fails instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.agent.session import Registry
from orchestrator.core.config import Settings
from orchestrator.queue.store import JobStore
from tests.orchestrator.helpers import wait_for
from tests.orchestrator.test_diskfull import home, small_fs  # noqa: F401 - the fixtures used below

ROOT = Path(__file__).resolve().parents[2]


def fill_up(directory: Path) -> Path:
    """A ballast file that takes every free byte of `directory`'s filesystem (unbuffered: the last write is cut
    short by the disk, then refused)."""
    ballast = directory / "ballast"
    with open(ballast, "wb", buffering=0) as fh:
        while True:
            try:
                fh.write(b"\0" * (1024 * 1024))
            except OSError:
                return ballast


@pytest.mark.slow
def test_a_session_waits_out_a_full_disk_and_reaches_its_verdict(home, tmp_path):
    (home / "config.toml").write_text("disk_min_free_mb = 2\n")  # the service's own wait, sized to this tmpfs
    settings = Settings.load()
    err = tmp_path / "session.err"
    env = {**os.environ, "AUTORESEARCH_HOME": str(home), "STEP_SECONDS": "0.05"}
    env.pop("OPENAI_API_KEY", None)
    env.pop("OPENAI_BASE_URL", None)
    with open(err, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.fastcli", "start", "--experiment",
                                 "tests.agent.synthetic:SPEC", "--proposer", "random", "--trials", "6",
                                 "--baseline-seeds", "1", "--confirm-seeds", "1", "--confirm-top", "1",
                                 "--devices", "cpu:1", "--json"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=out)
    try:
        store = JobStore(settings.db_url)
        wait_for(lambda: any(j.state == "SUCCEEDED" for j in store.list()) or proc.poll() is not None,
                 timeout=180, what="a first trial done")
        assert proc.poll() is None, err.read_text()[-3000:]
        ballast = fill_up(home)
        wait_for(lambda: "is full; waiting for space" in err.read_text() or proc.poll() is not None, timeout=180,
                 what="the session saying it waits for space")
        assert proc.poll() is None, err.read_text()[-2000:]
        ballast.unlink()
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = err.read_text()
    assert proc.returncode == 0, said[-3000:]
    assert "there is space again; going on" in said
    assert "Traceback" not in said
    registry = Registry(home)
    try:
        (row,) = registry.all()
        assert row["status"] == "finished"
    finally:
        registry.close()
    summary = json.loads(out)
    assert summary.get("status") != "paused" and summary["tally"] and summary["baseline"]
