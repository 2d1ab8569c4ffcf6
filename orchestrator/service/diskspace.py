"""Free disk space: the service's preflight of the paths jobs write (checkpoints, logs) and of its own stores.

`DiskWatch.state()` is what a dispatch pass asks (one `statvfs` and one `stat` per path each pass: a few
microseconds, so a disk filled just before a submit is seen by the pass that would start it). When a path falls below `disk_min_free_mb`, the watch first has retention run
(`orchestrator.service.gc`, on a thread of its own) and only then, if space is still short, declares the wait: no
job starts (each waiting job says why), the service logs one line, `top` shows a banner (the service record's
`disk`), the MCP `list_devices` answer carries it, and `disk.low` is notified. When space returns, jobs start
again with no restart, and the service logs one line saying so.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from orchestrator.core.diskfull import is_disk_full

log = logging.getLogger(__name__)
MB = 1024 * 1024
OK, COLLECTING, LOW = "ok", "collecting", "low"


def free_bytes(path: Path) -> int:
    """Bytes free to an unprivileged writer on the filesystem holding `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class Shortage:
    """A path with less free space than the threshold."""

    path: str
    free: int
    threshold: int

    @property
    def reason(self) -> str:
        """The line shown on waiting jobs, in `serve`'s output and on `top`."""
        return (f"waiting: low disk space: {self.free / MB:.0f} MB free on {self.path} "
                f"(disk_min_free_mb = {self.threshold / MB:.0f})")


class DiskWatch:
    """The free-space preflight of one service (thread-safe)."""

    def __init__(self, paths: Sequence[Path], min_free_mb: float, *, collect: Callable[[], None],
                 on_low: Callable[[Shortage], None] = lambda s: None,
                 on_back: Callable[[], None] = lambda: None):
        self.paths = [Path(p) for p in paths]
        self.threshold = int(min_free_mb * MB)
        self._collect, self._on_low, self._on_back = collect, on_low, on_back
        self._lock = threading.Lock()
        self._state = OK
        self._short: Optional[Shortage] = None
        self._collector: Optional[threading.Thread] = None
        self.full_error: Optional[str] = None  # the last write that failed for a full disk (the service's)
        self._noted: set[int] = set()  # queued jobs whose reason says they wait for disk space

    @property
    def shortage(self) -> Optional[Shortage]:
        """The shortage declared (state LOW), else None."""
        return self._short if self._state == LOW else None

    def reading(self) -> Optional[Shortage]:
        """The first path below the threshold now (None: all have room)."""
        if not self.threshold:
            return None
        seen = set()
        for path in self.paths:
            try:
                free = free_bytes(path)
                dev = os.stat(path if path.exists() else path.parent).st_dev
            except OSError:
                continue
            if dev in seen:
                continue
            seen.add(dev)
            if free < self.threshold:
                return Shortage(str(path), free, self.threshold)
        return None

    def state(self) -> str:
        """OK (jobs may start), COLLECTING (short: retention runs first) or LOW (short after retention)."""
        with self._lock:
            if self._state == COLLECTING:
                return COLLECTING  # the retention thread decides what comes next
            short = self.reading()
            if short is None:
                if self._state == LOW:
                    log.warning("disk space is back (%s): jobs start again", ", ".join(map(str, self.paths)))
                    self._on_back()
                self._state, self._short = OK, None
                return OK
            self._short = short
            if self._state == OK:
                self._state = COLLECTING
                self._collector = threading.Thread(target=self._collect_then_decide, name="disk-gc", daemon=True)
                self._collector.start()
            return self._state

    def gate(self, queued: list, note: Callable[[dict[int, str]], None]) -> list:
        """The queued rows (`Queued`) that may start: all of them, or none while space is short (retention
        runs first); the waiting ones get the reason through `note` (once each)."""
        if self.state() == OK:
            self._noted.clear()
            return queued
        short = self.shortage
        if short is not None:
            notes = {row.id: short.reason for row in queued if row.id not in self._noted}
            if notes:
                note(notes)
                self._noted.update(notes)
        return []

    def line(self) -> Optional[str]:
        """What the service record says (top's banner, MCP's `disk_low`): None when all is well."""
        short = self.shortage
        if short is not None:
            return short.reason.removeprefix("waiting: ")
        return self.full_error

    def write_failed(self, exc: BaseException) -> bool:
        """Whether a failed write of the service's (a dispatch pass, housekeeping) failed for a full disk; if so,
        the service record says so (`line`) until `write_ok`."""
        if not is_disk_full(exc):
            return False
        self.full_error = f"disk full: {str(exc).splitlines()[0][:160]}"
        return True

    def write_ok(self) -> None:
        """A dispatch pass committed: the queue database takes writes again (said once, when it had not)."""
        if self.full_error is not None and self.shortage is None:
            log.warning("the queue database takes writes again")
            self.full_error = None

    def _collect_then_decide(self) -> None:
        try:
            self._collect()
        except Exception:  # a failed pass must not leave the watch collecting for ever
            log.exception("retention before a low-disk wait failed")
        with self._lock:
            short = self.reading()
            if short is None:
                self._state, self._short = OK, None
                return
            self._state, self._short = LOW, short
        log.warning("%s: no job starts until space returns", short.reason)
        self._on_low(short)
