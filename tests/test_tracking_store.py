"""A new home's MLflow tracking store opened by several processes at once (`serve` and `start` together)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.orchestrator.test_diskfull import small_fs  # noqa: F401 (fixture: a small mounted filesystem)

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


# Dies by SIGKILL the moment SQLite commits the scratch table of MLflow's first batch migration: where a process
# killed while creating a store leaves it (MLflow's CREATE TABLEs on SQLite commit one by one).
KILLED_MIDWAY = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine

@event.listens_for(Engine, "after_cursor_execute")
def _die(conn, cursor, statement, *args):
    if statement.lstrip().startswith("CREATE TABLE _alembic_tmp_"):
        os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[1] == "mlflow":
    from mlflow import MlflowClient
    MlflowClient(tracking_uri=sys.argv[2])
else:
    from orchestrator.tracking.client import Tracker
    Tracker(sys.argv[2])
"""


def _killed_midway(who: str, uri: str) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLED_MIDWAY, who, uri], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == -9, proc.stderr[-2000:]


def _log_one_metric(uri: str) -> float:
    from orchestrator.tracking.client import Tracker

    tracker = Tracker(uri)
    run = tracker.client.create_run(tracker.experiment_id("digits")).info.run_id
    tracker.client.log_metric(run, "val_loss", 0.5)
    return tracker.client.get_run(run).data.metrics["val_loss"]


def test_a_process_killed_while_creating_a_new_store_leaves_none_and_the_next_creates_it(tmp_path):
    store = tmp_path / "mlflow.db"
    _killed_midway("tracker", f"sqlite:///{store}")
    assert not store.exists()  # half-made only beside it, never at the path
    assert _log_one_metric(f"sqlite:///{store}") == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]


def test_a_store_mlflow_left_half_made_is_set_aside_and_created_again(tmp_path):
    from mlflow import MlflowClient

    store = tmp_path / "mlflow.db"
    uri = f"sqlite:///{store}"
    _killed_midway("mlflow", uri)
    # MLflow alone can never open it again: it re-runs migrations already half-done ("duplicate column name",
    # "table _alembic_tmp_... already exists")
    with pytest.raises(Exception, match="duplicate column|already exists"):
        MlflowClient(tracking_uri=uri).search_experiments()
    assert _log_one_metric(uri) == 0.5
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("mlflow.db.incomplete-")]
    assert len(aside) == 1  # kept, not deleted


def test_a_store_mlflow_finished_once_at_an_older_revision_is_left_to_mlflow(tmp_path):
    """An older MLflow's store (here: only its default experiment, no run yet) is not ours to repair."""
    import sqlite3

    from orchestrator.tracking.client import Tracker

    store = tmp_path / "mlflow.db"
    Tracker(f"sqlite:///{store}")
    with sqlite3.connect(store) as db:
        db.execute("UPDATE alembic_version SET version_num = 'older'")  # an older MLflow's store
    before = store.read_bytes()
    proc = subprocess.run([sys.executable, "-c", OPEN, f"sqlite:///{store}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode != 0 and "out-of-date database schema" in proc.stderr
    assert store.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if "incomplete" in p.name or "creating" in p.name]


FULL_DISK = """
import sys
from mlflow.exceptions import MlflowException
from orchestrator.tracking.client import Tracker

tracker = Tracker(sys.argv[1])
experiment = tracker.experiment_id("digits")
with open(sys.argv[2], "wb", buffering=0) as ballast:  # every free byte of the store's filesystem
    try:
        while True:
            ballast.write(bytes(1 << 20))
    except OSError:
        pass
try:
    for _ in range(100):  # the database's free pages first
        tracker.client.create_run(experiment)
except MlflowException as exc:
    print("raised:", " ".join(str(exc).split()))
"""


def test_a_write_refused_by_a_full_disk_is_raised_without_mlflow_printing_its_traceback(small_fs):  # noqa: F811
    """MLflow logs a database error with its traceback before raising it; the caller says it in one line (a
    session waits for space), so a session's output had a traceback for an error it handled."""
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, f"sqlite:///{small_fs / 'mlflow.db'}",
                           str(small_fs / "ballast")], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "raised:" in proc.stdout and "database or disk is full" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
