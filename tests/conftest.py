"""Shared fixtures: every test gets its own AUTORESEARCH_HOME and MLflow store under a temp dir."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.home import prepare_home  # noqa: E402 - once the checkout is importable

# Property tests draw the same examples on every run, so the suite passes or fails the same way everywhere (CI
# included); no example database either, so a machine's earlier failures do not change what runs. To search
# further by hand: pytest --hypothesis-profile=default (random examples, as Hypothesis draws them by default).
hypothesis_settings.register_profile("suite", derandomize=True, database=None)
hypothesis_settings.load_profile("suite")


@pytest.fixture
def home(tmp_path, monkeypatch, mlflow_template) -> Path:
    """A fresh AUTORESEARCH_HOME with SQLite queue and MLflow stores inside it (the MLflow store a copy of the
    run's migrated empty one: still a real, fresh store, without seconds of migrations per test)."""
    return prepare_home(tmp_path / "home", monkeypatch, mlflow_template)


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """One migrated, empty MLflow SQLite store, made once per run, for tests to copy into a fresh home: creating
    one runs MLflow's schema migrations (seconds on a busy 2-core machine), and two processes creating the same
    fresh store at once fail in them. A copy is still a real, fresh store."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


PG_DSN = os.environ.get("AUTORESEARCH_TEST_PG", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


def pg_connect():
    """An autocommit psycopg2 connection to the test server named by PG_DSN (AUTORESEARCH_TEST_PG).

    Where no server answers (none running, bad auth, no such database) the test is skipped with the reason,
    or fails under CI (tests.support.requires)."""
    import psycopg2
    from sqlalchemy.engine import make_url

    from tests.support.requires import require

    url = make_url(PG_DSN)
    try:
        conn = psycopg2.connect(host=url.host, port=url.port or 5432, dbname=url.database, user=url.username,
                                password=url.password, connect_timeout=3)
    except Exception as exc:  # reported below, outside the handler: one clear line, no chained traceback
        conn, why = None, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if conn is None:
        require("PostgreSQL", f"no server at {url.render_as_string(hide_password=True)} ({why}); "
                              "set AUTORESEARCH_TEST_PG to run the PostgreSQL tests")
    conn.autocommit = True
    return conn


@pytest.fixture
def pg_url(request):
    """A PostgreSQL URL with an empty schema of its own (skipped with a reason where no server runs)."""
    import re

    from sqlalchemy.engine import make_url

    name = "t_" + re.sub(r"[^a-z0-9]", "_", request.node.name.lower())[:40] + f"_{os.getpid()}"
    conn = pg_connect()
    with conn.cursor() as cur:
        cur.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        cur.execute(f'CREATE SCHEMA "{name}"')
    url = make_url(PG_DSN).update_query_dict({"options": f"-csearch_path={name}"})
    yield url.render_as_string(hide_password=False)
    with conn.cursor() as cur:
        cur.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """Every queue backend, for contract tests: SQLite in a temp dir and PostgreSQL in its own schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'queue.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def slurm_exclusive():
    """The one-host Slurm cluster for this test alone: Slurm tests drain and down its node and count its jobs, so
    under pytest-xdist (`pytest -n 2`) a second worker's Slurm test waits for this one instead of finding its
    jobs held by another test's drain. A file lock, released by the kernel if the worker dies."""
    import tempfile

    from filelock import FileLock

    with FileLock(os.path.join(tempfile.gettempdir(), "autoresearch-tests-slurm.lock")):
        yield


def pytest_itemcollected(item):
    """Tests on the session's Ray head are one xdist group: one worker starts one head for them, not one each.
    (Marked as each test is collected: pytest-xdist reads the groups in its own `pytest_collection_modifyitems`.)"""
    callspec = getattr(item, "callspec", None)
    on_ray = "ray_head" in getattr(item, "fixturenames", ()) or (
        callspec is not None and callspec.params.get("kind") == "ray")
    if on_ray and item.get_closest_marker("xdist_group") is None:
        item.add_marker(pytest.mark.xdist_group("ray"))
