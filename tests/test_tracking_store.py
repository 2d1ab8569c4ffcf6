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


def test_params_logged_again_keep_the_first_values_and_other_errors_are_raised(home):
    import pytest
    from mlflow.exceptions import MlflowException

    from orchestrator.tracking.client import Tracker

    tracker = Tracker(f"sqlite:///{home / 'mlflow.db'}")
    run = tracker.client.create_run(tracker.experiment_id("params")).info.run_id
    tracker.log_params(run, {"lr": 0.1, "layers": 2})
    tracker.log_params(run, {"lr": 0.1})  # a resumed caller logs the same again
    tracker.log_params(run, {"lr": 0.5, "width": 8})  # a changed value is refused: the run keeps what it ran
    assert tracker.client.get_run(run).data.params == {"lr": "0.1", "layers": "2"}
    with pytest.raises(MlflowException):
        tracker.log_params("0" * 32, {"lr": 0.1})  # no such run: not swallowed
