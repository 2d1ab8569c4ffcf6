"""Opening an MLflow tracking store that is whole: created all at once, never half-made by a process killed midway.

MLflow creates a new store by running a hundred-odd schema migrations, and on SQLite each `CREATE TABLE` commits on
its own. A process killed during that (a service, a session, the tracking worker: `kill -9`, the OOM killer, a
power cut) left a store that MLflow can never open again: the next opener re-runs the migrations from the
recorded revision and stops at the half-done one ("table _alembic_tmp_endpoints already exists"), or refuses
the store as out of date. So a new SQLite store is built beside its path (`NAME.creating`) and renamed into place
once complete: the path holds a whole store or none. A store left half-made by an earlier version of this
product (not at MLflow's head revision, not even its default experiment made) is set aside as
`NAME.incomplete-TIME`, with its journal, and built again; a store with experiments in it is never touched (an
older MLflow's store: MLflow says what to do).
All of it under the store's schema lock (`orchestrator.core.schemalock`), so a fleet opening a new home at once
builds it once. PostgreSQL needs none of this: MLflow migrates it in one transaction.
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any, Optional

from orchestrator.core.schemalock import schema_lock, sqlite_path

_SIDE_FILES = ("-journal", "-wal", "-shm")  # SQLite's own files beside a database: they move with it


class _RaisedAnyway(logging.Filter):
    """Drops MLflow's log of a database error with its traceback (`make_managed_session` logs it, then raises it
    as an MlflowException): the caller gets the exception and says it in one line (a full disk is "waiting for
    space"), so a session's output shows no traceback for an error it handles."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SQLAlchemy database error")


def _quiet_raised_errors() -> None:
    logger = logging.getLogger("mlflow.store.db.utils")
    if not any(isinstance(f, _RaisedAnyway) for f in logger.filters):
        logger.addFilter(_RaisedAnyway())


def open_client(tracking_uri: str, artifacts_dir: Optional[Path] = None) -> Any:
    """An `MlflowClient` on `tracking_uri`, its store created (whole) first if it is new. `artifacts_dir`: where a
    new store's default experiment keeps its artifacts (MLflow's `./mlruns` of the current directory if None)."""
    from mlflow import MlflowClient

    _quiet_raised_errors()
    with schema_lock(tracking_uri, "mlflow"):
        path = sqlite_path(tracking_uri)
        if path is not None:
            ready_sqlite(Path(path), artifacts_dir)
        return MlflowClient(tracking_uri=tracking_uri)


def ready_sqlite(path: Path, artifacts_dir: Optional[Path] = None) -> None:
    """Make `path` a whole MLflow store at the head revision, building it if it is absent, empty or half-made
    (see the module docstring). The caller holds the store's schema lock."""
    path = Path(os.path.realpath(path))  # a link to the store: built beside the file it names
    state = _state(path)
    if state in ("whole", "in use"):
        return
    if state == "half-made":
        aside = path.with_name(f"{path.name}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}")
        _move(path, aside)
        print(f"autoresearch: the MLflow store {path} was left half-made by a process stopped while creating it; "
              f"set aside as {aside.name}, and created again", file=sys.stderr)
    else:  # absent or empty (an opener that connected before anything was made)
        _remove(path)
    _forget_engines(path)
    building = path.with_name(path.name + ".creating")
    _remove(building)  # a build killed earlier: ours, since we hold the lock
    _build(building, artifacts_dir)
    os.replace(building, path)
    _fsync(path.parent)


def _state(path: Path) -> str:
    """"absent" (no file or no tables), "whole" (at MLflow's head revision), "in use" (not at head, but with
    experiments in it: not ours to repair) or "half-made" (a creation that never finished)."""
    if not path.exists():
        return "absent"
    db = sqlite3.connect(path, timeout=60)  # not read-only: that cannot read a WAL database without its -shm
    try:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return "absent"
        version = (db.execute("SELECT version_num FROM alembic_version").fetchall()
                   if "alembic_version" in tables else [])
        scratch = any(name.startswith("_alembic_tmp_") for name in tables)
        if not scratch and version == [(_head_revision(),)]:
            return "whole"
        # MLflow makes the default experiment once its migrations are done: a store with any experiment was whole
        # once (an older MLflow's, or one whose upgrade failed), and holds what someone made.
        if "experiments" in tables and db.execute("SELECT 1 FROM experiments LIMIT 1").fetchone():
            return "in use"
        return "half-made"
    finally:
        db.close()


@functools.lru_cache(maxsize=1)
def _head_revision() -> str:
    """MLflow's current schema revision (reading its migration scripts costs ~50 ms: once per process)."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    return _get_latest_schema_revision()


def _build(path: Path, artifacts_dir: Optional[Path]) -> None:
    """Create a new MLflow store at `path` (MLflow's own migrations and default experiment), then sync it."""
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = artifacts_dir.resolve().as_uri() if artifacts_dir else DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    store = SqlAlchemyStore(f"sqlite:///{path}", root)
    store.engine.dispose()  # closes its connections: nothing of it is left in a journal
    _fsync(path)


def _forget_engines(path: Path) -> None:
    """Drop this process's MLflow engines on `path`: a pooled connection would go on reading and writing the file
    just set aside or removed (an earlier failed open of it, in a process that tries again)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engines = getattr(SqlAlchemyStore, "_engine_map", {})
    for uri in list(engines):
        file = sqlite_path(str(uri))
        if file is not None and os.path.realpath(file) == str(path):
            engines.pop(uri).dispose()


def _move(path: Path, dest: Path) -> None:
    for suffix in ("", *_SIDE_FILES):
        try:
            os.replace(f"{path}{suffix}", f"{dest}{suffix}")
        except FileNotFoundError:
            pass


def _remove(path: Path) -> None:
    for suffix in ("", *_SIDE_FILES):
        try:
            os.unlink(f"{path}{suffix}")
        except FileNotFoundError:
            pass


def _fsync(path: Path) -> None:
    """Sync a file, or a folder's entries (the rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
