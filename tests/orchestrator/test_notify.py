"""Notifications: webhooks on a loopback HTTP server and a command that records what it got, delivered by the
service off the dispatch path, retried after a failure, never carrying secrets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orchestrator.core.config import Settings
from orchestrator.service.notify import Notifier, Target, payload
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import wait_for

SECRET = "sk-test-very-secret-value"


class Hook:
    """A webhook on loopback: answers `fail_first` requests with 500, then 200; records the bodies."""

    def __init__(self, fail_first: int = 0):
        self.bodies: list[dict] = []
        self.calls = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                data = self.rfile.read(int(self.headers["Content-Length"]))
                hook.calls += 1
                if hook.calls <= fail_first:
                    self.send_response(500)
                    self.end_headers()
                    return
                hook.bodies.append(json.loads(data))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook/path-secret"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hooks():
    made = []

    def make(**kw):
        made.append(Hook(**kw))
        return made[-1]

    yield make
    for hook in made:
        hook.close()


@pytest.fixture
def hanging():
    """A loopback endpoint that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    sock.close()


def _config(home: Path, entries: list[str]) -> None:
    (home / "config.toml").write_text("\n".join(entries))


def test_retried_after_a_500_and_secrets_masked(hooks, monkeypatch):
    monkeypatch.setenv("SERVICE_API_KEY", SECRET)
    hook = hooks(fail_first=1)
    notifier = Notifier([Target(url=hook.url, backoff=0.05)])
    notifier.emit("job.failed", job=7, name="train", state="FAILED", reason=f"exit 1: bad key {SECRET}",
                  env={"SERVICE_API_KEY": SECRET}, argv=["train", SECRET])
    assert notifier.flush(10)
    assert hook.calls == 2 and notifier.delivered == 1
    body = hook.bodies[0]
    assert body["event"] == "job.failed" and body["job"] == 7 and "train" in body["text"]
    assert SECRET not in json.dumps(body) and "env" not in body and "argv" not in body
    notifier.close()


def test_the_service_notifies_and_a_hanging_endpoint_does_not_slow_dispatch(home, hooks, hanging, make_service,
                                                                            tmp_path):
    hook = hooks()
    record = tmp_path / "got.jsonl"
    _config(home, ["[[notify]]", f'url = "{hook.url}"', 'events = ["job.failed", "job.succeeded"]', "",
                   "[[notify]]", f'command = "cat >> {record}; echo >> {record}"', 'events = ["job.failed"]', "",
                   "[[notify]]", f'url = "{hanging}"', "timeout = 60", "retries = 0"])
    service = make_service(devices="cpu:2")
    assert len(service.notifier.targets) == 3
    t0 = time.monotonic()
    jobs = [service.store.submit(JobSpec(argv=["false"] if i % 2 else ["true"], track=False, name=f"j{i}"))
            for i in range(8)]
    wait_for(lambda: all(service.store.get(j.id).final for j in jobs), timeout=60, what="every job ended")
    elapsed = time.monotonic() - t0
    assert elapsed < 30, f"dispatch waited on the hanging endpoint ({elapsed:.1f}s)"
    wait_for(lambda: len(hook.bodies) == 8, timeout=30, what="8 webhook deliveries")
    events = sorted((b["event"], b["job"]) for b in hook.bodies)
    assert events == sorted(("job.failed" if i % 2 else "job.succeeded", j.id) for i, j in enumerate(jobs))
    lines = wait_for(lambda: [json.loads(x) for x in record.read_text().splitlines() if x.strip()]
                     if record.exists() and record.read_text().count("\n") >= 4 else None, timeout=30,
                     what="the command's four events")
    assert {x["event"] for x in lines} == {"job.failed"} and len(lines) == 4


def test_notify_test_command(home, hooks):
    hook = hooks()
    _config(home, ["[[notify]]", f'url = "{hook.url}"'])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cli = [sys.executable, "-m", "orchestrator.faces.fastcli", "notify", "test"]
    out = subprocess.run(cli, capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "delivered" in out.stdout and "path-secret" not in out.stdout
    assert hook.bodies and hook.bodies[0]["event"] == "test"
    _config(home, ["[[notify]]", 'url = "ftp://nowhere"'])
    bad = subprocess.run(cli, capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "[[notify]] entry 1" in bad.stderr
    assert Settings.load() is not None  # the bad entry does not break other commands' settings


def test_payload_is_slack_compatible():
    body = payload("disk.low", {"reason": "12 MB free on /data"})
    assert body["text"].startswith("autoresearch: ") and body["event"] == "disk.low"


def test_a_failed_node_of_a_multi_node_attempt_is_announced_as_node_failed(home, hooks):
    from orchestrator.core.config import Settings
    from orchestrator.executors.base import Exit
    from orchestrator.queue.store import JobStore
    from orchestrator.service.notices import ServiceNotices

    hook = hooks()
    _config(home, ["[[notify]]", f'url = "{hook.url}"', 'events = ["node.failed"]'])
    settings = Settings.load()
    notices = ServiceNotices(settings, JobStore.from_settings(settings), "box")
    notices.nodes_failed([Exit(4, 2, 75, "lost", (("node2", "node node2 lost: no heartbeat for 7s"),)),
                          Exit(5, 1, 0, "exit code 0")])
    assert notices.notifier.flush(10)
    notices.close()
    assert [(b["event"], b["node"], b["job"], b["attempt"]) for b in hook.bodies] == [("node.failed", "node2", 4, 2)]
    assert "no heartbeat" in hook.bodies[0]["reason"]
