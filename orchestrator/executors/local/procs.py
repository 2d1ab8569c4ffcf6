"""Processes on this host, through psutil: identity across pid reuse, and the whole tree of one attempt.

An attempt's processes are not one process group: torchrun starts each worker in a session of its own
(`start_new_session=True`), and a job may daemonize helpers. So an attempt is tracked as a tree:
- a cgroup v2 of its own where the unified hierarchy is mounted and writable (the wrapper joins it before
  it runs the command, so every descendant is inside whatever its session or parent): exact, and it survives
  a service restart since its path is derived from the home and the attempt;
- else the wrapper's descendants as psutil sees them, remembered while the attempt runs (the executor's
  watcher refreshes them), so a worker whose parent died (re-parented to init) is still known.
Stopping signals every live member; SIGKILL goes through `cgroup.kill` when there is a cgroup.
"""

from __future__ import annotations

import hashlib
import logging
import signal as signals
from pathlib import Path
from typing import Iterable, Optional

import psutil

log = logging.getLogger(__name__)


def start_time(pid: int) -> Optional[str]:
    """The process's start time as a string, which tells our process from a later one reusing its pid."""
    try:
        return start_time_of(psutil.Process(pid))
    except (psutil.Error, ValueError):
        return None


def start_time_of(proc: psutil.Process) -> Optional[str]:
    """`start_time` of a process already looked up (None when it is gone)."""
    try:
        return f"{proc.create_time():.2f}"
    except (psutil.Error, ValueError):
        return None


def alive(proc: psutil.Process) -> bool:
    """Whether `proc` still runs (a zombie has ended: only its exit status is left to collect)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def same_process(pid: Optional[int], start: Optional[str]) -> Optional[psutil.Process]:
    """The live process `pid` when it is still the one that started at `start` (any start when None)."""
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
    except (psutil.Error, ValueError):
        return None
    if not alive(proc) or (start is not None and start_time_of(proc) != start):
        return None
    return proc


def pid_alive(pid: Optional[int]) -> bool:
    """Whether process `pid` runs (not a zombie); for callers that recorded only a pid (agent sessions)."""
    return same_process(pid, None) is not None


def environ_of(proc: psutil.Process) -> dict[str, str]:
    """The environment a process was started with ({} when unreadable)."""
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return {}


def cgroup2_root() -> Optional[Path]:
    """Where this process's cgroup v2 lives (the unified mount plus our own cgroup), None without cgroup v2."""
    try:
        mounts = [p.mountpoint for p in psutil.disk_partitions(all=True) if p.fstype == "cgroup2"]
        own = next((line.split(":", 2)[2].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), None)
    except OSError:
        return None
    if not mounts or own is None:
        return None
    return Path(mounts[0]) / own.lstrip("/")


class Cgroups:
    """The cgroup v2 subtree that holds the attempts of one home (`autoresearch-HASH/ID.ATTEMPT`)."""

    def __init__(self, base: Path):
        self.base = base

    @classmethod
    def for_home(cls, home: Path, mode: str = "auto") -> Optional["Cgroups"]:
        """The subtree for `home` when cgroup v2 is available and writable here (`mode` off: never;
        `existing`: only when that home's subtree exists already, e.g. another service's)."""
        if mode == "off":
            return None
        root = cgroup2_root()
        if root is None:
            return None
        tag = hashlib.sha1(str(Path(home).resolve()).encode()).hexdigest()[:8]
        base = root / f"autoresearch-{tag}"
        if mode == "existing":
            return cls(base) if base.is_dir() else None
        try:
            base.mkdir(exist_ok=True)
            probe = base / "probe"
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError as exc:
            log.info("no cgroup for job processes (%s): tracking them with psutil", exc)
            return None
        return cls(base)

    def path(self, job_id: int, attempt: int) -> Path:
        return self.base / f"{job_id}.{attempt}"

    def create(self, job_id: int, attempt: int) -> Optional[Path]:
        """Make the attempt's cgroup (None when that fails: psutil tracking covers the attempt)."""
        path = self.path(job_id, attempt)
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            log.warning("cannot create cgroup %s: %s", path, exc)
            return None
        return path

    def attempts(self) -> list[tuple[int, int]]:
        """(job id, attempt) of every attempt cgroup that still holds a process."""
        found = []
        try:
            entries = list(self.base.iterdir())
        except OSError:
            return []
        for entry in entries:
            try:
                job_id, attempt = (int(x) for x in entry.name.split("."))
            except ValueError:
                continue
            if cgroup_pids(entry):
                found.append((job_id, attempt))
        return found

    def prune(self, keep_base: bool = False) -> None:
        """Remove emptied attempt cgroups (exit codes live in exit files, not here), then the subtree when
        nothing is left in it (unless `keep_base`). A cgroup whose last process is a zombie not yet
        collected by its parent cannot go yet: the next prune takes it."""
        try:
            entries = [e for e in self.base.iterdir() if e.is_dir()]
        except OSError:
            return
        for entry in entries:
            if not cgroup_pids(entry):
                try:
                    entry.rmdir()
                except OSError:
                    pass
        if not keep_base:
            try:
                self.base.rmdir()
            except OSError:
                pass

    def remove(self, job_id: int, attempt: int) -> None:
        """Drop an emptied attempt cgroup."""
        try:
            self.path(job_id, attempt).rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.debug("cgroup %s not removed: %s", self.path(job_id, attempt), exc)


def cgroup_pids(path: Path) -> list[int]:
    """The processes in a cgroup ([] when it is gone)."""
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


class ProcessTree:
    """Every process of one attempt: its cgroup's members when the attempt is in its cgroup, else the
    leader's descendants seen so far (plus any `extra` process known to be the attempt's)."""

    def __init__(self, leader: Optional[psutil.Process], cgroup: Optional[Path] = None,
                 extra: Iterable[psutil.Process] = ()):
        self.leader = leader
        self.cgroup = cgroup
        self._known: dict[int, psutil.Process] = {}
        self.add(extra)
        if leader is not None:
            self._known[leader.pid] = leader

    def add(self, found: Iterable[psutil.Process]) -> None:
        """Count these processes (and later their descendants) as the attempt's."""
        for proc in found:
            self._known.setdefault(proc.pid, proc)

    def reaped(self) -> None:
        """The leader has ended (its parent collects it): its pid is no longer looked at (it may be reused)."""
        if self.leader is not None:
            self._known.pop(self.leader.pid, None)
            self.leader = None

    def exact(self) -> bool:
        """Whether the cgroup holds the attempt (the wrapper joined it), so no psutil tracking is needed."""
        return self._exact_pids() is not None

    def _exact_pids(self) -> Optional[list[int]]:
        """The cgroup's processes when the cgroup holds the attempt, else None (one read of cgroup.procs)."""
        if self.cgroup is None:
            return None
        pids = cgroup_pids(self.cgroup)
        leader = self.leader  # read once: the watcher's thread may mark it reaped meanwhile
        if leader is not None and alive(leader):
            return pids if leader.pid in pids else None
        return pids if pids or not any(alive(p) for p in self._known.values()) else None

    def refresh(self, children: Optional[dict[int, list[int]]] = None) -> None:
        """Remember the current descendants of known processes (`children`: a ppid map shared by several
        trees), so one that outlives its parent is still known."""
        if children is None:
            children = ppid_map()
        for proc in [p for p in self._known.values() if alive(p)]:
            for child in _descendants(proc, children):
                self._known.setdefault(child.pid, child)

    def members(self, refresh: bool = True) -> list[psutil.Process]:
        """The live processes of the attempt (`refresh` False: without looking for new descendants of the
        known ones, which costs a scan of the process table when there is no cgroup)."""
        found: dict[int, psutil.Process] = {}
        pids = self._exact_pids()
        if pids is not None:
            for pid in pids:
                proc = self._known.get(pid)
                try:
                    found[pid] = proc if proc is not None else psutil.Process(pid)
                except psutil.Error:
                    pass
        else:
            if refresh:
                self.refresh()
            found = dict(self._known)
        live = {pid: p for pid, p in found.items() if alive(p)}
        self._known.update(live)
        return list(live.values())

    def alive(self) -> bool:
        """Whether any process of the attempt lives."""
        return bool(self.members())

    def signal(self, sig: int) -> int:
        """Send `sig` to every process of the attempt; returns how many got it."""
        if sig == signals.SIGKILL and self.cgroup is not None:
            try:  # atomic: nothing in the cgroup can fork past it
                (self.cgroup / "cgroup.kill").write_text("1")
            except OSError:
                pass
        sent = 0
        for proc in self.members():
            try:
                proc.send_signal(sig)
                sent += 1
            except psutil.Error:
                pass
        return sent


def ppid_map() -> dict[int, list[int]]:
    """Children by parent pid, for every process on this host (one scan for many trees)."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"] or 0, []).append(proc.pid)
    return children


def _descendants(proc: psutil.Process, children: dict[int, list[int]]) -> Iterable[psutil.Process]:
    out, stack = [], [proc.pid]
    while stack:
        for pid in children.get(stack.pop(), []):
            try:
                out.append(psutil.Process(pid))
            except psutil.Error:
                continue
            stack.append(pid)
    return out
