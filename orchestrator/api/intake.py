"""A running service takes submits over a Unix socket in its home, so `autoresearch submit` need not import
the ORM, typer, rich or MLflow (their imports cost a submit many times what queueing it does: the figures are in
benchmarks/RESULTS.md, "Queue throughput").

- `IntakeServer` (service side): accepts one JSON request per connection, `{"op": "submit", "argv": [...],
  "options": {...}, "cwd": ..., "db_url": ...}` (the options: submit's flag values by key, as
  `orchestrator.api.submitflags` declares them), submits through `orchestrator.api.jobs.submit` (the same checks as
  the CLI) and answers `{"ok": true, "job": {...}}`, `{"ok": false, "error": "...", "code": 2}` for bad input,
  or `{"fallback": true}` when the client should take the ordinary path (it names another database).
  `{"op": "queue", "all": bool, "limit": N}` and `{"op": "show", "id": N}` answer `{"ok": true, "data": ...}`, the
  JSON of `queue --json` and `show --json` (a queue answer adds `"note"`: the "... and N more" line, or "").
- `submit`, `ask` (client side): import only the standard library. None means "no service answered before anything
  was sent": the caller takes the ordinary path (which then writes to the database directly).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # the client side imports the standard library only
    from orchestrator.core.config import Settings
    from orchestrator.queue.store import JobStore

log = logging.getLogger(__name__)
SOCKET_NAME = "service.intake.sock"
TIMEOUT = 30.0  # seconds to wait for the service's answer once the request is sent


def socket_path(home: Path) -> Path:
    """Where a home's service takes submits."""
    return Path(home) / SOCKET_NAME


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def submit(home: Path, argv: list[str], options: dict[str, Any]) -> Optional[dict]:
    """Hand a submit to the home's running service; its answer, or None when no service took the request."""
    return ask(home, {"op": "submit", "argv": argv, "options": options, "cwd": os.getcwd()})


def ask(home: Path, request: dict) -> Optional[dict]:
    """Send one request (`submit`, `queue` with `all`, `show` with `id`) to the home's running service; its
    answer, or None when no service took it (nothing was sent, or it answered `fallback`)."""
    from orchestrator.core.config import environment_value

    request = {**request, "db_url": environment_value("db_url")}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        try:
            sock.connect(str(socket_path(home)))
        except OSError:
            return None  # no service (or a stale socket): nothing was sent
        sock.settimeout(TIMEOUT)
        sock.sendall(json.dumps(request).encode() + b"\n")
        answer = _read_line(sock)
    finally:
        sock.close()
    if not answer:
        return {"ok": False, "error": "the service closed the connection without answering; "
                                      "see `autoresearch queue` before submitting again", "code": 1}
    reply = json.loads(answer)
    return None if reply.get("fallback") else reply


class IntakeServer:
    """Takes submits for one service on a daemon thread (one connection at a time: each is a few ms)."""

    def __init__(self, settings: Settings, store: JobStore, on_submit: Callable[[], None]):
        self.settings = settings
        self.store = store
        self._on_submit = on_submit
        self.path = socket_path(settings.home)
        self._sock: Optional[socket.socket] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.path.unlink(missing_ok=True)
            self._sock.bind(str(self.path))
            self._sock.listen(64)
        except OSError as exc:  # e.g. a path over the 108-byte limit: clients then write to the database
            log.warning("no submit socket at %s (%s); submits go to the database directly", self.path, exc)
            self._sock.close()
            self._sock = None
            return
        threading.Thread(target=self._loop, name="intake", daemon=True).start()

    def _loop(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5.0)
                    reply = self.handle(json.loads(_read_line(conn) or b"{}"))
                    conn.sendall(json.dumps(reply, default=str).encode() + b"\n")
                except Exception:  # a client that went away or sent garbage: its problem, not the service's
                    log.exception("bad submit request")

    def handle(self, request: dict) -> dict:
        """Carry out one request (see the module docstring)."""
        from orchestrator.api import jobs as api
        from orchestrator.api.submitflags import spec_options
        from orchestrator.core.errors import BadInput
        from orchestrator.queue.models import JobSpec

        if request.get("db_url") and request["db_url"] != self.settings.db_url:
            return {"fallback": True}  # the client means another queue than this service's
        op = request.get("op")
        if op in ("queue", "show"):
            return self._read(request)
        if op != "submit":
            return {"fallback": True}
        try:
            opts = spec_options(dict(request.get("options") or {}))
            opts["cwd"] = opts["cwd"] or request.get("cwd")
            spec = JobSpec(argv=list(request.get("argv") or []), **opts)
            job, _ = api.submit(spec, self.settings, self.store)
        except BadInput as exc:
            return {"ok": False, "error": str(exc), "code": 2}
        except Exception as exc:  # noqa: BLE001 - reported to the client as a failure, exit 1
            return {"ok": False, "error": f"error: {exc}", "code": 1}
        self._on_submit()
        return {"ok": True, "job": job.to_dict()}

    def _read(self, request: dict) -> dict:
        from orchestrator.core.errors import BadInput
        from orchestrator.queue.listing import DEFAULT_LIMIT, check_limit

        try:
            if request["op"] == "queue":
                listed = self.store.listing(finished=bool(request.get("all")),
                                            limit=check_limit(request.get("limit", DEFAULT_LIMIT)))
                return {"ok": True, "data": listed.jobs, "note": listed.more_line()}
            return {"ok": True, "data": self.store.record(int(request["id"]))}
        except BadInput as exc:
            return {"ok": False, "error": str(exc), "code": 2}
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "error": f"error: {exc}", "code": 1}

    def close(self) -> None:
        """Stop taking submits and remove the socket."""
        from orchestrator.core.wakeup import close_socket

        sock, self._sock = self._sock, None
        close_socket(sock, self.path)
