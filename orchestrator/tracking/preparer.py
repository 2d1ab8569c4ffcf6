"""MLflow runs made ahead of time: the service's dispatcher never waits on MLflow between claiming a device
and starting a tracked job, and the service process never imports MLflow.

`RunPreparer` is a daemon thread that, whenever the service wakes it, sends the next queued tracked jobs in
line (those this host can run, up to `batch`) to the tracking worker (`orchestrator.tracking.worker`, a child
process started on demand), records the run ids as they come back and wakes the dispatcher. The dispatcher
holds a device for a tracked job without a run rather than making the run itself. The run id is set once
(`JobStore.set_run_ids`, a few runs per commit) and the loser of a race (another host) has its run deleted.

A tracking store that fails leaves the jobs QUEUED with the reason (`failure`), no attempt spent, and pauses
the preparer for `retry_after` seconds (`paused_until`); the dispatcher keeps those jobs out of its plan
meanwhile, so others may start. The worker is stopped after its idle time and started again when needed.

The same thread ends the runs it made once their jobs end for good (`close_ended`, at most once a second, and
within about two seconds of the job's end): FINISHED, FAILED or KILLED with the job's end time, unless the job
ended its run itself. What the queue records (`orchestrator.queue.runs`) survives a restart: a run left open
by a service that died is ended by the next one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from orchestrator.core.diskfull import log_failure
from orchestrator.tracking.jobruns import run_request
from orchestrator.queue.store import JobStore
from orchestrator.tracking.client import run_status
from orchestrator.tracking.worker import TrackingUnavailable, TrackingWorker

log = logging.getLogger(__name__)
RECORD_EVERY_RUNS = 16  # runs recorded in one commit once this many are made (4: 10% fewer jobs/s tracked) ...
RECORD_EVERY_S = 0.02  # ... or when none were recorded for this long
CLOSE_EVERY = 1.0  # seconds between looks for runs to end


def waiting_reason(error: str) -> str:
    """A queued job's reason while the tracking store fails."""
    return f"waiting: MLflow tracking store not usable ({error}); no attempt spent"


class RunPreparer:
    """Gets the MLflow runs of the next `batch` tracked QUEUED jobs made, from a background thread."""

    def __init__(self, store: JobStore, worker: TrackingWorker, capacity: Callable[[], int],
                 on_ready: Callable[[], None], *, batch: int = 64, retry_after: float = 5.0):
        self.store = store
        self.worker = worker
        self._on_ready = on_ready
        self._capacity = capacity
        self.batch = batch
        self.retry_after = retry_after
        self.prepared = 0  # runs this preparer set (a test can tell the work moved here)
        self.closed = 0  # runs this preparer ended
        self._closed_at = 0.0  # monotonic time of the last look for runs to end
        self.failure = ""  # the reason given to waiting jobs while the tracking store fails
        self.paused_until = 0.0  # monotonic time the preparer asks the failing store again
        self._paused = threading.Event()  # set while the tracking store is failing
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="run-preparer", daemon=True)

    def start(self) -> "RunPreparer":
        """Start the thread."""
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        """Whether the preparer is running and its tracking store answered last time."""
        return self._thread.is_alive() and not self._paused.is_set() and not self._stop.is_set()

    @property
    def paused(self) -> bool:
        """Whether the tracking store failed and the pause after it is not over."""
        return self._paused.is_set()

    def wake(self) -> None:
        """Look at the queue again soon (a submit arrived)."""
        self._wake.set()

    def close(self) -> None:
        """Stop the thread and the worker (a run being made is abandoned: the job keeps no run id)."""
        self._stop.set()
        self._wake.set()
        self.worker.close()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=2.0)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                while self.prepare_once() and not self._stop.is_set():
                    pass  # a full batch: there may be more
                if time.monotonic() - self._closed_at >= CLOSE_EVERY and not self._paused.is_set():
                    self._closed_at = time.monotonic()
                    while self.close_ended() and not self._stop.is_set():
                        pass
                self.worker.close_if_idle()
            except Exception as exc:
                log_failure(log, "preparing MLflow runs failed", exc)
                self._stop.wait(self.retry_after)

    def prepare_once(self) -> bool:
        """Get the next batch of tracked queued jobs their runs; True when the batch was full."""
        jobs = self.store.runs.needing_runs(capacity=self._capacity(), limit=self.batch)
        if not jobs:
            return False
        done: set[int] = set()
        losers: list[str] = []
        made: dict[int, str] = {}  # runs made and not recorded yet
        last = 0.0  # when runs were last recorded

        def record() -> None:
            nonlocal last
            last = time.monotonic()
            ready = self.store.runs.set_run_ids(made)
            lost = {job_id: run_id for job_id, run_id in made.items() if job_id not in ready}  # another host won
            if lost:  # ... unless the run was adopted (`jobruns.made_runs`) and is the one it recorded
                recorded = {job.id: job.mlflow_run_id for job in self.store.get_many(lost)}
                losers.extend(run_id for job_id, run_id in lost.items() if recorded.get(job_id) != run_id)
            self.prepared += len(ready)
            made.clear()
            if ready:
                self._on_ready()  # they may start now

        def on_run(job_id: int, run_id: str) -> None:
            done.add(job_id)
            made[job_id] = run_id
            # Recorded a few at a time, in one commit, with one wake-up of the dispatcher (a commit and a
            # dispatch pass per run cost the service more than its share of a tracked job), but at once when
            # none was recorded for RECORD_EVERY_S: a run from a slow store never waits for the next one.
            if len(made) >= RECORD_EVERY_RUNS or time.monotonic() - last >= RECORD_EVERY_S:
                record()

        try:
            self.worker.make_runs([run_request(job) for job in jobs], on_run)
        except TrackingUnavailable as exc:
            if self._stop.is_set():
                return False
            self._pause(str(exc), [job.id for job in jobs if job.id not in done])
            return False
        finally:
            try:
                record()  # the runs made before the end of the batch (or before the store failed)
            finally:
                self.worker.discard(losers)
        return len(jobs) == self.batch

    def close_ended(self, limit: int = 256) -> bool:
        """End in MLflow the runs the service made for jobs that have ended for good; True when there may
        be more. A tracking store that fails keeps them listed for the next look."""
        ended = self.store.runs.runs_to_close(limit)
        if not ended:
            return False
        try:
            self.worker.end_runs([{"run": run_id, "status": run_status(state), "end": int(finished_at * 1000)}
                                  for _, run_id, state, finished_at in ended])
        except TrackingUnavailable as exc:
            log.warning("could not end the MLflow runs of %d finished jobs: %s", len(ended), exc)
            return False
        self.store.runs.runs_closed([job_id for job_id, *_ in ended])
        self.closed += len(ended)
        return len(ended) == limit

    def _pause(self, error: str, waiting: list[int]) -> None:
        log.warning("MLflow tracking store %s is not usable: %s", self.worker.tracking_uri, error)
        self.failure = waiting_reason(error)
        self.paused_until = time.monotonic() + self.retry_after
        self._paused.set()
        try:
            self.store.note({job_id: self.failure for job_id in waiting})
        finally:
            self._on_ready()  # the dispatcher keeps these jobs out of its plan until the pause ends
            self._stop.wait(self.retry_after)
            self._paused.clear()
