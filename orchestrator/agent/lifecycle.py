"""A session's life, the same for experiment and program sessions: resume guards, the parts a session runs
with, and how it ends.

    with Lifecycle.open(session_id, settings, registry, devices, experiment="digits") as life:
        parent = life.session_run(params)
        ...                                   # the mode's own loop (a LangGraph graph, or the program loop)
        return life.finish(parent, summary, tags=..., metrics=..., step=n, verdict="...")

A session embeds a queue service for its home when none runs (and stops it at the end), notifies
`session.finished` with its verdict (or its failure) and `session.paused` when interrupted, and records its
status in the registry. Both modes go through here, so a rule about how a session starts, pauses or ends is
written once.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput


def resumable_row(registry: Any, session_id: str, finished_hint: str) -> dict[str, Any]:
    """The registry row of `session_id`, or BadInput when it cannot be resumed: unknown, still running, or
    finished (`finished_hint` says where its results are)."""
    row = registry.get(session_id)
    if row["status"] == "running":
        raise BadInput(f"session {session_id} is still running (pid {row['pid']})")
    if row["status"] == "finished":
        raise BadInput(f"session {session_id} already finished; see {finished_hint}")
    return row


def mark_resumed(registry: Any, session_id: str, **fields: Any) -> None:
    """The registry row says the session runs again, in this process."""
    registry.update(session_id, status="running", pid=os.getpid(), **fields)


SPACE_POLL_S = 2.0  # how often a session stopped by a full disk looks for space again
SPACE_PROBE = 1024 * 1024  # the write that must succeed before it goes on (SQLite's journal needs room too)


def through_full_disk(run: Callable[[], dict[str, Any]], home: Path, registry: Any, session_id: str,
                      say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run a session (`run`: its mode's `_run`) to its end; when its home's disk fills (ENOSPC, SQLite's
    "database or disk is full"), wait for space and go on from its last checkpoint, as `resume` would, instead
    of ending with a traceback: a box that runs unattended gets its disk back and its sessions finish. Any
    other error ends the session as before."""
    from orchestrator.core.diskfull import is_disk_full

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    again = False
    while True:
        try:
            if again:
                mark_resumed(registry, session_id)
            return run()
        except Exception as exc:  # noqa: BLE001 - a full disk is waited out; anything else is re-raised
            if not is_disk_full(exc):
                raise
        say(f"session {session_id}: the disk under {home} is full; waiting for space, then it goes on from its "
            "last checkpoint")
        _wait_for_space(Path(home))
        say(f"session {session_id}: there is space again; going on")
        again = True


def _wait_for_space(home: Path) -> None:
    """Return once a small write under `home` succeeds."""
    probe = home / f".space-probe-{os.getpid()}"
    while True:
        try:
            with open(probe, "wb") as fh:
                fh.write(b"\0" * SPACE_PROBE)
                fh.flush()
                os.fsync(fh.fileno())
            return
        except OSError:
            time.sleep(SPACE_POLL_S)
        finally:
            probe.unlink(missing_ok=True)


@dataclass
class Lifecycle:
    """The parts one session runs with (store, tracker, embedded service, notifier) and its endings.

    Use as a context manager: an exception marks the session failed (KeyboardInterrupt: paused, since a
    resume continues it) and is notified; the notifier, and the service the session embedded, are closed
    whatever happens."""

    session_id: str
    settings: Settings
    registry: Any
    experiment: str  # the name notifications carry
    store: Any
    tracker: Any
    service: Any  # the embedded service, or None when one already ran for the home
    slots: int  # device slots the session can fill
    notifier: Any

    @classmethod
    def open(cls, session_id: str, settings: Settings, registry: Any, devices: Optional[str],
             experiment: str) -> "Lifecycle":
        """Connect to the queue and MLflow, and embed a service for the home when none runs."""
        from orchestrator.queue.store import JobStore
        from orchestrator.service.daemon import embedded
        from orchestrator.service.notify import Notifier
        from orchestrator.tracking.client import Tracker

        store = JobStore(settings.db_url)
        tracker = Tracker.from_settings(settings)
        service, slots = embedded(settings, store, devices)
        return cls(session_id, settings, registry, experiment, store, tracker, service, slots,
                   Notifier.from_settings(settings))

    # -- what the mode's loop is handed -------------------------------------------------------------------------

    def wake(self) -> Callable[[], None]:
        """A callable that wakes the home's service (a trial was submitted)."""
        from orchestrator.core.wakeup import notify

        home = self.settings.home
        return lambda: notify(home)

    def on_usage(self) -> Callable[[dict], None]:
        """A callable that records the session's LLM spend so far as it goes."""
        return lambda usage: self.registry.spent(self.session_id, usage)

    def session_run(self, params: dict[str, Any], run_experiment: Optional[str] = None) -> str:
        """The session's parent MLflow run (created, or found again on resume), recorded in the registry."""
        parent = self.tracker.session_run(self.session_id, run_experiment or self.experiment, params)
        self.registry.update(self.session_id, mlflow_run_id=parent)
        return parent

    # -- endings --------------------------------------------------------------------------------------------------

    def pause(self, parent: str, summary: dict[str, Any], reason: str, tags: dict[str, str]) -> dict[str, Any]:
        """Not finished (the LLM budget was reached): the parent run stays open, the session is resumable."""
        summary.update(status="paused", stop_reason=reason)
        self.tracker.set_tags(parent, {"autoresearch.status": "paused", "autoresearch.stop_reason": reason, **tags})
        self.registry.update(self.session_id, status="paused", summary=summary)
        return summary

    def finish(self, parent: str, summary: dict[str, Any], *, tags: dict[str, str], metrics: dict[str, Any],
               step: int, verdict: str, report: Optional[tuple[str, str]] = None) -> dict[str, Any]:
        """Finished: the parent run's status, verdict metrics and report (text, artifact name), the registry's
        record, and the `session.finished` notification with the verdict."""
        self.tracker.set_tags(parent, {"autoresearch.status": "finished",
                                       "autoresearch.stop_reason": summary["stop_reason"], **tags})
        self.tracker.log_metrics(parent, metrics, step=step)
        if report is not None:
            self.tracker.log_text(parent, *report)
        self.tracker.finish(parent)
        self.registry.update(self.session_id, status="finished", summary=summary)
        self.notifier.emit("session.finished", session=self.session_id, experiment=self.experiment,
                           verdict=verdict, stop_reason=summary["stop_reason"])
        return summary

    def __enter__(self) -> "Lifecycle":
        return self

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> None:
        try:
            if exc is None:
                return
            from orchestrator.core.diskfull import is_disk_full

            if not isinstance(exc, KeyboardInterrupt) and not is_disk_full(exc):
                self.registry.update(self.session_id, status="failed", summary={"error": str(exc)[:500]})
                first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                self.notifier.emit("session.finished", session=self.session_id, experiment=self.experiment,
                                   verdict=f"failed: {first}")
            else:  # interrupted, or its disk is full (waited out by `through_full_disk`): resumable, not failed
                self.notifier.emit("session.paused", session=self.session_id, experiment=self.experiment)
        finally:
            self.notifier.close()
            if self.service is not None:
                self.service.stop()
