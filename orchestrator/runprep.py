"""MLflow runs made ahead of time: the service's dispatcher should not wait on MLflow's `create_run` (about
4 ms of CPU per tracked job) between claiming a device and starting the job.

`RunPreparer` is a daemon thread that, whenever the service wakes it, gives the next queued tracked jobs in
line (those this host can run, up to `batch`) their MLflow run, and wakes the dispatcher as each is ready.
While it is healthy the dispatcher holds a device for a tracked job without a run rather than making the run
itself (two threads making runs for the same head of the line did the work twice). The run id is set once
(`JobStore.set_run_id`) and the loser of a race (another host) deletes its run. A tracking store that fails
pauses the preparer for `retry_after` seconds; the dispatcher then makes runs itself and reports the failure
in the jobs' reasons as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from orchestrator.queue.store import JobStore

log = logging.getLogger(__name__)
_tuned: set[str] = set()


def tune_sqlite_tracking(tracking_uri: str) -> None:
    """Give this process's connections to a SQLite MLflow store the queue database's settings: WAL and
    synchronous=NORMAL (durable across process crashes, as `orchestrator.queue.db`). MLflow's defaults (a
    rollback journal, synchronous=FULL) fsync several times per `create_run`: on a busy disk that made a run
    cost 70 ms instead of 3. MLflow builds its engine itself, so this listens on every engine's connects and
    acts only on this store's file."""
    if not tracking_uri.startswith("sqlite:///") or tracking_uri in _tuned:
        return
    import os

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    path = os.path.abspath(tracking_uri[len("sqlite:///"):])
    _tuned.add(tracking_uri)

    @event.listens_for(Engine, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001
        try:
            name = dbapi_conn.execute("PRAGMA database_list").fetchone()[2]
        except Exception:  # not sqlite3
            return
        if name and os.path.abspath(name) == path:
            dbapi_conn.execute("PRAGMA journal_mode=WAL")
            dbapi_conn.execute("PRAGMA synchronous=NORMAL")


class RunPreparer:
    """Creates the MLflow runs of the next `batch` tracked QUEUED jobs on a background thread."""

    def __init__(self, store: JobStore, tracker: Callable[[], object], capacity: Callable[[], int],
                 on_ready: Callable[[], None], *, batch: int = 64, retry_after: float = 5.0):
        self.store = store
        self._on_ready = on_ready
        self._tracker = tracker
        self._capacity = capacity
        self.batch = batch
        self.retry_after = retry_after
        self.prepared = 0  # runs this preparer set (a test can tell the work moved here)
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
        """Whether the preparer is running and its tracking store answered last time: the dispatcher then
        leaves tracked jobs without a run to it instead of making their runs itself."""
        return self._thread.is_alive() and not self._paused.is_set() and not self._stop.is_set()

    def wake(self) -> None:
        """Look at the queue again soon (a submit arrived)."""
        self._wake.set()

    def close(self) -> None:
        """Stop the thread (a run being made is finished first)."""
        self._stop.set()
        self._wake.set()
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
            except Exception as exc:  # a tracking store that is down: the dispatcher reports it per job
                log.debug("preparing MLflow runs failed (%s); pausing %.0fs", exc, self.retry_after)
                self._paused.set()
                self._on_ready()  # the dispatcher takes over (and says why in the jobs' reasons)
                self._stop.wait(self.retry_after)
                self._paused.clear()

    def prepare_once(self) -> bool:
        """Give the next batch of tracked queued jobs their runs; True when the batch was full."""
        from orchestrator.jobruns import discard_run, ensure_job_run

        jobs = self.store.needing_runs(capacity=self._capacity(), limit=self.batch)
        for job in jobs:
            if self._stop.is_set():
                return False
            tracker = self._tracker()
            run_id = ensure_job_run(tracker, job)
            if self.store.set_run_id(job.id, run_id):
                self.prepared += 1
                self._on_ready()  # it may start now
            else:  # the dispatcher (or another host) was first
                discard_run(tracker, run_id)
        return len(jobs) == self.batch
