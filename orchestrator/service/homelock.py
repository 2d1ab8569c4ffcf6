"""The one-service-per-home lock: an exclusive `flock` on `HOME/service.lock`, which holds the owner's pid.

The kernel drops the lock when its holder dies, even by `kill -9`, so a stale lock never needs cleaning up.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO, Optional

from orchestrator.core.errors import ServiceAlreadyRunning

LOCK_FILE = "service.lock"


def held(home: Path) -> bool:
    """Whether some process holds `home`'s lock right now."""
    path = Path(home) / LOCK_FILE
    if not path.exists():
        return False
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


class HomeLock:
    """`home`'s lock, once `take`n by this process (`fh` is its open file while held)."""

    def __init__(self, home: Path):
        self.home = Path(home)
        self.fh: Optional[IO[str]] = None

    def take(self) -> None:
        """Take the lock and write our pid in it; ServiceAlreadyRunning (with the holder's pid) if held."""
        fh = open(self.home / LOCK_FILE, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            pid = fh.read().strip() or "?"
            fh.close()
            raise ServiceAlreadyRunning(f"a service is already running for {self.home} (pid {pid}); "
                                        "stop it first or use another AUTORESEARCH_HOME") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self.fh = fh

    def release(self) -> None:
        """Give the lock back (nothing when not held)."""
        if self.fh is not None:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()
            self.fh = None
