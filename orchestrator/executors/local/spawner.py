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

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Union

from orchestrator.executors.local import serveloop
from orchestrator.executors.local.procs import start_time

log = logging.getLogger(__name__)
SPAWNERS = 4  # processes at most: with one, spawns starved on a busy machine (benchmarks/RESULTS.md)
PER_SPAWNER = 2  # requests of a batch per process before another is used
ANSWER_WITHIN = 60.0  # seconds a batch may wait for its answers before the spawners owing them are stopped
CLOSE_WAIT = 5.0  # seconds `close` waits for a batch under way before it kills the spawners


class SpawnerGone(OSError):
    """The spawner stopped before it answered: the request may or may not have started a process. `hung`:
    it was stopped for not answering in time (a start blocked on its log), not because it died."""

    def __init__(self, message: str, hung: bool = False) -> None:
        super().__init__(message)
        self.hung = hung


# Signals the job must find at their defaults: Python ignores SIGPIPE and SIGXFSZ (Popen's restore_signals
# gives them back) and this process ignores SIGINT (handlers set here are reset by exec anyway).
DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)


def _spawn(request: dict, devnull: int, own: list) -> dict:
    """Start one request. posix_spawn (vfork and exec), not fork: a fork copies this process's page tables, and
    the child runs Python until its exec (benchmarks/RESULTS.md has both measured)."""
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


def main() -> None:
    """The spawner process: requests on stdin, answers on stdout, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C at the service's terminal is the service's to handle
    serveloop.serve(_spawn)


Answer = Union[tuple[int, Optional[str]], OSError]


class Spawner:
    """The service's end: up to `processes` spawner processes, started when first needed (again when one
    died). A batch is shared among them, `PER_SPAWNER` requests each, and read back in one pass over their
    pipes. Several processes: a spawn waits for its child's exec, and on a busy machine several waits overlap;
    a batch of two or fewer needs only one."""

    def __init__(self, processes: int = SPAWNERS, *, argv: Optional[list[str]] = None,
                 env: Optional[dict[str, str]] = None, cwd: Optional[str] = None) -> None:
        self._lock = threading.Lock()  # one batch at a time: a process's answers are always the last batch's
        self._procs: list[Optional[subprocess.Popen]] = [None] * max(1, processes)
        # What each process runs (another program speaking this protocol: executors.local.warmpool).
        self._argv = argv or [sys.executable, "-m", "orchestrator.executors.local.spawner"]
        self._env, self._cwd = env, cwd

    def start(self) -> None:
        """Start the first spawner process now (its start-up overlaps the caller's work)."""
        with self._lock:
            self._live(0)

    def alive(self, i: int) -> bool:
        """Whether process `i` runs now (False before it was first needed)."""
        proc = self._procs[i]
        return proc is not None and proc.poll() is None

    def _live(self, i: int) -> subprocess.Popen:
        proc = self._procs[i]
        if proc is None or proc.poll() is not None:  # (one that died idle is replaced before it is asked)
            if proc is not None:
                _close_pipes(proc)
            proc = self._procs[i] = subprocess.Popen(
                self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, start_new_session=True,
                env=self._env, cwd=self._cwd)
            os.set_blocking(proc.stdin.fileno(), False)  # written between reads: a big batch cannot deadlock
        return proc

    def spawn_many(self, requests: list[dict]) -> list[Answer]:
        """Start each request's `argv` (argv[0] a path) with its `env`, its output appended to its `log` after
        its `header`, in a session of its own. Returns each one's (pid, start time) or OSError, in order:
        `SpawnerGone` for those a spawner stopped before answering (they may have started). A spawner that has
        not answered within `ANSWER_WITHIN` seconds (a log on a volume that hangs) is stopped, so the queue goes
        on. Raises, having sent nothing, when a request cannot be encoded or a process cannot be started."""
        if not requests:
            return []
        ways = min(len(self._procs), (len(requests) + PER_SPAWNER - 1) // PER_SPAWNER)
        shares = [b"".join(json.dumps(r).encode() + b"\n" for r in requests[i::ways]) for i in range(ways)]
        with self._lock:
            procs = [self._live(i) for i in range(ways)]
            answers = self._exchange(procs, shares, [len(requests[i::ways]) for i in range(ways)])
        merged: list[Answer] = [None] * len(requests)  # type: ignore[list-item]
        for i, share in enumerate(answers):
            merged[i::ways] = share
        return merged

    def _exchange(self, procs: list[subprocess.Popen], shares: list[bytes], counts: list[int]) -> list[list[Answer]]:
        """Write each process its share and read its answers, interleaved, until all are answered or given up."""
        answers: list[list[Answer]] = [[] for _ in procs]
        unsent = [memoryview(share) for share in shares]
        partial = [b""] * len(procs)
        owed = set(range(len(procs)))
        deadline = time.monotonic() + ANSWER_WITHIN
        with selectors.DefaultSelector() as sel:
            for i, proc in enumerate(procs):
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, i)
                sel.register(proc.stdout.fileno(), selectors.EVENT_READ, i)

            def done(i: int) -> None:  # nothing more is written to or read from process i in this batch
                owed.discard(i)
                for fd in (procs[i].stdin.fileno(), procs[i].stdout.fileno()):
                    if fd in sel.get_map():
                        sel.unregister(fd)

            def give_up(i: int, why: str, hung: bool = False) -> None:
                log.warning("the spawner stopped (%s); the next start starts another", why)
                done(i)
                procs[i].kill()
                procs[i].wait()
                missing = counts[i] - len(answers[i])
                answers[i].extend(SpawnerGone(f"the spawner stopped: {why}", hung) for _ in range(missing))

            while owed:
                events = sel.select(max(0.0, deadline - time.monotonic()))
                if not events and time.monotonic() >= deadline:
                    for i in sorted(owed):
                        give_up(i, f"no answer in {ANSWER_WITHIN:.0f} s", hung=True)
                    break
                for key, mask in events:
                    i = key.data
                    if i not in owed:
                        continue
                    try:
                        if mask & selectors.EVENT_WRITE:
                            try:
                                unsent[i] = unsent[i][os.write(key.fd, unsent[i]):]
                            except BlockingIOError:  # (a wake-up with no room after all: not a lost spawner)
                                continue
                            if not unsent[i]:
                                sel.unregister(key.fd)
                            continue
                        data = os.read(key.fd, 1 << 16)
                        if not data:
                            raise EOFError(f"it exited with code {procs[i].wait()}")
                        *lines, partial[i] = (partial[i] + data).split(b"\n")
                        for line in filter(None, lines):
                            answer = json.loads(line)
                            answers[i].append(OSError(answer["error"]) if "error" in answer else
                                              (answer["pid"], answer["start"]))
                    except (OSError, EOFError, ValueError, KeyError) as exc:  # gone, or answers it cannot read
                        give_up(i, str(exc))
                        continue
                    if len(answers[i]) >= counts[i]:
                        done(i)
        return [share[:count] for share, count in zip(answers, counts)]

    def close(self) -> None:
        """Stop the spawners; the jobs they started keep running. A batch under way is waited for up to
        `CLOSE_WAIT` seconds; then its spawners are killed (it gets `SpawnerGone` for what they had not
        answered), so a start blocked on a log that hangs cannot hold up the service's stop."""
        if not self._lock.acquire(timeout=CLOSE_WAIT):
            for proc in list(self._procs):
                if proc is not None:
                    proc.kill()  # (a signal, not a close: the batch's reads and writes still use the pipes)
            self._lock.acquire()
        try:
            procs, self._procs = self._procs, [None] * len(self._procs)
        finally:
            self._lock.release()
        for proc in procs:
            if proc is None:
                continue
            try:
                proc.stdin.close()  # it exits when its input ends
            except OSError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            _close_pipes(proc)


def _close_pipes(proc: subprocess.Popen) -> None:
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
