"""One process at a time creates or upgrades a database's schema: a fleet that starts at once.

Several services, `start` sessions and CLI calls opening the same fresh (or older) database at the same moment
would each run `CREATE TABLE`, `ALTER TABLE` and `CREATE INDEX`; two of them racing on PostgreSQL's catalog fail
with a unique violation on `pg_type` (a table's row type) even with `IF NOT EXISTS`. `schema_lock(url)` serialises
that work per database: PostgreSQL's session-level advisory lock (`pg_advisory_lock`, held on one connection of
its own, released when the block ends or the connection dies), SQLite's file lock on `<path>.lock` beside the
database file (released by the kernel when the holder dies, so a `kill -9` mid-upgrade never wedges the next
process). Other backends, and in-memory SQLite, need none. The work inside must be idempotent: the second process
in finds everything made and does nothing.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Iterator, Optional

# Advisory lock keys are one bigint per database; each store under its own key, so that a queue and an MLflow
# store in one PostgreSQL database do not wait for each other.
_KEY_BASE = zlib.crc32(b"autoresearch schema") << 16


def lock_key(url: str, name: str) -> int:
    """The PostgreSQL advisory lock key of one store's schema (`name`: "queue", "mlflow") at `url`: per database
    and search path (stores in different schemas of one database do not wait for each other), whatever host
    name or user reaches it."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    scope = f"{name}|{parsed.database}|{parsed.query.get('options', '')}"
    return _KEY_BASE + (zlib.crc32(scope.encode()) & 0xFFFF)


def sqlite_path(url: str) -> Optional[str]:
    """The database file of a SQLite URL (`sqlite:///PATH`, any driver), without its query string; None for other
    databases and for in-memory SQLite."""
    if not url.startswith("sqlite") or "///" not in url:
        return None
    path = url.split("///", 1)[1].split("?", 1)[0]
    return path if path and path != ":memory:" else None


@contextlib.contextmanager
def schema_lock(url: str, name: str, *, timeout: float = 300.0) -> Iterator[None]:
    """Hold the schema lock of the `name` store at `url` for the block (see the module docstring).

    `timeout`: seconds to wait for another process's upgrade (a SQLite file lock; PostgreSQL waits through
    `lock_timeout`)."""
    path = sqlite_path(url)
    if path is not None:
        from filelock import FileLock

        with FileLock(path + ".lock", timeout=timeout):
            yield
        return
    if not url.startswith("postgres"):
        yield
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    # One connection of its own, closed with the block (nothing pooled): closing it also releases the lock when
    # the block raised.
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"SET lock_timeout = {int(timeout * 1000)}"))
            key = lock_key(url, name)
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
            conn.commit()
            yield
            conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
            conn.commit()
    finally:
        engine.dispose()
