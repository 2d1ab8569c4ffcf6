"""The dispatcher's gate for tracked jobs: a job that should have an MLflow run is claimed only once it has one.

The run preparer (`orchestrator.tracking.preparer`) makes runs in line order, in its tracking worker, so the
dispatcher never waits on MLflow: a pass leaves such a job's devices free and the preparer wakes it when the run is
made. While the tracking store fails, those jobs stay QUEUED with the failure as their reason, no attempt spent,
and out of the plan until the preparer asks the store again (`TRACKING_RETRY_AFTER` later), so others may start.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from orchestrator.queue.rows import Queued
from orchestrator.queue.store import JobStore
from orchestrator.tracking.preparer import RunPreparer
from orchestrator.tracking.worker import TrackingWorker

TRACKING_RETRY_AFTER = 5.0  # after the tracking store failed, wait this long before asking it again
Start = tuple[int, list[str]]  # (job id, its devices), as the policy plans a start


class RunGate:
    """Which of a pass's starts may be claimed now, as far as MLflow runs go (see the module docstring)."""

    def __init__(self, store: JobStore, tracking: TrackingWorker):
        self.store = store
        self.tracking = tracking
        self.preparer: Optional[RunPreparer] = None
        self._retry_at = 0.0  # monotonic time before which a failed tracking store is not asked again
        self._blocked: set[int] = set()  # jobs waiting for the tracking store, out of the plan meanwhile

    def start(self, capacity: Callable[[], int], wake: Callable[[], None]) -> None:
        """Start the run preparer: it looks `capacity()` jobs ahead and calls `wake` when it made runs."""
        self.preparer = RunPreparer(self.store, self.tracking, capacity, wake, retry_after=TRACKING_RETRY_AFTER).start()

    def close(self) -> None:
        """Stop the run preparer."""
        if self.preparer is not None:
            self.preparer.close()

    def skipped(self) -> set[int]:
        """The jobs this pass leaves out of its plan (those waiting for a failed tracking store to be asked
        again; none once that time has come)."""
        if self._blocked and time.monotonic() >= self._retry_at:
            self._blocked.clear()
        return self._blocked

    def look_ahead(self, queued: list[Queued]) -> None:
        """Wake the preparer when jobs in the pass's window lack their run: it makes theirs, and the next ones'."""
        if self.preparer is not None and any(row.needs_run for row in queued):
            self.preparer.wake()

    def claimable(self, starts: list[Start], need_runs: set[int]) -> list[Start]:
        """The starts that may be claimed now. `need_runs`: ids of jobs that are tracked and have no run yet;
        their devices stay free this pass (the preparer makes the runs and wakes the dispatcher)."""
        if need_runs and self.preparer is not None and self.preparer.healthy:
            self.preparer.wake()
            return [start for start in starts if start[0] not in need_runs]
        wanted = [job_id for job_id, _ in starts if job_id in need_runs]
        if not wanted:
            return starts
        preparer = self.preparer
        if preparer is not None and preparer.paused:
            blocked = {job_id: preparer.failure for job_id in wanted}
            self._retry_at = preparer.paused_until
            self._blocked.update(blocked)
            self.store.note(blocked)
        return [start for start in starts if start[0] not in need_runs]
