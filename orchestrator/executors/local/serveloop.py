"""The request loop of the processes that start attempts (`spawner`, `warmpool`): one JSON request a line on
stdin, one answer a line on stdout for each, children reaped as they exit, until stdin closes.

Standard library only and no thread: the warm pool runs it and forks jobs from it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
from typing import Callable

# (request, a read-only /dev/null fd, the loop's own objects a forked child must close) -> answer
Handler = Callable[[dict, int, list], dict]


def serve(handle: Handler) -> None:
    """Answer requests on stdin with `handle` until stdin closes (the service is gone: its jobs keep running)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (only to wake the loop: children are reaped below)
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    own = [sel, wake_r, wake_w]
    pending = b""
    while True:
        answers = []
        for key, _ in sel.select():
            if key.fd == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return
            *lines, pending = (pending + data).split(b"\n")
            answers.extend(handle(json.loads(line), devnull, own) for line in lines if line.strip())
        if answers:
            write_all(1, b"".join(json.dumps(a).encode() + b"\n" for a in answers))
        reap()


def reap() -> None:
    """Collect every child that has exited (their exit codes are the wrapper's files, not ours)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
