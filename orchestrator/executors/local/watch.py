"""Watching the local executor's attempts: their exits, their process trees, and finding them by environment.

`ExitWatcher` is one selector thread over the attempts' pidfds: when a leader exits (its parent, a spawner
process or init for an adopted one, reaps it), the attempt's leftover processes are killed (the device is not
handed back while a rank still holds it), and the exit is reported with the code the wrapper recorded. The
same thread refreshes the process trees of attempts without a cgroup (so a worker that outlives its parent is
still known to be the job's) and removes the cgroups of attempts the service has forgotten (kernel time the
dispatch pass need not wait for).

`scan` finds an attempt's live processes by environment: its wrapper (a session leader whose environment
names the attempt's exit file) and any process started with the attempt's job-protocol variables.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from orchestrator.executors.local import procs
from orchestrator.executors.base import Exit, OnExit
from orchestrator.core.layout import Layout
from runtime import protocol

log = logging.getLogger(__name__)

EXIT_FILE_VAR = "AUTORESEARCH_EXIT_FILE"  # the wrapper's variable naming the attempt's exit file
REFRESH_EVERY = 0.5  # seconds between looks at the process trees of attempts without a cgroup
LEFTOVER_WAIT = 30.0  # seconds to keep killing what an ended attempt left behind before reporting anyway


@dataclass
class Watch:
    """One attempt being watched: its leader's pid and its process tree."""
    job_id: int
    attempt: int
    pid: int
    tree: procs.ProcessTree
    key: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.job_id, self.attempt)


@dataclass
class Found:
    """What `scan` found of one attempt."""
    wrapper: Optional[psutil.Process] = None
    members: list[psutil.Process] = field(default_factory=list)


class ExitWatcher:
    """Reports the end of each watched attempt through `on_exit`, once none of its processes is left."""

    def __init__(self, layout: Layout, cgroups: Optional[procs.Cgroups], on_exit: OnExit):
        self.layout = layout
        self.cgroups = cgroups
        self._on_exit = on_exit
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pending: list[tuple[int, Watch]] = []
        self._watches: dict[tuple[int, int], Watch] = {}
        self._emptied: list[tuple[int, int]] = []  # attempts forgotten whose cgroups are still to remove
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="local-executor-watch", daemon=True)
        self._thread.start()

    def get(self, key: tuple[int, int]) -> Optional[Watch]:
        """The watch of attempt `key` = (job id, attempt), while it is watched."""
        return self._watches.get(key)

    def watch(self, watch: Watch, fd: Optional[int] = None) -> None:
        """Watch an attempt whose leader runs (settled at once when it is already gone). `fd`: the leader's
        pidfd when the caller has opened it (the watcher closes it)."""
        if fd is None:
            try:
                fd = os.pidfd_open(watch.pid)
            except ProcessLookupError:
                self.settle(watch)
                return
        with self._lock:
            self._pending.append((fd, watch))
            self._watches[watch.key] = watch
        self._poke()

    def remove_cgroup(self, job_id: int, attempt: int) -> None:
        """Remove the (emptied) cgroup of a forgotten attempt, from the watcher's thread."""
        if self.cgroups is not None:
            with self._lock:
                self._emptied.append((job_id, attempt))
            self._poke()

    def settle(self, watch: Watch, scanned: bool = False) -> None:
        """Report the attempt's end once none of its processes is left (leftovers are killed first, in a
        thread: the device is not handed back while a rank still holds it)."""
        if not scanned and not watch.tree.exact():
            watch.tree.add(scan(self.layout).get(watch.key, Found()).members)
        if watch.tree.members(refresh=False):
            threading.Thread(target=self._kill_then_report, args=(watch,), daemon=True).start()
            return
        self._report(watch)

    def close(self) -> None:
        """Stop watching. Attempts still running are left running (the next service adopts them)."""
        self._closed = True
        self._poke()
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                os.close(key.fd)
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.cgroups is not None:
            self._remove_emptied()
            self.cgroups.prune()

    # ---- the thread ---------------------------------------------------------------------------------------

    def _poke(self) -> None:
        os.write(self._wake_w, b"x")

    def _loop(self) -> None:
        last_refresh = 0.0
        while not self._closed:
            with self._lock:
                pending, self._pending = self._pending, []
            for fd, watch in pending:
                self._sel.register(fd, selectors.EVENT_READ, watch)
            ended = []
            for key, _ in self._sel.select(timeout=REFRESH_EVERY):
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                self._sel.unregister(key.fd)
                os.close(key.fd)
                key.data.tree.reaped()  # the leader has ended: once its parent reaps it, its pid may be reused
                ended.append(key.data)
            if ended:
                self._settle_many(ended)
            if self._emptied:
                self._remove_emptied()
            if time.monotonic() - last_refresh >= REFRESH_EVERY:
                last_refresh = time.monotonic()
                self._refresh_trees()

    def _remove_emptied(self) -> None:
        with self._lock:
            emptied, self._emptied = self._emptied, []
        for job_id, attempt in emptied:
            self.cgroups.remove(job_id, attempt)

    def _refresh_trees(self) -> None:
        """Remember new descendants of running attempts (a cgroup needs no help), so a worker that outlives
        its parent is still known to be the job's."""
        with self._lock:
            trees = [w.tree for w in self._watches.values()]
        trees = [t for t in trees if not t.exact()]
        if not trees:
            return
        try:
            children = procs.ppid_map()
            for tree in trees:
                tree.refresh(children)
        except Exception:  # a process table read racing exits: the next refresh catches up
            log.debug("process tree refresh failed", exc_info=True)

    def _settle_many(self, ended: list[Watch]) -> None:
        """Settle the attempts whose leaders ended in one round, with one look for orphans among them."""
        inexact = [watch for watch in ended if not watch.tree.exact()]
        if inexact:
            # Without a cgroup, a process orphaned since the last refresh is found by its job-protocol env
            # (the leader is gone, so no new descendant can be reached from it). One scan serves the round.
            found = scan(self.layout)
            for watch in inexact:
                watch.tree.add(found.get(watch.key, Found()).members)
        for watch in ended:
            self.settle(watch, scanned=True)

    def _kill_then_report(self, watch: Watch) -> None:
        kill_all(self.layout, watch.key, watch.tree)
        self._report(watch, extra="; leftover processes of the job were killed")

    def _report(self, watch: Watch, extra: str = "") -> None:
        with self._lock:
            self._watches.pop(watch.key, None)
        recorded = self.layout.read_exit(watch.job_id, watch.attempt)
        if recorded is not None:
            code, detail = recorded, f"exit code {recorded}"
        else:
            code, detail = -signal.SIGKILL, "process ended without recording an exit code (killed)"
        # The exit file stays until the service has recorded the exit (forget()): a service killed between
        # this report and its commit must find it again on restart, and so must another host's reaper.
        try:
            self._on_exit(Exit(watch.job_id, watch.attempt, code, detail + extra))
        except Exception:  # the service logs and recovers on its next reconcile
            log.exception("on_exit failed for job %s", watch.job_id)


def kill_all(layout: Layout, key: tuple[int, int], tree: procs.ProcessTree) -> None:
    """SIGKILL every process of attempt `key` until none is left (or LEFTOVER_WAIT has passed: a process stuck
    in the kernel). Without a cgroup, each round also looks for the attempt's processes by environment: one a
    leftover started just before its SIGKILL is orphaned to init, a descendant of nothing the tree knows."""
    deadline = time.monotonic() + LEFTOVER_WAIT
    while True:
        if not tree.exact():
            tree.add(scan(layout).get(key, Found()).members)
        if not tree.signal(signal.SIGKILL) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def scan(layout: Layout) -> dict[tuple[int, int], Found]:
    """Live processes of `layout`'s attempts on this machine, by (job id, attempt), found by environment:
    the wrapper (a session leader whose environment names an exit file there) and any process started with
    the attempt's job-protocol variables, which a worker keeps even after its wrapper and parent are gone."""
    found: dict[tuple[int, int], Found] = {}
    home = str(layout.home)
    for proc in psutil.process_iter():
        env = procs.environ_of(proc)
        if not env or not procs.alive(proc):
            continue
        exit_file = env.get(EXIT_FILE_VAR)
        key = layout.attempt_of(Path(exit_file)) if exit_file else None
        if key is not None and _session_leader(proc):
            found.setdefault(key, Found()).wrapper = proc
        elif env.get(protocol.HOME) == home and env.get(protocol.JOB_ID, "").isdigit() \
                and env.get(protocol.ATTEMPT, "").isdigit():
            key = (int(env[protocol.JOB_ID]), int(env[protocol.ATTEMPT]))
            found.setdefault(key, Found()).members.append(proc)
    return found


def _session_leader(proc: psutil.Process) -> bool:
    try:
        return os.getsid(proc.pid) == proc.pid
    except OSError:
        return False
