"""Wake the service at once when something it should act on happens (a submit, a cancel).

A datagram on a Unix socket in the home: cheap for the sender (no connection, never blocks) and lossy by
design, since the service also ticks on a timer. PostgreSQL deployments also get LISTEN/NOTIFY (store).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


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
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
