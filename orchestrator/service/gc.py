"""Applying retention: checkpoints (`orchestrator.service.retention`), job logs, and the event log, with the bytes freed.

`collect` is one pass: `autoresearch gc` runs it once, the service every `gc_every` seconds from a scheduler
job of its own (never inside a dispatch pass), and the disk preflight before it says a job waits for space.

- Checkpoints: each final job's dir as the policy decides: kept, trimmed to its newest complete checkpoint
  (`step_N/` with its `.metadata`; a dir of other files is kept whole), or removed. The queue records what was
  done (`Job.checkpoint_gc`), and the job's MLflow run gets the tag `autoresearch.checkpoint` = `removed` or
  `latest-only` (the run, its metrics and its leaderboard row stay).
- Logs: one grown past `log_max_bytes` keeps its newest half (from a line start, after a line saying how much
  was dropped; a running job's log is cut in place, as logrotate's copytruncate does, since the job appends to
  it); finished jobs' logs are gzipped after `log_compress_days` and deleted after `log_delete_days`.
- Events: jobs finished more than `events_compact_days` ago keep their first and last events.

The service's pass does only what can have changed since its last: the policy runs again only when the
queue's summary of final jobs with checkpoints (`JobStore.retention_fingerprint`) or the sessions' states
changed, and it caps only the logs of jobs that held devices since (every log on the slow pass and in `gc`).
So a pass over a home of many finished jobs costs about one aggregate query, not a read of every job.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import shutil
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from orchestrator.service.retention import LATEST, REMOVE, Decision, Policy, decide, pending

log = logging.getLogger(__name__)
DAY = 86400.0
_STEP_DIR = re.compile(r"^step_(\d+)$")
METADATA = ".metadata"  # runtime.checkpoint.io.METADATA: a step counts once it is committed
TAG = "autoresearch.checkpoint"
SLOW_PARTS_EVERY = 3600.0  # the service ages logs and compacts events at most this often


@dataclass
class Report:
    """What one pass did (or, dry, would do)."""

    dry_run: bool = False
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # {id, action, why, bytes}
    checkpoint_bytes: int = 0
    logs_capped: int = 0
    logs_compressed: int = 0
    logs_deleted: int = 0
    log_bytes: int = 0
    events_dropped: int = 0
    forks: list[dict[str, Any]] = field(default_factory=list)  # {name, session, bytes}: PBT's checkpoint copies
    fork_bytes: int = 0

    @property
    def bytes_freed(self) -> int:
        """Checkpoint and log bytes freed (or that would be)."""
        return self.checkpoint_bytes + self.log_bytes + self.fork_bytes

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `gc --json`."""
        return {**asdict(self), "bytes_freed": self.bytes_freed}


def session_states(home: Path) -> dict[str, bool]:
    """Agent and program session id -> whether it has ended (finished or failed; an interrupted session can be
    resumed, so it has not). Read from the agent registry, without creating it."""
    path = Path(home) / "agent" / "agent.db"
    if not path.exists():
        return {}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            rows = conn.execute("SELECT id, status FROM sessions").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:  # no sessions table yet
        return {}
    return {sid: status in ("finished", "failed") for sid, status in rows}


def tree_bytes(path: Path) -> int:
    """Bytes in the files under `path` (0 when it is gone)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def latest_trim(directory: Path) -> list[Path]:
    """The step checkpoints of a dir other than its newest complete one (nothing when it has none)."""
    try:
        steps = sorted(((int(m.group(1)), p) for p in Path(directory).iterdir()
                        if p.is_dir() and (m := _STEP_DIR.match(p.name))), reverse=True)
    except OSError:
        return []
    complete = [p for _, p in steps if (p / METADATA).exists()]
    if not complete:
        return []
    return [p for _, p in steps if p != complete[0]]


def _apply_checkpoint(decision: Decision, directory: Path, dry_run: bool) -> tuple[int, Optional[str]]:
    """(bytes freed, what was done) for one decision."""
    if decision.action == REMOVE:
        freed = tree_bytes(directory)
        if not dry_run:
            shutil.rmtree(directory, ignore_errors=True)
        return freed, "removed"
    extra = latest_trim(directory)
    freed = sum(tree_bytes(p) for p in extra)
    if not dry_run:
        for p in extra:
            shutil.rmtree(p, ignore_errors=True)
    return freed, "trimmed"


def cap_log(path: Path, max_bytes: int) -> int:
    """Cut a log grown past `max_bytes` to its newest half, from a line start; the bytes dropped (0: none).
    In place (a running job appends to it with O_APPEND, so its next write lands after the kept tail)."""
    try:
        size = path.stat().st_size
    except OSError:
        return 0
    if not max_bytes or size <= max_bytes:
        return 0
    keep = max_bytes // 2
    with open(path, "r+b") as fh:
        fh.seek(size - keep)
        tail = fh.read()
        cut = tail.find(b"\n")
        if 0 <= cut < len(tail) - 1:
            tail = tail[cut + 1:]
        dropped = size - len(tail)
        marker = f"[autoresearch: {dropped} bytes of earlier output dropped (log_max_bytes = {max_bytes})]\n"
        fh.seek(0)
        fh.truncate(0)  # frees the space first: the rewrite below fits even on a full disk
        fh.write(marker.encode() + tail)
    return max(0, dropped - len(marker))


def gzip_log(path: Path) -> int:
    """Replace a log by `<log>.gz`; the bytes saved (0 when there was nothing to do)."""
    target = path.with_name(path.name + ".gz")
    if not path.exists():
        return 0
    tmp = path.with_name(path.name + ".gz.tmp")
    try:
        with open(path, "rb") as src, gzip.open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    before = path.stat().st_size
    path.unlink()
    return max(0, before - target.stat().st_size)


class Collector:
    """Retention for one home: `collect()` is one pass. The service keeps one (it ages logs and compacts
    events at most every SLOW_PARTS_EVERY seconds; `gc` does all of it each time)."""

    def __init__(self, settings: Any, store: Any, tag_runs: Optional[Callable[[list[dict]], None]] = None):
        self.settings = settings
        self.store = store
        self.policy = Policy.from_settings(settings)
        self.tag_runs = tag_runs
        self._slow_at = 0.0
        self.passes = 0  # service passes completed (`run_pass`)
        self._settled: Optional[tuple] = None  # what the policy read when it last found nothing left to do
        self._logs_at: Optional[float] = None  # when the service's pass last looked at the logs

    def run_pass(self) -> None:
        """One pass as the service runs it: what is due, never an exception (logged), counted in `passes`."""
        try:
            report = self.collect(everything=False)
            if report.bytes_freed:
                log.info("retention freed %d bytes (%d checkpoints, %d logs capped)", report.bytes_freed,
                         len(report.checkpoints), report.logs_capped)
        except Exception:
            log.exception("retention pass failed")
        finally:
            self.passes += 1

    def collect(self, *, dry_run: bool = False, everything: bool = True) -> Report:
        """One pass. `everything` False (the service's periodic pass): logs aged and events compacted only
        when SLOW_PARTS_EVERY has passed since the last time."""
        report = Report(dry_run=dry_run)
        now = time.time()
        slow = everything or now - self._slow_at >= SLOW_PARTS_EVERY
        sessions = session_states(self.settings.home)
        self._checkpoints(report, dry_run, sessions, again=slow)
        self._forks(report, dry_run, sessions)
        self._cap_logs(report, dry_run, every=slow)
        if slow:
            self._slow_at = now
            self._age_logs(report, dry_run, now)
            days = self.settings.events_compact_days
            if days and not dry_run:
                report.events_dropped = self.store.keeping.compact_events(now - days * DAY)
        return report

    def _checkpoints(self, report: Report, dry_run: bool, sessions: dict[str, bool], again: bool = True) -> None:
        # `sessions` is read before the rows: a change that lands after it makes the next pass decide again.
        seen = (self.store.keeping.retention_fingerprint(), tuple(sorted(sessions.items())))
        if not again and seen == self._settled:
            return  # nothing the policy reads has changed since it last had nothing to do
        rows = self.store.keeping.retention_rows()
        decisions = pending(decide(rows, sessions, self.policy), rows)
        by_id = {row["id"]: row for row in rows}
        done, tags = [], []
        for d in decisions:
            row = by_id[d.job_id]
            directory = Path(row["checkpoint_dir"])
            if not directory.exists() and d.action == LATEST:
                continue
            freed, what = _apply_checkpoint(d, directory, dry_run)
            if d.action == LATEST and not freed:
                continue  # nothing but its latest: nothing to say
            report.checkpoints.append({"id": d.job_id, "action": d.action, "why": d.why, "bytes": freed})
            report.checkpoint_bytes += freed
            done.append((d.job_id, what))
            if row.get("mlflow_run_id"):
                tags.append({"run": row["mlflow_run_id"],
                             "tags": {TAG: "removed" if what == "removed" else "latest-only"}})
        if dry_run:
            return
        self._settled = None if done else seen  # what it did changes the rows: the next pass looks once more
        self.store.keeping.record_gc(done)
        if tags and self.tag_runs is not None:
            try:
                self.tag_runs(tags)
            except Exception as exc:  # the tracking store may be down; the queue has the record
                log.warning("could not tag runs whose checkpoints were removed: %s", exc)

    def _forks(self, report: Report, dry_run: bool, sessions: dict[str, bool]) -> None:
        """Remove the checkpoint copies PBT's children started from (`Layout.fork_dir`, named after the child's
        trial key `SESSION:N`) once their session has ended: a resumable session still needs them. A copy left
        half-made by a crash (`.NAME.PID`) goes with them."""
        root = Path(self.settings.home) / "forks"
        if not root.is_dir():
            return
        ended = [sid for sid, done in sessions.items() if done]
        if not ended:
            return
        for path in sorted(root.iterdir()):
            name = path.name.lstrip(".").split(".")[0]
            session = next((sid for sid in ended if name.startswith(f"{sid}-") and name[len(sid) + 1:].isdigit()),
                           None)
            if session is None:
                continue
            freed = tree_bytes(path)
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)
            report.forks.append({"name": path.name, "session": session, "bytes": freed})
            report.fork_bytes += freed

    def _cap_logs(self, report: Report, dry_run: bool, every: bool = True) -> None:
        cap = self.settings.log_max_bytes
        logs_dir = Path(self.settings.logs_dir)
        if not cap or not logs_dir.is_dir():
            return
        started = time.time()
        if every or self._logs_at is None:
            with os.scandir(logs_dir) as entries:
                paths = [entry.path for entry in entries if entry.name.endswith(".log")]
        else:  # only logs that can have grown since the last look (a margin for clocks and commits)
            paths = self.store.keeping.growing_logs(self._logs_at - 5.0)
        for path in paths:
            try:
                size = os.stat(path).st_size
            except OSError:
                continue
            if size <= cap:
                continue
            report.logs_capped += 1
            if dry_run:
                report.log_bytes += size - cap // 2
            else:
                report.log_bytes += cap_log(Path(path), cap)
        if not dry_run:
            self._logs_at = started

    def _age_logs(self, report: Report, dry_run: bool, now: float) -> None:
        compress, delete = self.settings.log_compress_days, self.settings.log_delete_days
        if delete:
            for _, path in self.store.keeping.finished_before(now - delete * DAY):
                for p in (Path(path), Path(f"{path}.gz")) if path else ():
                    if p.exists():
                        report.logs_deleted += 1
                        report.log_bytes += p.stat().st_size
                        if not dry_run:
                            p.unlink(missing_ok=True)
        if compress:
            for _, path in self.store.keeping.finished_before(now - compress * DAY):
                if path and Path(path).exists():
                    report.logs_compressed += 1
                    if not dry_run:
                        try:
                            report.log_bytes += gzip_log(Path(path))
                        except OSError as exc:  # a full disk: the log stays as it was
                            log.warning("could not compress %s: %s", path, exc)


def run_gc(settings: Any, *, dry_run: bool = False) -> Report:
    """`autoresearch gc`: one full pass over this home, tagging MLflow runs through a tracking worker."""
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.worker import TrackingWorker

    store = JobStore.from_settings(settings)
    worker = TrackingWorker(settings.tracking_uri, settings.artifacts_dir)
    try:
        return Collector(settings, store, tag_runs=worker.set_tags).collect(dry_run=dry_run)
    finally:
        worker.close()
