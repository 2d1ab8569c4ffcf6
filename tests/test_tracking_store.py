"""A new home's MLflow tracking store opened by several processes at once (`serve` and `start` together)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OPEN = """
import sys
from orchestrator.tracking.client import Tracker
tracker = Tracker(sys.argv[1])
print(tracker.experiment_id("digits"))
"""


def test_processes_opening_a_new_sqlite_store_at_once_all_succeed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    procs = [subprocess.Popen([sys.executable, "-c", OPEN, uri], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1  # one experiment, the same id for everyone
