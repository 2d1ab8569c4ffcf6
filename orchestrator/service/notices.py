"""What the service announces through `[[notify]]` (`orchestrator.service.notify`): the jobs that ended for good
in a committed dispatch pass, a device quarantined, the disk running low.

The dispatcher only notes the ended jobs; they are looked up and announced on a thread of their own once the
pass has committed (a pass that rolls back records its exits again later, so its notes are dropped), and the
notifier delivers from threads of its own: a slow or hanging endpoint never holds up the queue.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from orchestrator.core.config import Settings
from orchestrator.queue.states import JobState
from orchestrator.queue.store import JobStore
from orchestrator.service.notify import Notifier, job_notice
from orchestrator.core.diskfull import log_failure
from orchestrator.service.diskspace import Shortage

log = logging.getLogger(__name__)
_ANNOUNCED = (JobState.FAILED.value, JobState.SUCCEEDED.value)


class ServiceNotices:
    """The service's notifications: its notifier, and the jobs a pass ended, announced after it commits."""

    def __init__(self, settings: Settings, store: JobStore, host: str):
        self.notifier = Notifier.from_settings(settings)
        self._store, self._host = store, host
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="notices")
        self._ended: list[int] = []  # jobs the pass being written ended for good

    def ended(self, rows: Iterable[Any]) -> None:
        """Note the jobs among `rows` (a pass's transitions) that ended for good, for `flush` to announce."""
        rows = list(rows or [])
        if rows and (self.notifier.wants("job.failed") or self.notifier.wants("job.succeeded")):
            self._ended.extend(row.id for row in rows if row.final and row.state in _ANNOUNCED)

    def discard(self) -> None:
        """The pass rolled back: its exits are recorded (and noted) again by a later one."""
        self._ended.clear()

    def flush(self) -> None:
        """Announce the jobs noted since the last flush (the pass that ended them has committed)."""
        ended, self._ended = self._ended, []
        if ended:
            self._pool.submit(self._announce, ended)

    def _announce(self, job_ids: list[int]) -> None:
        try:
            for job in self._store.get_many(job_ids):
                job_notice(self.notifier, job)
        except Exception as exc:
            log_failure(log, f"could not notify about jobs {job_ids}", exc)

    def quarantined(self, device: str, why: str) -> None:
        """`device.quarantined`, from the device guard."""
        self.notifier.emit("device.quarantined", device=device, host=self._host, reason=why)

    def nodes_failed(self, exits: Iterable[Any]) -> None:
        """`node.failed` for each failed node of a multi-node attempt among `exits` (the executor's `Exit`s)."""
        for ex in exits:
            for node, why in getattr(ex, "failed_nodes", ()) or ():
                self.notifier.emit("node.failed", node=node, job=ex.job_id, attempt=ex.attempt, host=self._host,
                                   reason=why)

    def disk_low(self, short: Shortage) -> None:
        """`disk.low`, from the disk gate (`short`: its `Shortage`)."""
        self.notifier.emit("disk.low", host=self._host, path=short.path, free_bytes=short.free,
                           threshold_bytes=short.threshold, reason=short.reason.removeprefix("waiting: "))

    def close(self) -> None:
        """Finish the announcements under way, then stop the notifier (its queued deliveries get a moment)."""
        self._pool.shutdown(wait=True)
        self.notifier.close()
