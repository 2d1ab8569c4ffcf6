"""The queue's database: one SQLAlchemy engine per URL (SQLite in WAL mode, or PostgreSQL) and transactions.

`Database` is the handle every part of the store shares (`JobStore.db`: the job reads and transitions, the
hosts' records, the runs' and the retention records each hold it); it knows connections and transactions,
nothing about jobs. Code outside the store that keeps its own tables in the queue's database (projects, the
usage ledger) reads and writes through the same four doors: `tx`, `read`, `reading` and `lone_read`.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError
from sqlmodel import Session, SQLModel, create_engine

from orchestrator.core.errors import StoreUnavailable
from orchestrator.core.schemalock import schema_lock, sqlite_path


def _sqlite_engine(url: str) -> Engine:
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # noqa: ANN001
        # Take the write lock up front: read-then-write transactions never deadlock on lock upgrade. A lone
        # read (`Database.lone_read`) begins nothing: the driver runs its one SELECT in autocommit, without
        # queueing behind the writers.
        # A read (`Database.read`, `Database.reading`) begins a deferred transaction: in WAL mode it reads one
        # snapshot and never waits for the write lock nor takes it.
        options = conn.get_execution_options()
        if options.get("read"):
            conn.exec_driver_sql("BEGIN")
        elif not options.get("lone_read"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def make_engine(url: str) -> Engine:
    """An engine for `url` (SQLite gets WAL, a busy timeout and immediate transactions)."""
    if url.startswith("sqlite"):
        path = sqlite_path(url)
        if path is not None:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise StoreUnavailable(f"cannot open queue database {url}: directory {parent} does not exist")
        return _sqlite_engine(url)
    return _ride_through_restarts(create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5))


RECONNECT_S = 60.0  # how long a process that has reached its PostgreSQL server waits for it to come back


def _ride_through_restarts(engine: Engine, seconds: float = RECONNECT_S) -> Engine:
    """New connections to a server that answered before are retried for `seconds` (backing off to 2 s), so that a
    restart of PostgreSQL (an upgrade, a failover, `pg_ctl restart`: refused or "shutting down" for a few
    seconds) is a pause for the services and sessions holding this engine, not their death with a traceback.
    The first connection is not retried: a server that never answered is a clear error at once."""
    reached = threading.Event()

    @event.listens_for(engine, "do_connect")
    def _connect(dialect, _record, cargs, cparams):  # noqa: ANN001
        deadline = time.monotonic() + (seconds if reached.is_set() else 0.0)
        delay = 0.1
        while True:
            try:
                conn = dialect.loaded_dbapi.connect(*cargs, **cparams)
            except dialect.loaded_dbapi.OperationalError:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            reached.set()
            return conn

    return engine


class Database:
    """A connection to the queue's SQL database (SQLite or PostgreSQL), with the schema created."""

    def __init__(self, url: str, *, create: bool = True):
        self.url = url
        self.is_postgres = url.startswith("postgres")
        try:
            self.engine = make_engine(url)
            self._read_engine = self.engine.execution_options(read=True)  # same pool, see `read`
            self._open = threading.local()  # this thread's session while it holds `transaction()`
            if create:
                with schema_lock(url, "queue"):  # a fleet opening a fresh database at once: one creates it
                    SQLModel.metadata.create_all(self.engine)
                    add_missing_columns(self.engine)
                    add_missing_indexes(self.engine)
            else:
                with self.engine.connect():
                    pass
        except OperationalError as exc:
            first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc).splitlines()[0]
            raise StoreUnavailable(f"cannot reach queue database {redact(url)}: {first}") from None
        except StoreUnavailable:
            raise
        except Exception as exc:  # bad URL, missing driver
            raise StoreUnavailable(f"cannot open queue database {redact(url)}: {exc}") from None

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Make this thread's store calls in the block one transaction: they commit together at its end, or
        none does when it raises; reads inside see the block's writes. (The dispatcher's pass: its records, its
        reads and its claim in one commit.) A transition that raises inside leaves nothing of its own written
        (`JobStore` writes each call's transitions at its end), so the block may go on after it."""
        if getattr(self._open, "session", None) is not None:
            yield
            return
        with self.tx() as session:
            self._open.session = session
            try:
                yield
            finally:
                self._open.session = None

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """A session for a read-then-write: its changes commit at the block's end (inside `transaction()`,
        with that block's). On SQLite it takes the write lock up front (`BEGIN IMMEDIATE`)."""
        session = getattr(self._open, "session", None)
        if session is not None:  # inside `transaction()`: its session
            yield session
            return
        with Session(self.engine, expire_on_commit=False) as session:
            with session.begin():
                yield session

    @contextmanager
    def lone_read(self) -> Iterator[Connection]:
        """A Core connection for one read statement: on SQLite no transaction and no write lock (the hot
        paths' small reads: a submit's check of the live services, a pass's devices). Not an isolation level
        change: the pool's reset of one would turn the driver's implicit transactions back on."""
        session = getattr(self._open, "session", None)
        if session is not None:  # inside `transaction()`: read what it has written
            yield session.connection()
            return
        with self.engine.connect() as conn:
            yield conn.execution_options(lone_read=True)

    def read(self) -> Session:
        """An ORM session for reads only. On SQLite its transaction is deferred (one snapshot of the WAL), so a
        reader neither takes the write lock nor waits for a writer that holds it: `show`, `queue`, `top` and
        the MCP reads stay quick while the service commits."""
        return Session(self._read_engine, expire_on_commit=False)

    def reading(self) -> Connection:
        """`read` as a Core connection (a context manager), for reads of several statements."""
        return self._read_engine.connect()


def add_missing_columns(engine: Engine) -> list[str]:
    """Bring a queue database made by an older release up to the current tables: columns added since then are
    nullable, so adding them is all an upgrade needs (`create_all` creates only missing tables). Returns the
    `table.column` names added. Run under the schema lock (`Database`); a process without it doing the same at
    once is still harmless (its ALTER fails, the column is there)."""
    from sqlalchemy import inspect, text

    added = []
    inspector = inspect(engine)
    for table in SQLModel.metadata.sorted_tables:
        have = {col["name"] for col in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            if not column.nullable:
                raise StoreUnavailable(f"queue table {table.name} lacks the non-null column {column.name}; "
                                       "it was made by an incompatible release")
            kind = column.type.compile(dialect=engine.dialect)
            default = column.server_default
            if default is not None and isinstance(getattr(default, "arg", None), str):
                kind += " DEFAULT '" + default.arg.replace("'", "''") + "'"  # the old rows get it too
            try:
                with engine.connect() as conn:
                    conn.execute(text(f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}'))
                    conn.commit()
            except OperationalError:
                if column.name not in {col["name"] for col in inspect(engine).get_columns(table.name)}:
                    raise
            except Exception as exc:  # PostgreSQL: DuplicateColumn arrives as ProgrammingError
                if column.name not in {col["name"] for col in inspect(engine).get_columns(table.name)}:
                    raise StoreUnavailable(f"cannot add column {table.name}.{column.name}: {exc}") from None
            added.append(f"{table.name}.{column.name}")
    return added


def add_missing_indexes(engine: Engine) -> None:
    """Create the indexes added since a database was made (`create_all` skips the indexes of tables that
    exist). A second process doing the same at once is harmless."""
    from sqlalchemy import inspect

    inspector = inspect(engine)
    for table in SQLModel.metadata.sorted_tables:
        have = {ix["name"] for ix in inspector.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in have:
                try:
                    index.create(engine, checkfirst=True)
                except Exception:  # noqa: BLE001 - created meanwhile by another process, or not needed to work
                    pass


def redact(url: str) -> str:
    """Hide a password in a database URL before it reaches a message."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in creds else url
    return url
