"""Wake the service at once when something it should act on happens (a submit, a cancel).

Two wake-ups, both lossy by design since the service also ticks on a timer:
- `Listener`: a datagram on a Unix socket in the home (`notify`): cheap for the sender (no connection,
  never blocks), for submits made on this machine;
- `PgListener`: PostgreSQL LISTEN on the channel the store NOTIFYs on every submit, for submits made on
  any host sharing the queue.
"""

from __future__ import annotations

import logging
import os
import select as io_select
import socket
import threading
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger(__name__)
CHANNEL = "autoresearch_jobs"  # the store NOTIFYs it on every submit


def socket_path(home: Path) -> Path:
    return Path(home) / "service.sock"


def notify(home: Path) -> bool:
    """Poke the service of `home`; False when none listens (not an error: the job waits in the queue)."""
    path = str(socket_path(home))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(b"!", path)
        return True
    except OSError:
        return False


class Listener:
    """Calls `callback` for every datagram that arrives on the home's socket (from a daemon thread)."""

    def __init__(self, home: Path, callback: Callable[[], None]):
        self.path = socket_path(home)
        self._callback = callback
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.path.unlink(missing_ok=True)
            self._sock.bind(str(self.path))
        except OSError as exc:  # e.g. a path over the 108-byte limit: the timer still drives the service
            log.warning("no wake-up socket at %s (%s); relying on the timer", self.path, exc)
            self._sock.close()
            self._sock = None
            return
        self._thread = threading.Thread(target=self._loop, name="wakeup", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._sock is not None:
            try:
                self._sock.recv(64)
            except OSError:
                return
            self._callback()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        close_socket(sock, self.path)


def close_socket(sock: Optional[socket.socket], path) -> None:
    """Shut a listening Unix socket down (waking its reader thread) and remove its file; None is a no-op."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
    try:
        os.unlink(path)
    except OSError:
        pass


class PgListener:
    """Calls `callback` whenever PostgreSQL delivers a NOTIFY on `autoresearch_jobs` (a submit on any host).

    A daemon thread LISTENs on its own connection and waits on its socket with select(); it reconnects with
    a backoff when the connection drops, and calls the callback after reconnecting, since notifications sent
    meanwhile are lost."""

    def __init__(self, url: str, callback: Callable[[], None], *, channel: str = CHANNEL):
        self.dsn = _dsn(url)
        self.channel = channel
        self._callback = callback
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._conn = None
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-listen", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = 0.5
        first = True
        while not self._stop.is_set():
            try:
                self._listen(first)
                delay = 0.5
            except Exception as exc:
                log.warning("LISTEN %s failed (%s); reconnecting in %.1fs", self.channel, exc, delay)
            finally:
                self.connected.clear()
                self._close_conn()
            first = False
            self._stop.wait(delay)
            delay = min(delay * 2, 10.0)

    def _listen(self, first: bool) -> None:
        import psycopg2
        import psycopg2.extensions

        conn = psycopg2.connect(self.dsn, connect_timeout=5)
        conn.set_isolation_level(psycopg2.extensions.ISOLATION_LEVEL_AUTOCOMMIT)
        self._conn = conn
        with conn.cursor() as cur:
            cur.execute(f"LISTEN {self.channel}")
        self.connected.set()
        if not first:
            self._callback()  # submits made while we were disconnected
        while not self._stop.is_set():
            ready, _, _ = io_select.select([conn, self._wake_r], [], [], 30.0)
            if self._wake_r in ready:
                return
            conn.poll()  # raises when the connection is gone
            if not ready:
                with conn.cursor() as cur:
                    cur.execute("SELECT 1")  # detect a dead peer on an idle connection
                continue
            if conn.notifies:
                conn.notifies.clear()
                self._callback()

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def close(self) -> None:
        """Stop listening and close the connection."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _dsn(url: str) -> str:
    """A libpq DSN from a SQLAlchemy PostgreSQL URL (options such as search_path are kept)."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    parts = {"host": u.host, "port": u.port, "dbname": u.database, "user": u.username, "password": u.password}
    parts.update({k: v for k, v in u.query.items() if isinstance(v, str)})
    return " ".join(f"{k}='{str(v)}'" for k, v in parts.items() if v is not None)


def listen(home: Path, pg_url: "str | None", callback: Callable[[], None]) -> list:
    """Every wake-up for a service: the home's socket, plus PostgreSQL NOTIFY when `pg_url` is given (other
    hosts' submits). Each returned listener has `close()`."""
    listeners: list = [Listener(home, callback)]
    if pg_url:
        listeners.append(PgListener(pg_url, callback))
    return listeners
