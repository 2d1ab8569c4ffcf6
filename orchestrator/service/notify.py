"""Notifications: `[[notify]]` entries of config.toml, each a webhook or a command, told of the events it wants.

```toml
[[notify]]
url = "https://hooks.slack.com/services/..."   # POST of a Slack-compatible JSON body: {"text": ..., fields}
events = ["job.failed", "session.finished", "disk.low"]

[[notify]]
command = "/usr/local/bin/page-me"             # the event as JSON on its standard input
events = ["device.quarantined"]
```
Events: job.failed (a job failed for good), job.succeeded (a person's job), session.finished (with its
verdict), session.paused (interrupted, resumable), device.quarantined, disk.low, node.failed (a node of a
multi-node job lost, failing its preflight or faulty: excluded from the job's next attempts). `events` left out: all.

Delivery never blocks the caller: `Notifier.emit` puts the event on a bounded queue per entry and returns; one
thread per entry delivers (a hanging endpoint delays only its own entry), retrying with doubling backoff.
A body carries the event's named fields only: never a job's environment or command line, and any value of a
secret-looking environment variable (KEY, TOKEN, SECRET, PASSWORD in its name) is masked wherever it appears.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from orchestrator.core.errors import BadInput
from orchestrator.core.config import Settings

if TYPE_CHECKING:
    from orchestrator.queue.models import Job

log = logging.getLogger(__name__)
EVENTS = ("job.failed", "job.succeeded", "session.finished", "session.paused", "device.quarantined", "disk.low",
          "node.failed")
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.I)
QUEUE_SIZE = 1000  # events waiting per entry; beyond it new ones are dropped (and logged), never waited for


@dataclass(frozen=True)
class Target:
    """One `[[notify]]` entry."""

    url: Optional[str] = None
    command: Optional[str] = None
    events: tuple[str, ...] = EVENTS
    timeout: float = 10.0  # seconds one delivery may take
    retries: int = 4  # deliveries after the first failed one
    backoff: float = 1.0  # seconds before the first retry, doubling

    def __post_init__(self) -> None:
        if bool(self.url) == bool(self.command):
            raise ValueError("give exactly one of url or command")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http:// or https://, got {self.url!r}")
        unknown = set(self.events) - set(EVENTS)
        if unknown:
            raise ValueError(f"unknown events {sorted(unknown)}; known: {', '.join(EVENTS)}")

    @property
    def label(self) -> str:
        """How messages name it (a webhook's host only: its path is often a secret)."""
        if self.url:
            return self.url.split("/")[2]
        return self.command.split()[0]


def targets(settings: Settings) -> list[Target]:
    """The `[[notify]]` entries of a `Settings` (BadInput naming the bad one)."""
    raw = (getattr(settings, "extra", None) or {}).get("notify") or []
    if isinstance(raw, Mapping):
        raw = [raw]
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            raise BadInput(f"config.toml: [[notify]] entry {i + 1} is not a table")
        unknown = set(entry) - {"url", "command", "events", "timeout", "retries", "backoff"}
        if unknown:
            raise BadInput(f"config.toml: [[notify]] entry {i + 1}: unknown keys {', '.join(sorted(unknown))}")
        try:
            events = entry.get("events", EVENTS)
            if isinstance(events, str):
                events = [events]
            out.append(Target(url=entry.get("url"), command=entry.get("command"), events=tuple(events),
                              timeout=float(entry.get("timeout", 10.0)), retries=int(entry.get("retries", 4)),
                              backoff=float(entry.get("backoff", 1.0))))
        except (TypeError, ValueError) as exc:
            raise BadInput(f"config.toml: [[notify]] entry {i + 1}: {exc}") from None
    return out


def secrets(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """Values of secret-looking environment variables (long enough to be worth masking)."""
    env = os.environ if env is None else env
    return sorted({v for k, v in env.items() if _SECRET_NAME.search(k) and v and len(v) >= 6}, key=len,
                  reverse=True)


def mask(value: Any, hidden: Sequence[str]) -> Any:
    """`value` (str, list, dict, scalar) with every occurrence of a hidden string replaced by ***."""
    if isinstance(value, str):
        for secret in hidden:
            value = value.replace(secret, "***")
        return value
    if isinstance(value, Mapping):
        return {k: mask(v, hidden) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask(v, hidden) for v in value]
    return value


def text_of(event: str, fields: Mapping[str, Any]) -> str:
    """The one line people read (Slack's `text`)."""
    if event.startswith("job."):
        what = fields.get("name") or f"job {fields.get('job')}"
        return f"autoresearch: {what} (job {fields.get('job')}) {fields.get('state')}: {fields.get('reason', '')}"
    if event == "session.finished":
        return f"autoresearch: session {fields.get('session')} finished: {fields.get('verdict', '')}"
    if event == "session.paused":
        return f"autoresearch: session {fields.get('session')} paused; `autoresearch resume` continues it"
    if event == "device.quarantined":
        return f"autoresearch: device {fields.get('device')} quarantined: {fields.get('reason', '')}"
    if event == "disk.low":
        return f"autoresearch: {fields.get('reason', 'disk space low')}"
    return f"autoresearch: {event}"


def payload(event: str, fields: Mapping[str, Any], hidden: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON body of one event: `text`, `event`, `host`, `at` and the event's fields, secrets masked."""
    body = {"text": text_of(event, fields), "event": event, "host": socket.gethostname(), "at": time.time(),
            **{k: v for k, v in fields.items() if k not in ("env", "argv")}}
    return mask(body, hidden)


def deliver(target: Target, body: Mapping[str, Any]) -> None:
    """One delivery attempt (raises on failure: an HTTP status >= 300, a timeout, a command's non-zero exit)."""
    data = json.dumps(body, default=str).encode()
    if target.url:
        request = urllib.request.Request(target.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=target.timeout) as response:
            if response.status >= 300:
                raise OSError(f"HTTP {response.status}")
        return
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    done = subprocess.run(["/bin/sh", "-c", target.command], input=data, env=env, timeout=target.timeout,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise OSError(f"exit {done.returncode}: {done.stderr.decode(errors='replace').strip()[:200]}")


class Notifier:
    """Delivers events to the targets that want them, each from a thread of its own (`emit` never waits)."""

    def __init__(self, targets_: Sequence[Target], *, sleep: Callable[[float], None] = time.sleep):
        self.targets = list(targets_)
        self.hidden = secrets()
        self.delivered = 0  # deliveries that succeeded (tests wait on it)
        self.failed = 0  # events given up after every retry
        self._sleep = sleep
        self._queues: list[queue.Queue] = []
        self._threads = []
        for target in self.targets:
            q: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
            thread = threading.Thread(target=self._run, args=(target, q), name=f"notify-{target.label}",
                                      daemon=True)
            thread.start()
            self._queues.append(q)
            self._threads.append(thread)

    @classmethod
    def from_settings(cls, settings: Settings) -> "Notifier":
        """A notifier for the `[[notify]]` entries of these settings (none: `emit` does nothing)."""
        return cls(targets(settings))

    def wants(self, event: str) -> bool:
        """Whether any target wants this event (callers skip gathering fields otherwise)."""
        return any(event in t.events for t in self.targets)

    def emit(self, event: str, **fields: Any) -> None:
        """Queue the event for every target that wants it; returns at once."""
        if not self.wants(event):
            return
        body = payload(event, fields, self.hidden)
        for target, q in zip(self.targets, self._queues):
            if event in target.events:
                try:
                    q.put_nowait(body)
                except queue.Full:
                    log.warning("notification to %s dropped: %d events already waiting", target.label, QUEUE_SIZE)

    def _run(self, target: Target, q: queue.Queue) -> None:
        while True:
            body = q.get()
            if body is None:
                return
            try:
                self._send(target, body)
            finally:
                q.task_done()

    def _send(self, target: Target, body: Mapping[str, Any]) -> None:
        delay = target.backoff
        for attempt in range(target.retries + 1):
            try:
                deliver(target, body)
                self.delivered += 1
                return
            except (OSError, urllib.error.URLError, subprocess.SubprocessError) as exc:
                if attempt == target.retries:
                    self.failed += 1
                    log.warning("notification %s to %s failed after %d tries: %s", body.get("event"),
                                target.label, attempt + 1, exc)
                    return
                self._sleep(delay)
                delay *= 2

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event was delivered or given up (at most `timeout`); whether all were."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(q.unfinished_tasks == 0 for q in self._queues):
                return True
            time.sleep(0.02)
        return False

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued (up to `timeout`), then stop the threads."""
        self.flush(timeout)
        for q in self._queues:
            try:
                q.put_nowait(None)
            except queue.Full:
                pass


def job_notice(notifier: "Notifier", job: Job) -> None:
    """job.failed for a job that failed for good, job.succeeded for a person's job that succeeded."""
    if job.state == "FAILED":
        event = "job.failed"
    elif job.state == "SUCCEEDED" and job.owner == "human":
        event = "job.succeeded"
    else:
        return
    notifier.emit(event, job=job.id, name=job.name, state=job.state, reason=job.reason, exit_code=job.exit_code,
                  owner=job.owner, experiment=job.experiment, mlflow_run_id=job.mlflow_run_id,
                  attempts=job.attempts)


def send_test(settings: Settings, timeout: float = 30.0) -> list[dict[str, Any]]:
    """`autoresearch notify test`: one test event to every entry, delivered now; [{target, ok, error}]."""
    hidden = secrets()
    out = []
    for target in targets(settings):
        body = payload("test", {"text_hint": "a test notification from autoresearch"}, hidden)
        body["text"] = "autoresearch: a test notification"
        try:
            deliver(target, body)
            out.append({"target": target.label, "ok": True, "error": ""})
        except Exception as exc:  # noqa: BLE001 - reported per entry, one line each
            out.append({"target": target.label, "ok": False, "error": str(exc).splitlines()[0][:200]})
    return out
