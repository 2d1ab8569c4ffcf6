"""The local executor: each attempt runs in its own process session on this host.

A tiny `/bin/sh` wrapper leads the session. It `cd`s to the submit directory, runs the command in the
foreground and records the exit code in a file before exiting. That record is what lets a restarted service
(even after `kill -9`) tell how a job it did not see finish ended: jobs are left running across a service
restart and adopted, like slurmstepd keeps jobs alive across a slurmctld restart.

Exits are watched with pidfds (one selector thread, no polling) so a finished job frees its device at once.
A device is handed back only once no process of the job's group is left.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from orchestrator.executors.base import (Exit, Launched, OnExit, describe, group_alive, job_argv,
                                         proc_start_time, same_process)
from orchestrator.queue.models import Job

log = logging.getLogger(__name__)

EXIT_FILE_VAR = "AUTORESEARCH_EXIT_FILE"
SHELL = "/bin/sh"
# `trap :` makes the shell outlive a SIGTERM to the group long enough to record the job's exit code;
# a trap with a command is reset to the default in the child, so the job itself still gets the signal.
WRAPPER = ('cd -- "$1" || exit 126; shift; trap : TERM INT; "$@"; rc=$?; '
           'printf "%s" "$rc" > "$' + EXIT_FILE_VAR + '"; exit $rc')


@dataclass
class _Watch:
    job_id: int
    attempt: int
    pid: int
    exit_file: Path
    child: bool = False  # False for an adopted process (not our child: no wait status to collect)


class LocalExecutor:
    """Runs attempts as local process groups and reports their exits through `on_exit`."""

    name = "local"

    def __init__(self, run_dir: Path, on_exit: OnExit):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._on_exit = on_exit
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pending: list[tuple[int, _Watch]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="local-executor-watch", daemon=True)
        self._thread.start()

    def inventory(self) -> Optional[list[str]]:
        return None

    def exit_file(self, job_id: int, attempt: int) -> Path:
        return self.run_dir / f"{job_id}.{attempt}.exit"

    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        exit_file = self.exit_file(job.id, job.attempts)
        exit_file.unlink(missing_ok=True)
        env = dict(env)
        env[EXIT_FILE_VAR] = str(exit_file)
        argv = job_argv(job)
        log_path = Path(job.log_path or self.run_dir / f"{job.id}.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if job.checkpoint_dir:
            os.makedirs(job.checkpoint_dir, exist_ok=True)
        cwd = job.cwd if job.cwd and os.path.isdir(job.cwd) else str(Path.home())
        with open(log_path, "ab", buffering=0) as out:
            out.write(f"=== autoresearch: attempt {job.attempts} of job {job.id} on "
                      f"{','.join(job.devices) or '-'}: {describe(argv)}\n".encode())
        # posix_spawn (vfork + exec in libc) costs a fraction of subprocess.Popen; Python's own fds are
        # close-on-exec, so the job inherits only what the file actions set up.
        pid = os.posix_spawn(SHELL, [SHELL, "-c", WRAPPER, "autoresearch-job", cwd, *argv], env,
                             file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                           (os.POSIX_SPAWN_OPEN, 1, str(log_path),
                                            os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644),
                                           (os.POSIX_SPAWN_DUP2, 1, 2)],
                             setsid=True)
        start = proc_start_time(pid)
        self._watch(_Watch(job.id, job.attempts, pid, exit_file, child=True))
        return Launched(pid, start)

    def signal(self, job: Job, sig: int) -> None:
        if not job.pid or not group_alive(job.pid):
            return
        try:
            os.killpg(job.pid, sig)
        except ProcessLookupError:
            pass

    def adopt(self, job: Job) -> bool:
        if job.pid and same_process(job.pid, job.proc_start):
            self._watch(_Watch(job.id, job.attempts, job.pid, self.exit_file(job.id, job.attempts)))
            return True
        self._report(_Watch(job.id, job.attempts, job.pid or 0, self.exit_file(job.id, job.attempts)), None)
        return False

    def _wrappers(self) -> dict[Path, int]:
        """Live attempt wrappers of this run dir (session leaders whose environment names an exit file here),
        by exit file."""
        prefix = f"{EXIT_FILE_VAR}={self.run_dir}/".encode()
        found: dict[Path, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    env = fh.read().split(b"\0")
                if os.getpgid(int(entry)) != int(entry):
                    continue
            except OSError:
                continue
            for var in env:
                if var.startswith(prefix):
                    found[Path(var.split(b"=", 1)[1].decode())] = int(entry)
        return found

    def find_attempt(self, job: Job) -> Optional[Launched]:
        """The wrapper of the job's current attempt, found by its environment (the service died between
        spawning it and recording its pid)."""
        pid = self._wrappers().get(self.exit_file(job.id, job.attempts))
        if pid is not None:
            return Launched(pid, proc_start_time(pid))
        if self.exit_file(job.id, job.attempts).exists():
            return Launched(0, None)  # it ran and ended: adopt() reads its recorded exit code
        return None

    def forget(self, job_id: int, attempt: int) -> None:
        """The store has recorded how this attempt ended: its exit record is no longer needed."""
        self.exit_file(job_id, attempt).unlink(missing_ok=True)

    def stop_strays(self, current: set[tuple[int, int]], grace: float = 10.0) -> list[int]:
        """Stop attempts still running here that the queue no longer gives to this host (another service
        reaped this one while it was gone and requeued them): SIGTERM, SIGKILL after `grace`. A job whose
        supervisor died is stopped, not left to run twice. Returns the job ids stopped."""
        stopped = []
        for exit_file, pid in self._wrappers().items():
            try:
                job_id, attempt = (int(x) for x in exit_file.name.split(".")[:2])
            except ValueError:
                continue
            if (job_id, attempt) in current:
                continue
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            stopped.append(job_id)
            threading.Thread(target=self._kill_after, args=(pid, grace), daemon=True).start()
        return stopped

    @staticmethod
    def _kill_after(pgid: int, grace: float) -> None:
        deadline = time.monotonic() + grace
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

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

    # ---- watching -----------------------------------------------------------------------------------------

    def _watch(self, watch: _Watch) -> None:
        try:
            fd = os.pidfd_open(watch.pid)
        except ProcessLookupError:
            self._report(watch, None)
            return
        with self._lock:
            self._pending.append((fd, watch))
        os.write(self._wake_w, b"x")

    def _loop(self) -> None:
        while not self._closed:
            with self._lock:
                pending, self._pending = self._pending, []
            for fd, watch in pending:
                self._sel.register(fd, selectors.EVENT_READ, watch)
            for key, _ in self._sel.select(timeout=1.0):
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                self._sel.unregister(key.fd)
                os.close(key.fd)
                self._reaped(key.data)

    def _reaped(self, watch: _Watch) -> None:
        status: Optional[int] = None
        if watch.child:
            try:
                _, raw = os.waitpid(watch.pid, 0)
                status = os.waitstatus_to_exitcode(raw)
            except ChildProcessError:
                status = None
        if group_alive(watch.pid):
            # The leader is gone but something it started lives on: kill it before the device is reused.
            threading.Thread(target=self._kill_group_then_report, args=(watch, status), daemon=True).start()
            return
        self._report(watch, status)

    def _kill_group_then_report(self, watch: _Watch, status: Optional[int]) -> None:
        deadline = time.monotonic() + 30
        while group_alive(watch.pid) and time.monotonic() < deadline:
            try:
                os.killpg(watch.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self._report(watch, status, extra="; leftover processes of the job were killed")

    def _report(self, watch: _Watch, status: Optional[int], extra: str = "") -> None:
        recorded = _read_code(watch.exit_file)
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


def _read_code(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
