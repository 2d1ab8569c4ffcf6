"""NVIDIA MPS for `serve --mps`: one control daemon per GPU the service uses, jobs sharing a GPU as its clients.

Without MPS, jobs that share a GPU (`submit --gpus 0.25`) take turns on it (time-slicing: one context at a
time). Under MPS their kernels run side by side in one server context, each client held to its share of the
GPU's threads (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) and, when the job named one, to its memory
(`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`).

One daemon per GPU, each started with `CUDA_VISIBLE_DEVICES` set to that GPU alone and with pipe and log
folders of its own (`CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY`), so a client reaches its own GPU's
daemon by its pipe folder. The MPS server remaps the GPUs its daemon sees (the daemon's one GPU is device 0 to
its clients), so an index does not name the GPU to a client: daemon and clients are given the GPU's UUID,
which names it in both places (NVIDIA's advice), and which still names the right GPU if a client ever runs
without MPS. A GPU given by index whose UUID NVML cannot tell is left out of MPS (one line says so).

The pipe folder holds UNIX sockets, whose paths must fit in 108 bytes (`sun_path`); past that the daemon
fails without a word. It is `<home>/mps/<key>/pipe` when that fits, else `/tmp/ar-mps-<hash of the home>/<key>`
(mode 0700, ours). The logs stay under the home. `<key>` is the GPU's index, or a hash of its UUID: stable
across restarts, so a daemon is found again by the GPU it serves.

Life cycle (what was seen on driver 580, an H200): `nvidia-cuda-mps-control -d` daemonises and returns 0; a
second one on the same pipe folder exits 1 ("An instance of this daemon is already running");
`echo get_server_list | nvidia-cuda-mps-control` exits 0 when a daemon answers on the pipe folder and 1 at
once when none does ("Cannot find MPS control daemon process"), also when its files outlived a `kill -9`;
`echo quit | ...` ends it (it removes its pid file), once its clients have ended; a daemon killed with -9
can be started again on the same folder.
- Start: a daemon that answers on the GPU's pipe folder is adopted (a service that was `kill -9`ed, or
  stopped while clients ran, left it). Asking the daemon is the check, not its pid file: after a reboot the
  pid in a stale file may be another process's, and what a client needs is a daemon that answers on that
  folder. One started for another GPU (its recorded `CUDA_VISIBLE_DEVICES` differs) is stopped and replaced.
- Stop: `echo quit`, unless processes still run as its clients (their environment names its pipe folder: the
  jobs a stopped service leaves running): the daemon then stays, and the next service adopts it. A daemon
  told to quit waits for its clients but no longer answers, so the next service would start a second one on
  the folder, and the old clients and the new would sit in two server contexts on one GPU, time-sliced again.
- No `nvidia-cuda-mps-control` on PATH: one warning line, and the service runs without MPS.

Jobs on whole GPUs are not clients: they hold their GPUs alone, and a job on several GPUs could not be the
client of one GPU's daemon. Only jobs sharing one GPU are (`client_env`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import psutil

from orchestrator.core.devices import is_cpu_slot
from orchestrator.executors.local import procs

log = logging.getLogger(__name__)

BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe folder, written by the daemon
PIPE_VAR, LOG_VAR = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
THREADS_VAR, MEMORY_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
# sun_path holds 108 bytes with its NUL; the longest socket the daemon makes in its pipe folder is
# `control_privileged` (beside `control`, `control_lock`, `log` and the pid file).
MAX_PIPE_DIR = 108 - 1 - len("/control_privileged")
MISSING = f"serve --mps: {BINARY} not found on PATH; jobs share GPUs by time-slicing"
COMMAND_TIMEOUT = 10.0  # seconds one call of the control program may take
UP_WITHIN = 10.0  # seconds a started daemon has to answer
GONE_WITHIN = 5.0  # seconds stop() waits for a daemon told to quit (it may wait longer for clients: not us)


class MpsError(RuntimeError):
    """A GPU's daemon could not be started or found (the message is one line)."""


@dataclass
class Daemon:
    """The MPS control daemon of one GPU."""

    device: str  # the service's name for the GPU
    visible: str  # CUDA_VISIBLE_DEVICES of the daemon and of its clients (the GPU's UUID)
    pipe_dir: Path
    log_dir: Path
    adopted: bool = False  # found running (left by an earlier service), not started by this one

    @property
    def env(self) -> dict[str, str]:
        """The variables that point a process at this daemon."""
        return {PIPE_VAR: str(self.pipe_dir), LOG_VAR: str(self.log_dir)}

    def pid(self) -> Optional[int]:
        """The daemon's pid from its pid file (None: no file, or not a number)."""
        try:
            return int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None


def device_key(name: str) -> str:
    """The folder name of a GPU's daemon: its index, or 8 hex digits of its UUID's hash (short and stable)."""
    return name if name.isdigit() else hashlib.sha256(name.encode()).hexdigest()[:8]


def short_root(home: Path) -> Path:
    """The folder under /tmp for pipe folders whose path under the home would be too long."""
    return Path("/tmp") / f"ar-mps-{hashlib.sha256(str(home).encode()).hexdigest()[:8]}"


def pipe_and_log_dirs(home: Path, name: str) -> tuple[Path, Path]:
    """Where the daemon of GPU `name` keeps its sockets and its logs (the folders are not made here)."""
    key = device_key(name)
    base = Path(home) / "mps" / key
    pipe = base / "pipe"
    if len(os.fsencode(str(pipe))) > MAX_PIPE_DIR:
        pipe = short_root(Path(home)) / key
    return pipe, base / "log"


def _private_dir(path: Path) -> None:
    """Make `path` (0700); refuse one that another user owns or others may write (a shared /tmp)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise MpsError(f"{path} is not private to this user (owner uid {info.st_uid}, "
                       f"mode {stat.S_IMODE(info.st_mode):o})")


def _nvml_uuids(names: list[str]) -> dict[str, str]:
    """The UUIDs of GPUs named by index, through NVML (empty where NVML cannot tell)."""
    from runtime.nvml import Nvml

    found: dict[str, str] = {}
    with Nvml(timeout_s=5.0) as nv:
        if not nv.available:
            return found
        for name in names:
            try:
                found[name] = nv.uuid(name)
            except Exception:  # left out with a line by the caller
                pass
    return found


class MpsControl:
    """The MPS control daemons of a service's GPUs: `start()` at start-up, `stop()` at shutdown, and the
    environment of a job sharing one of them (`client_env`).

    `devices`: the service's device names (cpu slots are skipped). `uuids`: a function from GPU names given by
    index to their UUIDs (default: NVML). `env`: the environment the daemons start from (default: ours)."""

    def __init__(self, home: Path, devices: Iterable[str], *,
                 uuids: Optional[Callable[[list[str]], dict[str, str]]] = None,
                 env: Optional[dict[str, str]] = None, binary: str = BINARY):
        self.home = Path(home)
        self.gpus = [d for d in devices if not is_cpu_slot(d)]
        self._uuids = uuids or _nvml_uuids
        self._env = dict(os.environ if env is None else env)
        self._binary_name = binary
        self.binary: Optional[str] = None
        self.daemons: dict[str, Daemon] = {}  # by device name: the GPUs under MPS
        self.notes: list[str] = []  # the lines said at start (missing binary, GPUs left out)

    # ---- start and stop -----------------------------------------------------------------------------------

    def start(self) -> "MpsControl":
        """Start (or adopt) a daemon for each GPU. Never raises for MPS's sake: a GPU whose daemon cannot be
        had is left to time-slicing, with one line each."""
        if not self.gpus:
            return self
        self.binary = shutil.which(self._binary_name, path=self._env.get("PATH", os.defpath))
        if self.binary is None:
            self._note(MISSING)
            return self
        by_index = [g for g in self.gpus if not _is_uuid(g)]
        try:
            uuids = self._uuids(by_index) if by_index else {}
        except Exception as exc:  # no NVML: those GPUs are left out below, each with its line
            log.debug("NVML: %s", exc)
            uuids = {}
        for gpu in self.gpus:
            visible = gpu if _is_uuid(gpu) else uuids.get(gpu)
            if visible is None:
                self._note(f"serve --mps: GPU {gpu}: no UUID from NVML to name it to MPS clients; "
                           "its jobs share it by time-slicing")
                continue
            try:
                self.daemons[gpu] = self._start_one(gpu, visible)
            except (MpsError, OSError, subprocess.SubprocessError) as exc:
                self._note(f"serve --mps: GPU {gpu}: {one_line(exc)}; its jobs share it by time-slicing")
        if self.daemons:
            log.info("MPS: GPUs %s (%s)", ",".join(self.daemons),
                     ", ".join(f"{d.device}: {'adopted' if d.adopted else 'started'}" for d in self.daemons.values()))
        return self

    def _start_one(self, gpu: str, visible: str) -> Daemon:
        pipe, logs = pipe_and_log_dirs(self.home, gpu)
        if pipe.parent.parent == Path("/tmp"):
            _private_dir(pipe.parent)
        _private_dir(pipe)
        logs.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(gpu, visible, pipe, logs)
        record = logs.parent / "device"  # the CUDA_VISIBLE_DEVICES its daemon was started with
        if self._answers(daemon):
            if _read(record) == visible:
                daemon.adopted = True
                return daemon
            log.warning("MPS: the daemon on %s serves %s, not %s: replacing it", pipe, _read(record) or "?", visible)
            self._quit(daemon, wait=True)
        env = {**self._env, **daemon.env, VISIBLE_VAR: visible}
        with open(logs / "start.log", "ab") as out:  # a file, not a pipe: the daemon keeps what it inherits
            code = subprocess.run([self.binary, "-d"], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT, start_new_session=True,
                                  check=False).returncode
        if code != 0:
            raise MpsError(f"{BINARY} -d exited {code}: {_last_line(logs / 'start.log')}")
        deadline = time.monotonic() + UP_WITHIN
        while not self._answers(daemon):
            if time.monotonic() > deadline:
                raise MpsError(f"its daemon does not answer on {pipe} (see {logs})")
            time.sleep(0.05)
        record.write_text(visible)
        return daemon

    def stop(self) -> None:
        """Stop the daemons, except those with clients still running (the next service adopts them)."""
        for daemon in list(self.daemons.values()):
            try:
                clients = self.clients(daemon)
                if clients:
                    log.info("MPS: GPU %s keeps its daemon for %d running client(s); the next service adopts it",
                             daemon.device, len(clients))
                    continue
                self._quit(daemon, wait=True)
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("MPS: GPU %s: could not stop its daemon: %s", daemon.device, one_line(exc))
        self.daemons.clear()

    def clients(self, daemon: Daemon) -> list[int]:
        """Pids of processes that run as clients of `daemon` (their environment names its pipe folder), other
        than MPS's own: the daemon, and the servers it starts, which inherit its environment and stay up after
        their clients have gone."""
        own = set()
        pid = daemon.pid()
        if pid is not None:
            own.add(pid)
            try:
                own.update(p.pid for p in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                pass
        found = []
        for proc in psutil.process_iter(["name"]):
            if proc.pid in own or (proc.info["name"] or "").startswith("nvidia-cuda-mps"):
                continue
            env = procs.environ_of(proc)
            if env and env.get(PIPE_VAR) == str(daemon.pipe_dir) and procs.alive(proc):
                found.append(proc.pid)
        return found

    # ---- jobs -----------------------------------------------------------------------------------------------

    def manages(self, device: str) -> bool:
        """Whether `device` has an MPS daemon of this service."""
        return device in self.daemons

    def client_env(self, device: str, share: Optional[float], memory_bytes: Optional[int] = None) -> dict[str, str]:
        """The variables that make a job sharing `device` an MPS client holding `share` of its threads (and at
        most `memory_bytes` of its memory, when given). Empty when the device is not under MPS or the job does
        not share it (`share` None or 1: a whole GPU)."""
        daemon = self.daemons.get(device)
        if daemon is None or share is None or share >= 1:
            return {}
        env = {**daemon.env, VISIBLE_VAR: daemon.visible, THREADS_VAR: str(max(1, round(share * 100)))}
        if memory_bytes:
            # Device 0: the client sees its one GPU as device 0. Whole MiB, rounded down: a limit, never more.
            env[MEMORY_VAR] = f"0={max(1, int(memory_bytes) // 2**20)}M"
        return env

    # ---- the control program ---------------------------------------------------------------------------------

    def _command(self, daemon: Daemon, text: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary or self._binary_name], input=text + "\n", text=True, capture_output=True,
                              env={**self._env, **daemon.env}, timeout=COMMAND_TIMEOUT, check=False)

    def _answers(self, daemon: Daemon) -> bool:
        """Whether a daemon answers on `daemon`'s pipe folder (a wedged one that does not answer in time: no)."""
        try:
            return self._command(daemon, "get_server_list").returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _quit(self, daemon: Daemon, *, wait: bool) -> None:
        pid = daemon.pid()
        done = self._command(daemon, "quit")
        if done.returncode != 0:
            raise MpsError(f"quit: {one_line(done.stdout + done.stderr) or f'exit {done.returncode}'}")
        deadline = time.monotonic() + GONE_WITHIN
        while wait and pid is not None and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _note(self, line: str) -> None:
        self.notes.append(line)
        log.warning("%s", line)


def _is_uuid(name: str) -> bool:
    return bool(re.match(r"(GPU|MIG)-", name))


def _alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _last_line(path: Path) -> str:
    lines = (_read(path) or "").splitlines()
    return lines[-1] if lines else "no output"


def one_line(exc: object) -> str:
    """The first line of an error's text."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
