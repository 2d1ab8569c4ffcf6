"""The local executor: each attempt runs in its own process session on this host.

A tiny `/bin/sh` wrapper leads the session. It joins the attempt's cgroup (when there is one), `cd`s to the
submit directory, runs the command in the foreground and records the exit code in a file before exiting
(`orchestrator.layout`). That record is what lets a restarted service (even after `kill -9`) tell how a job
it did not see finish ended: jobs are left running across a service restart and adopted, like slurmstepd
keeps jobs alive across a slurmctld restart. The wrapper's own variables are unset before the command runs,
so the job and its workers never see them (the wrapper's /proc environ keeps them: that is how a restarted
service finds it).

An attempt is its whole process tree (`procs.ProcessTree`: a cgroup v2 where writable, else the descendants
psutil saw), not its process group: torchrun puts each worker in a session of its own. Stops reach every
process of the tree, and a device is handed back only once none is left. Exits are watched with pidfds
(one selector thread) so a finished job frees its device at once; the same thread refreshes the trees.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from orchestrator.executors import container, procs
from orchestrator.executors.base import (Executor, Exit, Launched, Liveness, OnExit, Probe, describe,
                                         job_argv)
from orchestrator.layout import Layout
from orchestrator.queue.models import Job
from runtime import protocol

log = logging.getLogger(__name__)

EXIT_FILE_VAR = "AUTORESEARCH_EXIT_FILE"
CGROUP_VAR = "AUTORESEARCH_CGROUP"
SHELL = "/bin/sh"
# `trap :` makes the shell outlive a SIGTERM long enough to record the job's exit code; a trap with a
# command is reset to the default in the child, so the job itself still gets the signal.
WRAPPER = ('ef=$' + EXIT_FILE_VAR + '; cg=$' + CGROUP_VAR + '; unset ' + EXIT_FILE_VAR + ' ' + CGROUP_VAR + '; '
           '[ -z "$cg" ] || { echo $$ > "$cg/cgroup.procs"; } 2>/dev/null; '
           'cd -- "$1" || exit 126; shift; trap : TERM INT; "$@"; rc=$?; printf "%s" "$rc" > "$ef"; exit $rc')
REFRESH_EVERY = 0.5  # seconds between looks at the process trees of attempts without a cgroup
_LEFT_RUNNING: list[subprocess.Popen] = []  # children still running when their executor closed (see close)
LEFTOVER_WAIT = 30.0  # seconds to keep killing what an ended attempt left behind before reporting anyway


@dataclass
class _Watch:
    job_id: int
    attempt: int
    pid: int
    tree: procs.ProcessTree
    child: Optional[subprocess.Popen] = None  # None for an adopted process (not our child: no status to collect)
    key: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.job_id, self.attempt)


class LocalExecutor(Executor):
    """Runs attempts as local process trees and reports their exits through `on_exit`."""

    name = "local"

    def __init__(self, layout: Layout, on_exit: OnExit, *, cgroup: str = "auto",
                 container_engine: Optional[str] = None):
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.container_engine = container_engine  # for --image jobs (executors.container), resolved per use
        self.layout.ensure()
        self.cgroups = procs.Cgroups.for_home(self.layout.home, cgroup)
        if self.cgroups is not None:
            self.cgroups.prune(keep_base=True)  # emptied attempt cgroups an earlier service could not remove
        self._on_exit = on_exit
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pending: list[tuple[int, _Watch]] = []
        self._watches: dict[tuple[int, int], _Watch] = {}
        self._log_dirs: set[Path] = set()  # folders of job logs made (or found) by this executor
        self._emptied: list[tuple[int, int]] = []  # attempts forgotten whose cgroups are still to remove
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="local-executor-watch", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, settings, layout: Layout, on_exit: OnExit) -> "LocalExecutor":
        mode = os.environ.get("AUTORESEARCH_CGROUP") or str(settings.extra.get("cgroup", "auto"))
        return cls(layout, on_exit, cgroup=mode, container_engine=settings.container_engine)

    @property
    def tracking(self) -> str:
        """How attempts' processes are tracked here: `cgroup` (v2) or `psutil` (descendants)."""
        return "cgroup" if self.cgroups is not None else "psutil"

    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        exit_file = self.layout.exit_file(job.id, job.attempts)
        exit_file.unlink(missing_ok=True)
        cgroup = self.cgroups.create(job.id, job.attempts) if self.cgroups is not None else None
        env = dict(env)
        env[EXIT_FILE_VAR] = str(exit_file)
        env[CGROUP_VAR] = str(cgroup or "")
        log_path = Path(job.log_path or self.layout.log_path(job.id))
        if log_path.parent not in self._log_dirs:  # one look per folder (every job's log is in one)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_dirs.add(log_path.parent)
        if job.checkpoint_dir:
            os.makedirs(job.checkpoint_dir, exist_ok=True)
        cwd = job.cwd if job.cwd and os.path.isdir(job.cwd) else str(Path.home())
        if job.image:  # the container is the job's process: the wrapper runs the engine in the foreground
            log_path.touch()
            argv = container.run_argv(job, env, self.layout, container.engine_name(self.container_engine))
        else:
            argv = job_argv(job)
        with open(log_path, "ab", buffering=0) as out:
            out.write(f"=== autoresearch: attempt {job.attempts} of job {job.id} on "
                      f"{','.join(job.devices) or '-'}: {describe(argv)}\n".encode())
            # subprocess, not os.posix_spawn: both vfork and exec, but posix_spawn holds the GIL until the
            # child has exec'd (1-3 ms a job, every other thread of the service stalled: py-spy --gil put half
            # the service's GIL time there), while _posixsubprocess releases it around the vfork.
            popen = subprocess.Popen([SHELL, "-c", WRAPPER, "autoresearch-job", cwd, *argv], executable=SHELL,
                                     env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        pid = popen.pid
        # One psutil.Process: building it reads /proc/PID/stat for its start time already (a second lookup
        # through procs.start_time doubled the launch's /proc work, measured with py-spy on 600 no-op jobs).
        proc = _process(pid)
        start = procs.start_time_of(proc) if proc is not None else None
        self._watch(_Watch(job.id, job.attempts, pid, procs.ProcessTree(proc, cgroup), child=popen))
        return Launched(pid, start)

    # ---- finding attempts ---------------------------------------------------------------------------------

    def _foreign(self, job: Job) -> bool:
        """Whether the job's handle is another executor's (e.g. `ray:SID@ADDRESS`): not ours to judge."""
        return bool(job.proc_start) and ":" in str(job.proc_start)

    def _tree(self, job: Job, layout: Layout) -> procs.ProcessTree:
        """The processes of the job's current attempt on this machine, from the watch, the recorded pid, the
        attempt's cgroup, or a wrapper whose environment names the attempt's exit file."""
        watch = self._watches.get((job.id, job.attempts)) if layout == self.layout else None
        if watch is not None:
            return watch.tree
        leader = procs.same_process(job.pid, job.proc_start)
        cgroups = self.cgroups if layout == self.layout else procs.Cgroups.for_home(layout.home, "existing")
        cgroup = cgroups.path(job.id, job.attempts) if cgroups is not None else None
        cgroup = cgroup if cgroup is not None and cgroup.exists() else None
        if leader is not None:
            return procs.ProcessTree(leader, cgroup)
        # No leader to start from: look for the wrapper (its pid was never recorded) and for processes the
        # attempt left behind (their parents died, so no tree leads to them).
        found = _scan(layout).get((job.id, job.attempts), _Found())
        return procs.ProcessTree(found.wrapper, cgroup, extra=found.members)

    def probe(self, job: Job, layout: Optional[Layout] = None) -> Probe:
        layout = layout or self.layout
        if self._foreign(job):
            return Probe(Liveness.UNKNOWN, detail=f"handle {job.proc_start!r} belongs to another executor")
        tree = self._tree(job, layout)
        if tree.alive():
            leader = tree.leader if tree.leader is not None and procs.alive(tree.leader) else None
            found = Launched(leader.pid, procs.start_time(leader.pid)) if leader is not None else None
            return Probe(Liveness.RUNNING, found=found)
        code = layout.read_exit(job.id, job.attempts)
        if code is not None:
            return Probe(Liveness.ENDED, code, f"exit code {code}", found=Launched(0, None))
        return Probe(Liveness.GONE)

    def find_attempt(self, job: Job) -> Optional[Launched]:
        probe = self.probe(job)
        if probe.state is Liveness.RUNNING and probe.found is None:
            return Launched(0, None)  # only leftovers of the attempt live: adopt() settles them
        return probe.found

    def signal(self, job: Job, sig: int, layout: Optional[Layout] = None) -> None:
        if self._foreign(job):
            return
        layout = layout or self.layout
        engine = container.engine_for(job, self.container_engine)
        if engine is not None:  # a container: through the engine; its client and wrapper go only with a SIGKILL
            container.deliver(engine, container.container_name(layout.home, job.id, job.attempts), sig,
                              self._tree(job, layout).alive, job.grace)
            if sig != signal.SIGKILL:
                return
        self._tree(job, layout).signal(sig)

    def adopt(self, job: Job) -> bool:
        recorded = procs.same_process(job.pid, job.proc_start)
        tree = self._tree(job, self.layout)
        if recorded is not None and not tree.exact():  # ranks orphaned while nobody watched: by their env
            tree.add(_scan(self.layout).get((job.id, job.attempts), _Found()).members)
        # The wrapper, by its recorded pid or else by its environment (a pid recorded in another format).
        leader = tree.leader if tree.leader is not None and procs.alive(tree.leader) else None
        watch = _Watch(job.id, job.attempts, leader.pid if leader is not None else job.pid or 0, tree)
        if leader is not None:
            self._watch(watch)
            return True
        engine = container.engine_for(job, self.container_engine)
        if engine is not None:  # its engine client is gone: nothing would remove the container (or stop its job)
            container.remove(engine, container.container_name(self.layout.home, job.id, job.attempts))
        self._settle(watch, None)
        return False

    def stop_strays(self, current: set[tuple[int, int]], grace: float = 10.0) -> list[int]:
        strays: dict[tuple[int, int], procs.ProcessTree] = {}
        for key, found in _scan(self.layout).items():
            if key not in current:
                strays[key] = procs.ProcessTree(found.wrapper, self._cgroup_of(*key), extra=found.members)
        for key in (self.cgroups.attempts() if self.cgroups is not None else []):
            if key not in current and key not in strays:
                strays[key] = procs.ProcessTree(None, self._cgroup_of(*key))
        for tree in strays.values():
            tree.signal(signal.SIGTERM)
            threading.Thread(target=_kill_after, args=(tree, grace), daemon=True).start()
        return sorted(job_id for job_id, _ in strays)

    def _cgroup_of(self, job_id: int, attempt: int) -> Optional[Path]:
        if self.cgroups is None:
            return None
        path = self.cgroups.path(job_id, attempt)
        return path if path.exists() else None

    def forget(self, job_id: int, attempt: int) -> None:
        self.layout.exit_file(job_id, attempt).unlink(missing_ok=True)
        if self.cgroups is not None:  # removing a cgroup costs ~1 ms in the kernel: the watcher does it
            with self._lock:
                self._emptied.append((job_id, attempt))
            os.write(self._wake_w, b"x")

    def _remove_emptied(self) -> None:
        with self._lock:
            emptied, self._emptied = self._emptied, []
        for job_id, attempt in emptied:
            self.cgroups.remove(job_id, attempt)

    def close(self) -> None:
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                os.close(key.fd)
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for watch in list(self._watches.values()):
            if watch.child is not None and watch.child.poll() is None:
                # Still running: left to the next service, which adopts it. Kept referenced so that no
                # Popen.__del__ hands it to subprocess's own reaping of forgotten children.
                _LEFT_RUNNING.append(watch.child)
            # (poll() collected the children that already ended: a zombie keeps its cgroup busy)
        if self.cgroups is not None:
            self._remove_emptied()
            self.cgroups.prune()

    # ---- watching -----------------------------------------------------------------------------------------

    def _watch(self, watch: _Watch) -> None:
        try:
            fd = os.pidfd_open(watch.pid)
        except ProcessLookupError:
            self._settle(watch, None)
            return
        with self._lock:
            self._pending.append((fd, watch))
            self._watches[watch.key] = watch
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
                ended.append((key.data, self._wait(key.data)))
            if ended:
                self._settle_many(ended)
            if self._emptied:
                self._remove_emptied()
            if time.monotonic() - last_refresh >= REFRESH_EVERY:
                last_refresh = time.monotonic()
                self._refresh_trees()

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

    @staticmethod
    def _wait(watch: _Watch) -> Optional[int]:
        """The leader's exit status (None for an adopted process: not our child)."""
        if watch.child is None:
            return None
        try:  # not Popen.wait(): it reports a status it could not collect as 0, a success
            _, raw = os.waitpid(watch.pid, 0)
            code: Optional[int] = os.waitstatus_to_exitcode(raw)
        except ChildProcessError:
            code = None
        watch.child.returncode = -signal.SIGKILL if code is None else code  # collected: Popen must not wait
        return code

    def _settle_many(self, ended: list[tuple[_Watch, Optional[int]]]) -> None:
        """Settle the attempts whose leaders ended in one round, with one look for orphans among them."""
        inexact = [watch for watch, _ in ended if not watch.tree.exact()]
        if inexact:
            # Without a cgroup, a process orphaned since the last refresh is found by its Contract 3 env
            # (the leader is gone, so no new descendant can be reached from it). One scan serves the round.
            found = _scan(self.layout)
            for watch in inexact:
                watch.tree.add(found.get(watch.key, _Found()).members)
        for watch, status in ended:
            self._settle(watch, status, scanned=True)

    def _settle(self, watch: _Watch, status: Optional[int], scanned: bool = False) -> None:
        """Report the attempt's end once none of its processes is left (leftovers are killed first, in a
        thread: the device is not handed back while a rank still holds it)."""
        if not scanned and not watch.tree.exact():
            watch.tree.add(_scan(self.layout).get(watch.key, _Found()).members)
        if watch.tree.members(refresh=False):
            threading.Thread(target=self._kill_then_report, args=(watch, status), daemon=True).start()
            return
        self._report(watch, status)

    def _kill_then_report(self, watch: _Watch, status: Optional[int]) -> None:
        deadline = time.monotonic() + LEFTOVER_WAIT
        while watch.tree.signal(signal.SIGKILL) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._report(watch, status, extra="; leftover processes of the job were killed")

    def _report(self, watch: _Watch, status: Optional[int], extra: str = "") -> None:
        with self._lock:
            self._watches.pop(watch.key, None)
        recorded = self.layout.read_exit(watch.job_id, watch.attempt)
        if recorded is not None:
            code, detail = recorded, f"exit code {recorded}"
        elif status is not None:
            code = status
            detail = f"killed by signal {-status}" if status < 0 else f"exit code {status}"
        else:
            code, detail = -signal.SIGKILL, "process ended without recording an exit code (killed)"
        # The exit file stays until the service has recorded the exit (forget()): a service killed between
        # this report and its commit must find it again on restart, and so must another host's reaper.
        try:
            self._on_exit(Exit(watch.job_id, watch.attempt, code, detail + extra))
        except Exception:  # the service logs and recovers on its next reconcile
            log.exception("on_exit failed for job %s", watch.job_id)


def _process(pid: int) -> Optional[psutil.Process]:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


@dataclass
class _Found:
    wrapper: Optional[psutil.Process] = None
    members: list[psutil.Process] = field(default_factory=list)


def _scan(layout: Layout) -> dict[tuple[int, int], _Found]:
    """Live processes of `layout`'s attempts on this machine, by (job id, attempt), found by environment:
    the wrapper (a session leader whose environment names an exit file there) and any process started with
    the attempt's Contract 3 variables, which a worker keeps even after its wrapper and parent are gone."""
    found: dict[tuple[int, int], _Found] = {}
    home = str(layout.home)
    for proc in psutil.process_iter():
        env = procs.environ_of(proc)
        if not env or not procs.alive(proc):
            continue
        exit_file = env.get(EXIT_FILE_VAR)
        key = layout.attempt_of(Path(exit_file)) if exit_file else None
        if key is not None and _session_leader(proc):
            found.setdefault(key, _Found()).wrapper = proc
        elif env.get(protocol.HOME) == home and env.get(protocol.JOB_ID, "").isdigit() \
                and env.get(protocol.ATTEMPT, "").isdigit():
            key = (int(env[protocol.JOB_ID]), int(env[protocol.ATTEMPT]))
            found.setdefault(key, _Found()).members.append(proc)
    return found


def _session_leader(proc: psutil.Process) -> bool:
    try:
        return os.getsid(proc.pid) == proc.pid
    except OSError:
        return False


def _kill_after(tree: procs.ProcessTree, grace: float) -> None:
    deadline = time.monotonic() + grace
    while tree.alive() and time.monotonic() < deadline:
        time.sleep(0.25)
    tree.signal(signal.SIGKILL)
