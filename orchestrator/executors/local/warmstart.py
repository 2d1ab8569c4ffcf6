"""Warm starts: which attempts the local executor forks from its warm pool, and its handle on the pool.

An attempt starts warm (`executors.local.warmpool`) when the pool can make it exactly what the cold wrapper
would: its command is this environment's Python running a module (`python -m MOD ...`) or a file (`python
FILE ...`) with no interpreter options; the pool is ready and its imports are still current (no file it
imported changed and no package was installed or removed since); the job's environment agrees with the
pool's on every variable a library reads when it loads (`LOAD_TIME`: PYTHON*, LD_*, the thread-pool and
locale ones); and the job's first `sys.path` entry does not hold a different copy of a module the pool
imported. Anything else starts cold, with the reason: another interpreter or a shell command, a container
image, torchrun (a job on several devices), a changed environment. The pool itself starts with the first
attempt that could use it (that attempt starts cold), so a service that never runs Python jobs never pays
for it. `AUTORESEARCH_WARM=0` turns warm starts off.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

from orchestrator.executors.local.spawner import Spawner
from orchestrator.executors.local.warmpool import PAD_BYTES, PAD_VAR, environ_bytes, pool_environ
from runtime.protocol import THREAD_VARS

# Environment variables read when a library loads (the interpreter, the dynamic linker, OpenMP, BLAS, the
# allocators, the locale, torch): a forked job has the pool's values of these, so a job that sets them
# otherwise starts cold. CUDA's are read when the job first uses a device, in the job: not listed.
LOAD_TIME = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMEXPR_", "MALLOC_", "JE_",
             "LANG", "LC_", "TORCH", "PYTORCH_")
WARM, COLD = "warm", "cold"
_PYTHON_NAME = re.compile(r"python[0-9.]*$")


def python_target(argv: list[str], env: dict[str, str]) -> tuple[Optional[dict], str]:
    """What the pool runs for `argv`: `{"module": M, "args": [...]}` or `{"script": FILE, "args": [...]}`
    when it is this environment's Python run plainly; else None and why not."""
    if not argv:
        return None, "no command"
    exe = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if exe is None or not _PYTHON_NAME.match(os.path.basename(exe)):
        return None, f"{os.path.basename(argv[0])} is not a Python interpreter"
    # This environment's: the same bin folder (a venv's python is a link to the base one: not resolved).
    if Path(os.path.abspath(exe)).parent.resolve() != Path(os.path.abspath(sys.executable)).parent.resolve():
        return None, f"{exe} is another interpreter than this environment's ({sys.executable})"
    if len(argv) >= 3 and argv[1] == "-m":
        return {"module": argv[2], "args": argv[3:]}, ""
    if len(argv) >= 2 and not argv[1].startswith("-"):
        return {"script": argv[1], "args": argv[2:]}, ""
    return None, f"interpreter options ({' '.join(argv[1:2]) or 'none: an interactive interpreter'})"


def load_time_differences(job_env: dict[str, str], pool_env: dict[str, str]) -> list[str]:
    """The `LOAD_TIME` variables whose values differ between the job's environment and the pool's, but for the
    thread counts a forked job applies itself (`warmpool.apply_threads`)."""
    keys = {k for k in (*job_env, *pool_env) if k.startswith(LOAD_TIME) and k != PAD_VAR and k not in THREAD_VARS}
    return sorted(k for k in keys if job_env.get(k) != pool_env.get(k))


def first_path(target: dict, cwd: str) -> str:
    """The job's first `sys.path` entry: its folder for a module, the file's (links resolved) for a file."""
    return cwd if "module" in target else os.path.dirname(os.path.realpath(os.path.join(cwd, target["script"])))


def shadowed(folder: str, modules: dict[str, Optional[str]]) -> str:
    """An entry of `folder` (a job's first sys.path entry) that is another copy of one of `modules` (imported
    ones and their files), or ""."""
    try:
        names = os.listdir(folder)
    except OSError:
        return ""
    for entry in names:
        name = entry[:-3] if entry.endswith(".py") else entry
        if name not in modules:
            continue
        mine = os.path.join(folder, entry)
        theirs = modules[name]
        if theirs is not None and not os.path.realpath(theirs).startswith(os.path.realpath(mine)):
            return entry
    return ""


class WarmPool:
    """The executor's warm pool process (one, started on first use): `plan` says whether an attempt can
    start there, `spawn_many` starts those that can (the spawner's protocol)."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._spawner: Optional[Spawner] = None
        self._env: dict[str, str] = {}
        self._ready_file = self.run_dir / f"warmpool-{os.getpid()}.json"
        self._ready: Optional[dict] = None
        self._started_at = 0.0

    @property
    def pid(self) -> Optional[int]:
        """The pool process's pid once it is ready."""
        return self._ready["pid"] if self._ready else None

    def start(self) -> None:
        """Start the pool process (it imports for a few seconds, then writes its ready file)."""
        self.close()
        self._ready_file.unlink(missing_ok=True)
        self._env = dict(os.environ)
        env = {**pool_environ(self._env), PAD_VAR: "x" * PAD_BYTES}  # (jobs are compared with the service's)
        self._started_at = time.time()
        self._spawner = Spawner(1, argv=[sys.executable, "-m", "orchestrator.executors.local.warmpool",
                                         str(self._ready_file)], env=env, cwd="/")
        self._spawner.start()

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Start the pool if it is not running and wait until it can take attempts (benchmarks, tests)."""
        deadline = time.monotonic() + timeout
        while self._state():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _state(self) -> str:
        """"" when the pool is ready and current, else why not (starting it, or again, when that helps)."""
        if self._spawner is None or not self._spawner.alive(0):
            self.start()
            return "the warm pool is starting"
        if self._ready is None:
            try:
                self._ready = json.loads(self._ready_file.read_text())
            except (OSError, ValueError):
                return "the warm pool is starting"
        if self._stale():
            self.start()
            return "the environment changed since the warm pool started"
        if (self._ready.get("cuda") or {}).get("initialised"):
            return "the CUDA driver is initialised in the warm pool (a fork of it could not use CUDA)"
        return ""

    def _stale(self) -> bool:
        """Whether a file the pool imported, or a folder of installed packages, changed since it started."""
        for path in [*self._ready["files"], *self._ready["dirs"]]:
            try:
                if os.stat(path).st_mtime > self._started_at:
                    return True
            except OSError:
                return True
        return False

    def plan(self, argv: list[str], env: dict[str, str], cwd: str, *, image: bool = False,
             gpus: int = 1) -> tuple[Optional[dict], str]:
        """What the pool would run for this attempt, or None and why it starts cold."""
        if not self.enabled:
            return None, "warm starts are off (AUTORESEARCH_WARM=0)"
        if image:
            return None, "a container image"
        if gpus > 1:
            return None, f"torchrun ({gpus} devices)"
        target, why = python_target(argv, env)
        if target is None:
            return None, why
        differ = load_time_differences(env, self._env or dict(os.environ))
        if differ:
            return None, f"its environment sets {', '.join(differ[:3])} otherwise than the warm pool's"
        if len(environ_bytes(env)) >= PAD_BYTES:
            return None, "its environment is larger than the warm pool has room for"
        why = self._state()
        if why:
            return None, why
        first = first_path(target, cwd)
        shadow = shadowed(first, self._ready["modules"])
        if shadow:
            return None, f"{shadow} in {first} is not the warm pool's"
        return target, ""

    def spawn_many(self, requests: list[dict]) -> list:
        """Start the requests in the pool (the spawner's answers: (pid, start) or an OSError each)."""
        if self._spawner is None:
            return [OSError("the warm pool is not running")] * len(requests)
        return self._spawner.spawn_many(requests)

    def close(self) -> None:
        """Stop the pool process (the attempts it started keep running)."""
        spawner, self._spawner, self._ready = self._spawner, None, None
        if spawner is not None:
            spawner.close()
        self._ready_file.unlink(missing_ok=True)
