"""The warm pool: a process with torch and the runtime imported, from which the local executor forks attempts.

A short trial spends most of its start importing torch and the runtime, and every attempt of every trial pays
it again. This process pays it once (`PRELOAD`: no CUDA context, no thread of its own) and then forks each
attempt it is asked for, so the attempt starts with those modules already in memory (copy-on-write).

The protocol is the spawner's (`executors.local.spawner`): one JSON request a line on stdin, one answer a line
on stdout (`{"pid", "start"}` or `{"error"}`), in order; stdin closing ends the pool and leaves its attempts
running. Once the imports are done the pool writes its ready file (its pid and the files it imported, so the
executor can tell when they changed).

Each request forks twice, so that the attempt is the same two processes the cold wrapper makes:
- the first child is the wrapper's twin: a session of its own, the attempt's cgroup, the log on stdout and
  stderr, /dev/null on stdin, the wrapper's environment (also in /proc: that is how a restarted service
  finds it), the job's folder; it ignores SIGTERM/SIGINT like the wrapper's `trap :`, waits for the job,
  records its exit code in the exit file (128+N for a signal, as the shell writes it) and exits with it;
- the second child is the job: the signal dispositions and mask Python starts with, the job's environment
  (os.environ and /proc), `sys.argv`, `sys.path[0]` and a fresh `__main__` as `python -m MOD`/`python
  FILE` would set them, its own random state; it runs at the top level of this module's `__main__`, so the
  interpreter ends it as it ends any script (SystemExit, a traceback and 1, atexit, non-daemon threads).
Which attempts may start here is the executor's call (`executors.local.warmstart`).
"""

from __future__ import annotations

import sys

_AT_START = frozenset(sys.modules)  # what the interpreter had imported before this module's work

import importlib
import json
import os
import signal
import types
from typing import NoReturn, Optional

from orchestrator.executors.local import serveloop
from orchestrator.executors.local.procs import start_time

# What a job of this environment imports first: torch, the runtime, and MLflow's client (its metrics and params;
# pandas and pyarrow come with it, the largest part of a warm trial's start without it: benchmarks/RESULTS.md).
PRELOAD = ("numpy", "torch", "torch.nn", "torch.nn.functional", "torch.optim", "torch.utils.data",
           "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch._dynamo",  # (an optimizer's constructor imports it: most of a warm trial's start without it)
           "PIL.Image", "PIL.PngImagePlugin", "runtime.context", "runtime.checkpoint", "runtime.data",
           "runtime.data.loader", "runtime.devices", "mlflow.tracking", "mlflow.entities",
           # a job's first MlflowClient builds its store: SQLAlchemy, its SQLite dialect and alembic's schema check
           "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.tracking.sqlalchemy_workspace_store",
           "mlflow.store.db.utils", "alembic.command", "alembic.config",
           "alembic.runtime.migration", "alembic.script", "sqlalchemy.dialects.sqlite")
# pyarrow's allocator (jemalloc) starts a background thread when it loads; the pool is started with it off
# (`pool_environ`), so that it forks with no thread of its own but the interpreter's.
ALLOCATOR_VAR = "JE_ARROW_MALLOC_CONF"
NO_BACKGROUND = "background_thread:false"
PRELOAD_VAR = "AUTORESEARCH_WARM_PRELOAD"  # another list (comma-separated), e.g. a small one for tests
PAD_VAR = "AUTORESEARCH_WARM_PAD"  # room in the pool's /proc environ for an attempt's environment
PAD_BYTES = 96 * 1024
EXIT_FILE_VAR = "AUTORESEARCH_EXIT_FILE"  # (executors.local.watch's: this module imports only the standard library)
CGROUP_VAR = "AUTORESEARCH_CGROUP"
_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]
_STARTED_WITH = {s: signal.getsignal(s) for s in _SIGNALS}  # the dispositions a fresh interpreter has
# but SIGINT: the cold wrapper starts every job with it at its default (`spawner.DEFAULT_SIGNALS`), which Python
# makes KeyboardInterrupt, even when the service was started ignoring it (a shell's background job does)
_STARTED_WITH[signal.SIGINT] = signal.default_int_handler


def environ_bytes(env: dict[str, str]) -> bytes:
    """`env` as the kernel keeps an environment (`K=V\\0` each)."""
    return b"".join(f"{k}={v}".encode("utf-8", "surrogateescape") + b"\0" for k, v in env.items())


def _show_environ(env: dict[str, str]) -> None:
    """Make /proc/self/environ show `env` (the pool was started with room for it: `PAD_VAR`)."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51 of stat)
    blob = environ_bytes(env)
    if len(blob) >= end - start:
        raise OSError("the environment does not fit in the pool's")
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(blob + b"\0" * (end - start - len(blob)))


STARTED_WARM = False  # True in a job forked from the pool (its own warm children: executors.scriptjob)


class Become(BaseException):
    """Raised in a forked job's process with what it runs (`{"warm": python_target}`) and its environment: it
    unwinds the caller's stack, so that the job runs at the top level (`run`), as a script's code does."""

    def __init__(self, request: dict, env: dict[str, str]):
        super().__init__()
        self.request, self.env = request, env

    def run(self) -> None:
        """Set the process up as `python -m MOD ARGS` or `python FILE ARGS` would, and run the job."""
        global STARTED_WARM
        STARTED_WARM = True
        for sig, handler in _STARTED_WITH.items():
            try:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            except (OSError, ValueError, TypeError):
                pass
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.environ.clear()
        os.environ.update(self.env)
        _show_environ(self.env)
        apply_threads(self.env)
        warm = self.request["warm"]
        head = ["-m", warm["module"]] if "module" in warm else [warm["script"]]
        sys.orig_argv = [sys.executable, *head, *warm["args"]]
        importlib.invalidate_caches()
        if "numpy.random" in sys.modules:  # (`random` reseeds itself in a forked child; numpy does not)
            sys.modules["numpy.random"].seed()
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        if "module" in warm:
            import runpy

            sys.path[0] = os.getcwd()
            sys.argv = [warm["module"], *warm["args"]]  # runpy writes the module's file into argv[0]
            runpy._run_module_as_main(warm["module"], alter_argv=True)  # what `python -m` calls
            return
        from importlib.machinery import SourceFileLoader

        path = warm["script"]
        sys.path[0] = os.path.dirname(os.path.realpath(path))
        sys.argv = [path, *warm["args"]]
        main.__dict__.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path),
                             __builtins__=__builtins__)
        with open(path, "rb") as fh:
            code = compile(fh.read(), path, "exec")
        exec(code, main.__dict__)


def apply_threads(env: dict[str, str]) -> None:
    """Size torch's intra-op threads (and MKL's, through it) as OMP_NUM_THREADS in `env` says: the pool's
    libraries read their thread counts when they loaded, from the pool's environment, not the job's."""
    torch = sys.modules.get("torch")
    value = env.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _attempt(request: dict, log_fd: int, devnull: int, own: list) -> NoReturn:
    """The first child: the wrapper's twin (see the module's docstring). Raises `Become` in the job."""
    code = 127
    try:
        signal.set_wakeup_fd(-1)
        for thing in own:  # the pool's selector and pipes: the attempt has 0, 1 and 2 only
            thing.close() if hasattr(thing, "close") else os.close(thing)
        os.setsid()
        env = request["env"]
        cgroup = env.get(CGROUP_VAR)
        if cgroup:
            try:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as fh:
                    fh.write(str(os.getpid()))
            except OSError:
                pass  # (as the wrapper: the psutil tracking covers it)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(devnull)
        _show_environ(env)
        try:
            os.chdir(request["cwd"])
        except OSError as exc:
            os.write(2, f"autoresearch-job: cd: {request['cwd']}: {exc.strerror}\n".encode())
            os._exit(126)
        exit_file = env[EXIT_FILE_VAR]
        job_env = {k: v for k, v in env.items() if k not in (EXIT_FILE_VAR, CGROUP_VAR)}
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the wrapper's `trap :`: outlive the stop to record the code
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        pid = os.fork()
        if pid == 0:
            raise Become(request, job_env)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
        with open(exit_file, "w") as fh:
            fh.write(str(code))
    except Become:
        raise
    except BaseException as exc:  # (nothing of the pool's may run on in a child)
        try:
            os.write(2, f"autoresearch-job: warm start failed: {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
    os._exit(code)


def _spawn(request: dict, devnull: int, own: list) -> dict:
    """Fork one attempt; its wrapper's pid and start time, or why it did not start."""
    fd = -1
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.write(fd, request["header"].encode())
        pid = os.fork()
    except (OSError, KeyError, TypeError, ValueError) as exc:
        if fd >= 0:
            os.close(fd)
        return {"error": f"{type(exc).__name__}: {exc}"}
    if pid == 0:
        _attempt(request, fd, devnull, own)  # (never returns: it exits, or raises Become in the job)
    os.close(fd)
    return {"pid": pid, "start": start_time(pid)}


def pool_environ(env: dict[str, str]) -> dict[str, str]:
    """The pool's own environment: the service's, with pyarrow's allocator told to start no thread."""
    conf = env.get(ALLOCATOR_VAR, "")
    return {**env, ALLOCATOR_VAR: f"{conf},{NO_BACKGROUND}" if conf else NO_BACKGROUND}


def threads() -> list[str]:
    """The names of this process's threads (the main one first)."""
    tasks = sorted(os.listdir("/proc/self/task"), key=lambda t: (t != str(os.getpid()), int(t)))
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:  # it ended
            pass
    return names


def preload(names=PRELOAD) -> list[str]:
    """Import `names` (those that fail are left to the job); the files of this environment they loaded that
    a change would make stale: the project's own modules (outside the installed packages, whose changes
    show in their folders' times)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    installed = tuple(p for p in sys.path if p.endswith("-packages")) + (sys.prefix, sys.base_prefix)
    files = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and os.path.isabs(path) and path.endswith(".py") and not path.startswith(installed):
            files.append(path)
    return sorted(files)


def cuda_driver() -> dict[str, Optional[bool]]:
    """Whether this process has the CUDA driver library loaded, and whether the driver was initialised in it
    (`cuInit`: what opens /dev/nvidia* and makes a fork unsafe for CUDA). A CUDA build of torch may map
    libcuda.so at import without initialising it; that is safe to fork, since each child initialises the driver
    itself. Asked of the copy already loaded (RTLD_NOLOAD: never loads one): `cuDeviceGetCount` answers
    CUDA_ERROR_NOT_INITIALIZED (3) until `cuInit` has run, and initialises nothing. None: loaded, state unknown."""
    try:
        with open("/proc/self/maps") as fh:
            if "libcuda.so" not in fh.read():
                return {"loaded": False, "initialised": False}
    except OSError:
        return {"loaded": None, "initialised": None}
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        count = ctypes.c_int(0)
        return {"loaded": True, "initialised": lib.cuDeviceGetCount(ctypes.byref(count)) != 3}
    except (OSError, AttributeError):
        return {"loaded": True, "initialised": None}


def imported() -> dict[str, Optional[str]]:
    """The top-level modules imported here beyond the interpreter's own start-up, with their files."""
    return {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())
            if "." not in name and name not in _AT_START}


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def main(ready_file: Optional[str] = None) -> None:
    """The pool: preload, write the ready file, then fork what stdin asks for until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C at the service's terminal is the service's to handle
    sys.modules.setdefault("orchestrator.executors.local.warmpool", sys.modules["__main__"])  # (one Become)
    names = os.environ.get(PRELOAD_VAR)
    files = preload([n for n in names.split(",") if n] if names is not None else PRELOAD)
    if ready_file:
        _write_json(ready_file, {"pid": os.getpid(), "files": files, "modules": imported(), "threads": threads(),
                                 "cuda": cuda_driver(),
                                 "dirs": [p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)]})
    serveloop.serve(_spawn)

if __name__ == "__main__":
    _job: Optional[Become] = None
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else None)
    except Become as become:
        _job = become.with_traceback(None)  # (the pool's frames: nothing of them is the job's)
    if _job is not None:  # outside the handler: the job's own exceptions have no pool context
        _job.run()
