"""A fleet that starts at once: many processes opening one fresh queue (and MLflow) database at the same moment all
come up, and the schema is made once (`orchestrator.core.schemalock`)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.orchestrator.helpers import wait_for

ROUNDS = 20
FLEET = 4


def _opener(url_queue, results, barrier) -> None:
    """One member of the fleet: for each URL, wait until every member is ready, then open the queue database
    (creating its schema) and report what happened."""
    from orchestrator.queue.db import Database

    while True:
        url = url_queue.get()
        if url is None:
            return
        barrier.wait()
        try:
            Database(url).close()
            results.put("ok")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put(f"{type(exc).__name__}: {exc}")


def _fresh_schema(conn, name: str, base_url: str) -> str:
    from sqlalchemy.engine import make_url

    with conn.cursor() as cur:
        cur.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        cur.execute(f'CREATE SCHEMA "{name}"')
    return make_url(base_url).update_query_dict({"options": f"-csearch_path={name}"}).render_as_string(
        hide_password=False)


def test_four_processes_open_an_empty_postgres_queue_at_once_twenty_rounds():
    from tests.conftest import PG_DSN, pg_connect

    conn = pg_connect()
    ctx = multiprocessing.get_context("spawn")
    urls, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(FLEET)
    members = [ctx.Process(target=_opener, args=(urls, results, barrier), daemon=True) for _ in range(FLEET)]
    for member in members:
        member.start()
    names = []
    try:
        failures = []
        for round_ in range(ROUNDS):
            name = f"t_fleet_{os.getpid()}_{round_}"
            names.append(name)
            url = _fresh_schema(conn, name, PG_DSN)
            for _ in members:
                urls.put(url)
            outcomes = [results.get(timeout=120) for _ in members]
            failures += [f"round {round_}: {o}" for o in outcomes if o != "ok"]
        assert failures == [], failures
        # Made once, complete: the last round's schema has every table and index of the current release.
        from sqlalchemy import create_engine, inspect
        from sqlmodel import SQLModel

        engine = create_engine(url)
        inspector = inspect(engine)
        assert set(inspector.get_table_names()) >= {t.name for t in SQLModel.metadata.sorted_tables}
        engine.dispose()
    finally:
        for _ in members:
            urls.put(None)
        for member in members:
            member.join(timeout=30)
        with conn.cursor() as cur:
            for name in names:
                cur.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        conn.close()


def test_four_services_start_together_on_an_empty_postgres_queue(pg_url, tmp_path):
    """The real thing, once: four `autoresearch serve` processes (four hosts of one lab) started at the same
    moment on an empty PostgreSQL queue all come up and register as live services."""
    procs = []
    exe = Path(sys.executable).with_name("autoresearch")
    try:
        for i in range(FLEET):
            home = tmp_path / f"host{i}"
            home.mkdir()
            env = dict(os.environ, AUTORESEARCH_HOME=str(home), AUTORESEARCH_DB_URL=pg_url,
                       AUTORESEARCH_NODE=f"host{i}", MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}",
                       AUTORESEARCH_PREFLIGHT="off")
            procs.append(subprocess.Popen([str(exe), "serve", "--devices", "cpu:1"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        from orchestrator.queue.db import Database
        from sqlalchemy import text

        def live() -> int:
            dead = [p for p in procs if p.poll() is not None]
            assert not dead, f"a service exited at start: {dead[0].stderr.read()}"
            try:
                db = Database(pg_url, create=False)
            except Exception:  # noqa: BLE001 - not made yet
                return 0
            try:
                with db.lone_read() as c:
                    return c.execute(text("select count(distinct host) from services")).scalar() or 0
            except Exception:  # noqa: BLE001 - the table is not there yet
                return 0
            finally:
                db.close()

        wait_for(lambda: live() >= FLEET, timeout=120, what="four live services")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def test_sqlite_fleet_opens_one_fresh_queue_at_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    urls, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(FLEET)
    members = [ctx.Process(target=_opener, args=(urls, results, barrier), daemon=True) for _ in range(FLEET)]
    for member in members:
        member.start()
    try:
        for round_ in range(5):
            url = f"sqlite:///{tmp_path / f'queue{round_}.db'}"
            for _ in members:
                urls.put(url)
            outcomes = [results.get(timeout=120) for _ in members]
            assert outcomes == ["ok"] * FLEET
    finally:
        for _ in members:
            urls.put(None)
        for member in members:
            member.join(timeout=30)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_schema_lock_excludes_a_second_holder(backend, tmp_path, request):
    """While one process holds a store's schema lock, another waits for it (and times out when told to)."""
    from orchestrator.core.schemalock import schema_lock

    url = f"sqlite:///{tmp_path / 'q.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    code = ("import sys, time; from orchestrator.core.schemalock import schema_lock\n"
            "with schema_lock(sys.argv[1], 'queue'):\n"
            "    print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(Exception):
            with schema_lock(url, "queue", timeout=0.5):
                pass
        assert time.monotonic() - started >= 0.4
        if backend == "postgres":  # another store in the same database has a lock of its own
            with schema_lock(url, "mlflow", timeout=5):
                pass
    finally:
        holder.kill()
        holder.wait()
    with schema_lock(url, "queue", timeout=10):  # the holder died: its lock went with it
        pass


@pytest.mark.parametrize("url, path", [
    ("sqlite:////abs/home/queue.db", "/abs/home/queue.db"),
    ("sqlite:///relative/mlflow.db", "relative/mlflow.db"),
    ("sqlite+pysqlite:////abs/mlflow.db?timeout=30", "/abs/mlflow.db"),  # a driver and a query: the same file
    ("sqlite://", None),  # in memory: no file to lock, tune or read
    ("sqlite:///:memory:", None),
    ("postgresql+psycopg2://postgres@127.0.0.1:5432/test", None),
    ("http://127.0.0.1:5000", None),
])
def test_one_rule_reads_the_file_of_a_sqlite_url(url, path):
    """The schema lock, the tracking store, the tracking worker's tuning, the queue's engine and a job's metric
    check all name a SQLite store's file by this one rule."""
    from orchestrator.core.schemalock import sqlite_path

    assert sqlite_path(url) == path


def test_a_queue_url_with_a_query_names_its_missing_folder_in_one_line(tmp_path):
    from orchestrator.core.errors import StoreUnavailable
    from orchestrator.queue.db import make_engine

    missing = tmp_path / "no-such-folder"
    with pytest.raises(StoreUnavailable, match=f"directory {missing} does not exist$"):
        make_engine(f"sqlite:///{missing}/queue.db?timeout=30")
