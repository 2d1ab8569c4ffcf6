"""A small process that starts the local executor's attempts and reaps them, so the service does not.

Starting attempts from the service's threads cost it about a third of its CPU a job: `subprocess.Popen`'s
work in Python and a pool of threads taking turns at the GIL (`benchmarks/dispatch_profile.py`). This
process is single-threaded and imports nothing but the standard library and psutil. It reads spawn requests
(one JSON line each) on stdin, starts each with `os.posix_spawn` (vfork and exec: holding the GIL costs
nothing here), answers each with the pid and start time on stdout, in order, and reaps its children.

The service watches every attempt with a pidfd and reads the exit code its wrapper recorded, as it does for
attempts it adopted, so the spawner keeps no state worth losing. When the service closes the pipe (it stops,
or dies) the spawner exits and leaves the jobs running, as the service does: the next service adopts them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
from collections import deque
from typing import Callable, Optional, Union

from orchestrator.executors.procs import start_time

log = logging.getLogger(__name__)
SPAWNERS = 4  # processes at most: with one, spawns starved on a busy machine (0.7x the jobs/s with a core taken)
PER_SPAWNER = 2  # requests of a batch per process before another is used
ANSWER_WITHIN = 60.0  # seconds a batch may wait for its answers before the spawners owing them are stopped


class SpawnerGone(OSError):
    """The spawner stopped before it answered: the request may or may not have started a process."""


# Signals the job must find at their defaults: Python ignores SIGPIPE and SIGXFSZ (Popen's restore_signals
# gives them back) and this process ignores SIGINT (handlers set here are reset by exec anyway).
DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)


def _spawn(request: dict, devnull: int) -> dict:
    """Start one request. posix_spawn (vfork and exec) measured 0.7 ms a spawn here against fork's 1.5 ms
    (a fork copies this process's page tables, and the child runs Python until its exec)."""
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, request["header"].encode())
            pid = os.posix_spawn(request["argv"][0], request["argv"], request["env"],
                                 file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, fd, 1),
                                               (os.POSIX_SPAWN_DUP2, fd, 2)],
                                 setsid=True, setsigdef=DEFAULT_SIGNALS)
        finally:
            os.close(fd)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"pid": pid, "start": start_time(pid)}


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main() -> None:
    """The spawner process: requests on stdin, answers on stdout, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C at the service's terminal is the service's to handle
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (only to wake the loop: children are reaped below)
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
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
            if not data:  # the service is gone: its jobs keep running
                return
            *lines, pending = (pending + data).split(b"\n")
            answers.extend(_spawn(json.loads(line), devnull) for line in lines if line.strip())
        if answers:
            _write_all(1, b"".join(json.dumps(a).encode() + b"\n" for a in answers))
        _reap()


Answer = Union[tuple[int, Optional[str]], OSError]
Done = Callable[[list[Answer]], None]


class _Channel:
    """One spawner process, and the batches it has not answered in full yet (answers come in order)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.executors.spawner"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     start_new_session=True)
        self.batches: deque[tuple[int, list[Answer], Done]] = deque()
        self.dead = False


class Spawner:
    """The service's end: up to `processes` spawner processes, started when first needed (again when one
    died), each sent its share of a batch; a share's answers are handed to the batch's callback from that
    process's reader thread. Several processes: a spawn waits for its child's exec, and on a busy machine
    several waits overlap; a batch of two or fewer needs only one."""

    def __init__(self, processes: int = SPAWNERS) -> None:
        self._lock = threading.Lock()
        self._channels: list[Optional[_Channel]] = [None] * max(1, processes)

    def start(self) -> None:
        """Start the first spawner process now (its start-up overlaps the caller's work)."""
        with self._lock:
            self._live(0)

    def _live(self, i: int) -> _Channel:
        channel = self._channels[i]
        if channel is None or channel.dead:
            channel = self._channels[i] = _Channel()
            threading.Thread(target=self._read, args=(channel,), name="spawner-reader", daemon=True).start()
        return channel

    def send(self, requests: list[dict], done: Done) -> None:
        """Ask for each request's `argv` (argv[0] a path) to be started with its `env`, its output appended to
        its `log` after its `header`, in a session of its own. `done` gets, from another thread, each one's
        (pid, start time) or OSError, in order: `SpawnerGone` for those a spawner stopped before answering
        (they may have started)."""
        if not requests:
            done([])
            return
        ways = min(len(self._channels), (len(requests) + PER_SPAWNER - 1) // PER_SPAWNER)
        answers: list[Optional[list[Answer]]] = [None] * ways
        left = [ways]

        def share_done(i: int, batch: list[Answer]) -> None:
            with self._lock:
                answers[i] = batch
                left[0] -= 1
                if left[0]:
                    return
            merged: list[Answer] = [None] * len(requests)  # type: ignore[list-item]
            for j, share in enumerate(answers):
                merged[j::ways] = share
            done(merged)

        # Encoded, and the processes started, first: a request that cannot be encoded (TypeError) or a process
        # that cannot be started raises here, before anything is sent.
        shares = [b"".join(json.dumps(r).encode() + b"\n" for r in requests[i::ways]) for i in range(ways)]
        with self._lock:
            for i in range(ways):
                self._live(i)
        for i, data in enumerate(shares):
            self._send(i, data, len(requests[i::ways]), functools.partial(share_done, i))

    def _send(self, i: int, data: bytes, count: int, done: Done) -> None:
        with self._lock:
            channel = self._live(i)
            channel.batches.append((count, [], done))
            try:
                _write_all(channel.proc.stdin.fileno(), data)
            except OSError as exc:
                failed = self._lost(channel, exc)
            else:
                failed = []
        for finish in failed:
            finish()

    def spawn_many(self, requests: list[dict]) -> list[Answer]:
        """`send`, waiting for the answers."""
        answers: list[Answer] = []
        arrived = threading.Event()

        def done(batch: list[Answer]) -> None:
            answers.extend(batch)
            arrived.set()

        self.send(requests, done)
        if not arrived.wait(ANSWER_WITHIN):
            # Hung (a log on a volume that stopped answering): stopped, so the queue goes on. What it
            # answered for nothing is then reported `SpawnerGone`, and its caller looks for it.
            log.warning("a spawner did not answer in %.0f s: stopping it", ANSWER_WITHIN)
            with self._lock:
                for channel in self._channels:
                    if channel is not None and channel.batches:
                        channel.proc.kill()
            arrived.wait()
        return answers

    def _read(self, channel: _Channel) -> None:
        fd, buffer = channel.proc.stdout.fileno(), b""
        try:
            while True:
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                *lines, buffer = (buffer + data).split(b"\n")
                finished = []
                with self._lock:
                    for line in lines:
                        if not line.strip():
                            continue
                        answer = json.loads(line)
                        count, answers, done = channel.batches[0]
                        answers.append(OSError(answer["error"]) if "error" in answer else
                                       (answer["pid"], answer["start"]))
                        if len(answers) == count:
                            channel.batches.popleft()
                            finished.append(functools.partial(done, answers))
                for finish in finished:
                    finish()
            why = OSError(f"it exited with code {channel.proc.wait()}")
        except Exception as exc:  # an answer it could not read (or a callback that failed): never wait forever
            log.exception("reading the spawner's answers failed")
            channel.proc.kill()
            why = OSError(f"its answers could not be read: {exc}")
        with self._lock:
            failed = self._lost(channel, why)
        for finish in failed:
            finish()

    @staticmethod
    def _lost(channel: _Channel, exc: OSError) -> list[Callable[[], None]]:
        """The channel's process is gone (call holding the lock): its unanswered batches, to finish."""
        if not channel.dead:
            log.warning("the spawner stopped (%s); the next start starts another", exc)
        channel.dead = True
        failed = []
        while channel.batches:
            count, answers, done = channel.batches.popleft()
            answers.extend(SpawnerGone(f"the spawner stopped: {exc}") for _ in range(count - len(answers)))
            failed.append(functools.partial(done, answers))
        return failed

    def close(self) -> None:
        """Stop the spawners (answers still due arrive first); the jobs they started keep running."""
        with self._lock:
            channels, self._channels = self._channels, [None] * len(self._channels)
            for channel in channels:
                if channel is not None:
                    channel.dead = True  # (no warning when its reader sees it end)
        for channel in channels:
            if channel is None:
                continue
            channel.proc.stdin.close()  # it answers what it has read, then exits
            try:
                channel.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                channel.proc.kill()
                channel.proc.wait()


if __name__ == "__main__":
    sys.exit(main())
