"""The tracking worker: a child process of the service that makes the MLflow runs of queued jobs.

MLflow is a large import (about 250 MB resident with its pandas, pyarrow and SQLAlchemy models) and its
`create_run` costs CPU under the service's GIL; the service needs it only while tracked jobs wait for their
run. So the service never imports it: `TrackingWorker` starts `python -m orchestrator.tracking.worker` on demand,
hands it batches of run requests (`orchestrator.tracking.jobruns.run_request`, in line order) over a pipe, reads back
one run id per job as each is made, and stops it after `idle_exit` seconds without work. The worker also
exits when the service goes (its stdin closes).

Protocol: one JSON object per line. Requests `{"op": "runs", "jobs": [request, ...], "adopt": bool}` (adopt:
answer runs already made for these jobs first, after a worker or the service was lost mid-batch),
`{"op": "end", "runs": [{"run": run_id, "status": "FINISHED", "end": ms}, ...]}`,
`{"op": "discard", "runs": [run_id, ...]}`, `{"op": "tags", "runs": [{"run": run_id, "tags": {...}}, ...]}`
(retention's record of a removed checkpoint) and `{"op": "metrics", "runs": [{"run": run_id, "metrics": {...}}]}`
(the GPU figures the service logs when a job ends, `orchestrator.service.gpuwatch`). `runs` answers `{"id": job_id, "run": run_id}` per run made,
then `{"done": true}`, or `{"id": job_id, "error": "first line"}` at the first failure (later jobs are not
tried: a store that is down fails them all); `end`, `tags` and `metrics` answer `{"done": true}` or `{"error": "first
line"}`. The
protocol has a descriptor of its own (the worker's original stdout); library chatter on stdout goes to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from orchestrator.core.schemalock import sqlite_path

log = logging.getLogger(__name__)
IDLE_EXIT = 45.0  # seconds without work before the service stops its worker (the next batch starts another)
ANSWER_WITHIN = 300.0  # seconds the worker may take for one answer (a store that hangs) before it is stopped


class TrackingUnavailable(Exception):
    """The tracking store (or the worker in front of it) could not make a run; the message is one line."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (MLflow's can run to pages), at most 200 characters."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


class TrackingWorker:
    """The service's handle on its tracking worker process (started on first use, thread-safe)."""

    def __init__(self, tracking_uri: str, artifacts_dir: Optional[Path] = None, *, idle_exit: float = IDLE_EXIT):
        self.tracking_uri = tracking_uri
        self.artifacts_dir = artifacts_dir
        self.idle_exit = idle_exit
        self.started = 0  # worker processes started so far (a test can tell one was reused or stopped)
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()  # one conversation at a time
        self._used = 0.0
        self._unread = b""  # the worker's output read and not yet answered (part of a line)
        # Runs may have been made and not answered (this service, or a worker, killed between a run's commit
        # and its answer): the next batch adopts them instead of making them twice (`jobruns.made_runs`).
        self._adopt = True

    @property
    def pid(self) -> Optional[int]:
        """The worker's process id while one runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def make_runs(self, requests: Sequence[dict[str, Any]], on_run: Callable[[int, str], None]) -> None:
        """Make the runs of `requests` in order, calling `on_run(job_id, run_id)` as each is made. Raises
        TrackingUnavailable at the first failure; the requests after it are not made."""
        if not requests:
            return
        with self._lock:
            proc = self._talk({"op": "runs", "jobs": list(requests), "adopt": self._adopt})
            while True:
                answer = self._read(proc)
                if "run" in answer:
                    on_run(int(answer["id"]), answer["run"])
                elif "error" in answer:
                    raise TrackingUnavailable(answer["error"])
                else:
                    self._adopt = False  # every job of the batch has its run answered
                    return

    def end_runs(self, ends: Sequence[dict[str, Any]]) -> None:
        """End the runs of jobs that ended for good (`jobruns.end_runs`); raises TrackingUnavailable."""
        if not ends:
            return
        with self._lock:
            answer = self._read(self._talk({"op": "end", "runs": list(ends)}))
            if "error" in answer:
                raise TrackingUnavailable(answer["error"])

    def discard(self, run_ids: Sequence[str]) -> None:
        """Delete runs that lost the race for their job (best effort)."""
        if not run_ids:
            return
        with self._lock:
            try:
                self._read(self._talk({"op": "discard", "runs": list(run_ids)}))
            except TrackingUnavailable as exc:  # an empty run tagged with the job is harmless
                log.debug("could not discard runs %s: %s", run_ids, exc)

    def set_tags(self, runs: Sequence[dict[str, Any]]) -> None:
        """Set tags on runs (`[{"run": run_id, "tags": {...}}]`, retention's record of a removed checkpoint);
        raises TrackingUnavailable."""
        if not runs:
            return
        with self._lock:
            answer = self._read(self._talk({"op": "tags", "runs": list(runs)}))
            if "error" in answer:
                raise TrackingUnavailable(answer["error"])

    def log_metrics(self, runs: Sequence[dict[str, Any]]) -> None:
        """Log metrics on runs (`[{"run": run_id, "metrics": {name: value}}]`: a job's GPU figures once it
        ended); a run that is gone is skipped. Raises TrackingUnavailable."""
        if not runs:
            return
        with self._lock:
            answer = self._read(self._talk({"op": "metrics", "runs": list(runs)}))
            if "error" in answer:
                raise TrackingUnavailable(answer["error"])

    def close_if_idle(self) -> bool:
        """Stop the worker when it had no work for `idle_exit` seconds; True when it did."""
        if self._proc is None or time.monotonic() - self._used < self.idle_exit:
            return False
        if not self._lock.acquire(blocking=False):
            return False  # a conversation is under way
        try:
            if self._proc is None or time.monotonic() - self._used < self.idle_exit:
                return False
            self._stop()
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the worker now (a conversation under way ends with TrackingUnavailable)."""
        self._stop()

    # ---- the pipe -------------------------------------------------------------------------------------------

    def _spawn(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "orchestrator.tracking.worker", self.tracking_uri, str(self.artifacts_dir or "")]
        # Its answers are read from the descriptor (os.read), never through the file object's buffer, so
        # that select sees every line not yet taken.
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self._unread = b""
        self.started += 1
        log.debug("tracking worker started (pid %d)", proc.pid)
        return proc

    def _talk(self, request: dict) -> subprocess.Popen:
        """Send `request` to a live worker (started when there is none); returns the worker."""
        self._used = time.monotonic()
        proc = self._proc
        if proc is None or proc.poll() is not None:
            proc = self._proc = self._spawn()
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            self._lost(proc)
            raise TrackingUnavailable(f"the tracking worker is gone ({exc})") from None
        return proc

    def _read(self, proc: subprocess.Popen) -> dict:
        """The worker's next answer. A worker that gives none within ANSWER_WITHIN seconds (hung in a store
        call, or stopped) is killed: TrackingUnavailable, as for one that died, so the preparer pauses and
        asks a new worker later instead of waiting for ever."""
        deadline = time.monotonic() + ANSWER_WITHIN
        while b"\n" not in self._unread:
            try:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                    proc.kill()
                    self._lost(proc)
                    raise TrackingUnavailable(f"the tracking worker gave no answer in {ANSWER_WITHIN:.0f} s "
                                              f"(stopped)")
                data = os.read(proc.stdout.fileno(), 1 << 16)
            except (OSError, ValueError):
                data = b""
            if not data:
                code = self._lost(proc)
                raise TrackingUnavailable(f"the tracking worker exited (code {code})")
            self._unread += data
        self._used = time.monotonic()
        line, self._unread = self._unread.split(b"\n", 1)
        return json.loads(line)

    def _lost(self, proc: subprocess.Popen) -> Optional[int]:
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if self._proc is proc:
            self._proc = None
        self._adopt = True  # it may have committed runs it never answered
        return code

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # the worker exits when its input ends
        except (OSError, ValueError):
            pass
        for stop in (None, proc.terminate, proc.kill):  # still importing MLflow, or stuck in a store call
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=1 if stop is None else 5)
                return
            except subprocess.TimeoutExpired:
                pass


# ---- the worker process ------------------------------------------------------------------------------------

_tuned: set[str] = set()


def tune_sqlite_tracking(tracking_uri: str) -> None:
    """Give this process's connections to a SQLite MLflow store the queue database's settings: WAL and
    synchronous=NORMAL (durable across process crashes, as `orchestrator.queue.db`). MLflow's defaults (a
    rollback journal, synchronous=FULL) fsync several times per `create_run`, which on a busy disk made runs
    many times slower (benchmarks/RESULTS.md). MLflow builds its engine itself, so this listens on every engine's
    connects and acts only on this store's file."""
    path = sqlite_path(tracking_uri)
    if path is None or tracking_uri in _tuned:
        return
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    path = os.path.abspath(path)
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


def _answer(out, request: dict, tracker) -> None:
    from orchestrator.tracking.jobruns import create_runs, discard_run, end_runs, log_run_metrics

    if request.get("op") == "discard":
        for run_id in request.get("runs", []):
            discard_run(tracker, run_id)
    elif request.get("op") == "tags":
        try:
            for item in request.get("runs", []):
                tracker.set_tags(item["run"], item["tags"])
        except Exception as exc:
            out.write(json.dumps({"error": first_line(exc)}) + "\n")
            return
    elif request.get("op") == "metrics":
        try:
            log_run_metrics(tracker, request.get("runs", []))
        except Exception as exc:
            out.write(json.dumps({"error": first_line(exc)}) + "\n")
            return
    elif request.get("op") == "end":
        try:
            end_runs(tracker, request.get("runs", []))
        except Exception as exc:
            out.write(json.dumps({"error": first_line(exc)}) + "\n")
            return
    else:
        jobs = request.get("jobs", [])
        made = 0
        try:
            for job_id, run_id in create_runs(tracker, jobs, adopt=bool(request.get("adopt"))):
                out.write(json.dumps({"id": job_id, "run": run_id}) + "\n")
                made += 1
        except Exception as exc:
            out.write(json.dumps({"id": jobs[made]["id"], "error": first_line(exc)}) + "\n")
            return
    out.write('{"done": true}\n')


def serve(tracking_uri: str, artifacts_dir: Optional[str]) -> None:
    """The worker's loop: answer requests from stdin until it closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on `serve` reaches us too; the service stops us
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed on stdout must not corrupt the protocol
    tracker = None
    for line in sys.stdin:
        request = json.loads(line)
        if tracker is None:
            try:
                from orchestrator.tracking.client import Tracker

                tune_sqlite_tracking(tracking_uri)
                tracker = Tracker(tracking_uri, artifacts_dir or None)
            except Exception as exc:  # asked again with the next request
                jobs = request.get("jobs") or [{"id": 0}]
                out.write(json.dumps({"id": jobs[0]["id"], "error": first_line(exc)}) + "\n")
                continue
        _answer(out, request, tracker)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
