"""The chaos loop: faults at seeded random moments, on top of one another.

Each kind picks its target at random among what is there now; a kind with no target at this moment (no job
running, no tracking worker alive) is skipped and another drawn. Faults that last (a SIGSTOP for 30 s, a full
disk for a minute) end on timers, so others land while they hold. `done` counts the faults that landed, by kind.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

KINDS = ("kill_service", "kill_spawner", "kill_tracking_worker", "kill_job", "kill_session", "restart_postgres",
         "sigstop_service", "full_disk", "torn_checkpoint")
STOP_S = 30.0
FULL_S = 60.0


def _children(pid: int, needle: str) -> list[int]:
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for kid in kids:
        try:
            if needle in " ".join(kid.cmdline()):
                out.append(kid.pid)
        except psutil.Error:
            pass
    return out


def _kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def job_leaf(pid: int) -> Optional[int]:
    """The job's own training process under its wrapper (the deepest python process of the attempt's tree)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    pythons = [p.pid for p in procs if _name(p).startswith("python")]
    return pythons[-1] if pythons else pid


def _name(proc) -> str:
    try:
        return proc.name()
    except Exception:
        return ""


class Chaos:
    """Draws faults from `kinds` every `mean_gap` seconds on average (exponential gaps) and applies them to the
    soak's `world` (services, sessions, stores, the cluster, the full-disk mount)."""

    def __init__(self, rng: random.Random, world, kinds: tuple[str, ...] = KINDS, mean_gap: float = 12.0,
                 log: Callable[[str], None] = print):
        self.rng, self.world, self.mean_gap, self.log = rng, world, mean_gap, log
        self.kinds = tuple(k for k in kinds if k != "full_disk" or world.full_disk_dir is not None)
        self.done: Counter = Counter()
        self.skipped: Counter = Counter()
        self._next = time.time() + rng.expovariate(1 / mean_gap)
        self._timers: list[threading.Timer] = []
        self._disk_full = False
        self.disk_held_until = 0.0  # the full disk's minute, and 15 s after it for what it left failing

    def step(self) -> None:
        if time.time() < self._next:
            return
        self._next = time.time() + self.rng.expovariate(1 / self.mean_gap)
        for kind in self.rng.sample(self.kinds, len(self.kinds)):
            try:
                what = getattr(self, kind)()
            except Exception as exc:  # a fault that could not be applied is not a product failure: say it
                what, _ = None, self.log(f"chaos: {kind} not applied: {type(exc).__name__}: {exc}")
            if what:
                self.done[kind] += 1
                self.log(f"chaos: {kind}: {what}")
                return
            self.skipped[kind] += 1

    def close(self) -> None:
        """End the lasting faults now (SIGCONT, free the disk) before the final checks."""
        for timer in self._timers:
            timer.cancel()
            timer.function(*timer.args)
        self._timers.clear()

    def _later(self, seconds: float, fn: Callable, *args) -> None:
        timer = threading.Timer(seconds, fn, args)
        timer.daemon = True
        self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()

    # -- the faults -----------------------------------------------------------------------------------------

    def _service(self):
        alive = [s for s in self.world.services if s.alive()]
        return self.rng.choice(alive) if alive else None

    def kill_service(self) -> Optional[str]:
        svc = self._service()
        if svc and _kill(svc.proc.pid):
            return f"{svc.home.name} pid {svc.proc.pid}"
        return None

    def _kill_child(self, needles: tuple[str, ...]) -> Optional[str]:
        svcs = [s for s in self.world.services if s.alive() and s.stopped_until < time.time()]
        self.rng.shuffle(svcs)
        for svc in svcs:
            pids = [p for n in needles for p in _children(svc.proc.pid, n)]
            if pids:
                pid = self.rng.choice(pids)
                if _kill(pid):
                    return f"{svc.home.name} pid {pid}"
        return None

    def kill_spawner(self) -> Optional[str]:
        return self._kill_child(("orchestrator.executors.local.spawner", "orchestrator.executors.local.warmpool"))

    def kill_tracking_worker(self) -> Optional[str]:
        return self._kill_child(("orchestrator.tracking.worker",))

    def _running_jobs(self) -> list[tuple[str, object]]:
        from orchestrator.queue.states import JobState

        out = []
        for queue, store in self.world.stores.items():
            try:
                out += [(queue, j) for j in store.list([JobState.RUNNING]) if j.pid]
            except Exception:
                pass  # PostgreSQL restarting
        return out

    def kill_job(self) -> Optional[str]:
        jobs = self._running_jobs()
        if not jobs:
            return None
        queue, job = self.rng.choice(jobs)
        leaf = job_leaf(job.pid)
        if leaf and _kill(leaf):
            return f"{queue} job {job.id} pid {leaf}"
        return None

    def kill_session(self) -> Optional[str]:
        alive = [s for s in self.world.sessions if s.alive()]
        if not alive:
            return None
        sess = self.rng.choice(alive)
        if _kill(sess.proc.pid):
            sess.killed += 1
            return f"{sess.label} pid {sess.proc.pid}"
        return None

    def restart_postgres(self) -> Optional[str]:
        return f"down {self.world.cluster.restart():.1f} s"

    def sigstop_service(self) -> Optional[str]:
        svcs = [s for s in self.world.services if s.alive() and s.stopped_until < time.time()]
        if not svcs:
            return None
        svc = self.rng.choice(svcs)
        pid = svc.proc.pid
        if not _kill(pid, signal.SIGSTOP):
            return None
        svc.stopped_until = time.time() + STOP_S
        self._later(STOP_S, _kill, pid, signal.SIGCONT)
        return f"{svc.home.name} pid {pid} for {STOP_S:.0f} s"

    def full_disk(self) -> Optional[str]:
        if self._disk_full:
            return None
        root: Path = self.world.full_disk_dir
        filler = root / "chaos-filler"
        free = shutil.disk_usage(root).free
        with open(filler, "wb") as fh:  # fill it: chunks until ENOSPC
            chunk = b"\0" * (1 << 20)
            try:
                for _ in range(free // len(chunk) + 2):
                    fh.write(chunk)
            except OSError:
                pass
        self._disk_full = True
        self.disk_held_until = time.time() + FULL_S + 15
        self._later(FULL_S, self._free_disk, filler)
        return f"{root} full for {FULL_S:.0f} s ({free / 1e6:.0f} MB filled)"

    def _free_disk(self, filler: Path) -> None:
        filler.unlink(missing_ok=True)
        self._disk_full = False
        self.disk_held_until = min(self.disk_held_until, time.time() + 15)

    def torn_checkpoint(self) -> Optional[str]:
        """A torn write beside a running hand job's newest checkpoint, then the job killed so its next attempt
        loads: the data files cut in half, with or without the `.metadata` commit file (a disk that lied)."""
        for queue, job in self.rng.sample(self._running_jobs(), len(self._running_jobs())):
            if not (job.name or "").startswith("hand-") or not job.checkpoint_dir:
                continue
            ckpt = Path(job.checkpoint_dir) / "ckpt"
            steps = sorted(p for p in ckpt.glob("step_*") if (p / ".metadata").exists()) if ckpt.exists() else []
            if not steps:
                continue
            newest = steps[-1]
            torn = ckpt / f"step_{int(newest.name.split('_')[1]) + 1:010d}"
            try:
                shutil.copytree(newest, torn)
            except (OSError, shutil.Error):
                continue
            keep_meta = self.rng.random() < 0.5
            for f in torn.iterdir():
                if f.name == ".metadata" and not keep_meta:
                    f.unlink()
                elif f.name != ".metadata":
                    size = f.stat().st_size
                    with open(f, "r+b") as fh:
                        fh.truncate(size // 2)
            leaf = job_leaf(job.pid)
            if leaf:
                _kill(leaf)
            return f"{queue} job {job.id} {torn.name} ({'metadata kept' if keep_meta else 'no metadata'})"
        return None
