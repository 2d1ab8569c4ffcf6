"""A slow shared volume for tests and benchmarks: a read-only FUSE passthrough (mfusepy, libfuse3).

It mirrors a local directory and behaves like network storage: every open waits `open_latency` seconds,
reads share one token bucket capped at `bandwidth` bytes/s, and reads can be made to fail with EIO (the
first N reads of each file) to exercise retries. The daemon runs in its own process, so a test can kill
it (kill -9) to simulate a volume that drops away, and so libfuse's signal handlers never touch pytest.

    with SlowVolume(src_dir, mount_dir, open_latency=0.005) as vol:
        ...                       # read files under vol.mountpoint
        vol.stats()               # {"opens": ..., "opens_by_path": {...}, "bytes_read": ..., ...}
        vol.configure(fail_reads=1)

Stats are served by a hidden virtual file (`/.slowfs_stats`, not listed); settings are changed through a
JSON control file outside the mount that the daemon re-reads when it changes.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STATS_NAME = ".slowfs_stats"


def fuse_unavailable_reason() -> str | None:
    """Why a FUSE volume cannot be mounted here, or None when it can (the reason reads well in a skip)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this container); install fuse3 and run with /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401  (loads libfuse through ctypes; fails where the library is missing)
    except (ImportError, OSError, EnvironmentError) as exc:
        return f"mfusepy/libfuse unavailable: {exc}"
    return None


def _operations_class():
    # mfusepy loads libfuse at import time; keep that out of module import so the skip reason above works.
    import mfusepy
    from mfusepy import FuseOSError, Operations

    class SlowPassthrough(Operations):
        """Read-only passthrough that adds per-open latency, a bandwidth cap and injected read errors."""

        use_ns = True

        def __init__(self, root: str, open_latency: float, bandwidth: float, ctl: str | None):
            self.root = os.path.realpath(root)
            self.open_latency = open_latency
            self.bandwidth = bandwidth  # bytes per second for all readers together; 0 means no cap
            self.fail_reads = 0
            self.ctl = ctl
            self._ctl_mtime = None
            self._lock = threading.Lock()
            self._next_free = 0.0
            self._failed: dict[str, int] = {}
            self.opens_by_path: dict[str, int] = {}
            self.opens = 0
            self.reads = 0  # read requests served (the kernel splits a reader's reads into requests of its own)
            self.bytes_read = 0
            self.errors_injected = 0
            self.inflight = self.max_inflight = 0  # opens waiting on the "network" at once
            self._stats_fh = 1 << 40  # never a real fd

        def _full(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _reload_ctl(self) -> None:
            if not self.ctl:
                return
            try:
                mtime = os.stat(self.ctl).st_mtime_ns
            except FileNotFoundError:
                return
            if mtime == self._ctl_mtime:
                return
            with open(self.ctl) as fh:
                cfg = json.load(fh)
            with self._lock:
                self._ctl_mtime = mtime
                self.open_latency = float(cfg.get("open_latency", self.open_latency))
                self.bandwidth = float(cfg.get("bandwidth", self.bandwidth))
                if "fail_reads" in cfg:
                    self.fail_reads = int(cfg["fail_reads"])
                    self._failed.clear()

        def getattr(self, path, fh=None):
            if path == "/" + STATS_NAME:
                now = time.time_ns()
                return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": 0,
                        "st_mtime": now, "st_atime": now, "st_ctime": now}
            try:
                st = os.lstat(self._full(path))
            except OSError as exc:
                raise FuseOSError(exc.errno) from None
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime_ns", "st_mtime_ns",
                    "st_ctime_ns")
            return {k.replace("_ns", ""): getattr(st, k) for k in keys}

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._full(path))

        def readlink(self, path):
            return os.readlink(self._full(path))

        def statfs(self, path):
            sv = os.statvfs(self._full(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                 "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        def open(self, path, fi):
            if path == "/" + STATS_NAME:
                fi.fh = self._stats_fh
                fi.direct_io = 1  # size 0 in getattr; direct_io makes the kernel ask us anyway
                return 0
            if fi.flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC):
                raise FuseOSError(errno.EROFS)
            self._reload_ctl()
            with self._lock:
                self.inflight += 1
                self.max_inflight = max(self.max_inflight, self.inflight)
            time.sleep(self.open_latency)  # the round trip to the storage server
            with self._lock:
                self.inflight -= 1
            try:
                fi.fh = os.open(self._full(path), os.O_RDONLY)
            except OSError as exc:
                raise FuseOSError(exc.errno) from None
            with self._lock:
                self.opens += 1
                self.opens_by_path[path] = self.opens_by_path.get(path, 0) + 1
            return 0

        def read(self, path, size, offset, fi):
            if fi.fh == self._stats_fh:
                with self._lock:
                    blob = json.dumps({"opens": self.opens, "opens_by_path": self.opens_by_path,
                                       "bytes_read": self.bytes_read,
                                       "errors_injected": self.errors_injected,
                                       "max_inflight": self.max_inflight, "reads": self.reads}).encode()
                return blob[offset:offset + size]
            with self._lock:
                if self._failed.get(path, 0) < self.fail_reads:
                    self._failed[path] = self._failed.get(path, 0) + 1
                    self.errors_injected += 1
                    raise FuseOSError(errno.EIO)
            data = os.pread(fi.fh, size, offset)
            if self.bandwidth > 0 and data:
                with self._lock:
                    start = max(self._next_free, time.monotonic())
                    self._next_free = start + len(data) / self.bandwidth
                    wake = self._next_free
                delay = wake - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            with self._lock:
                self.bytes_read += len(data)
                self.reads += 1
            return data

        def release(self, path, fi):
            if fi.fh != self._stats_fh:
                os.close(fi.fh)
            return 0

    return mfusepy, SlowPassthrough


class SlowVolume:
    """A mounted slow volume over `source`, served by a daemon process; a context manager that unmounts."""

    def __init__(self, source: str | os.PathLike, mountpoint: str | os.PathLike, *, open_latency: float = 0.005,
                 bandwidth: float = 0, fail_reads: int = 0, start_timeout: float = 15.0,
                 readahead_kb: int | None = None):
        """`readahead_kb`: the mount's readahead window (the largest read the kernel asks the daemon for at once;
        FUSE's default is 128 KiB, where a network filesystem reads 1 MiB or more per request); None keeps the
        kernel's. Setting it needs root (it is the mount's `/sys/class/bdi/MAJOR:MINOR/read_ahead_kb`)."""
        reason = fuse_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.source = Path(source)
        self.mountpoint = Path(mountpoint)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._ctl = Path(tempfile.mkdtemp(prefix="slowfs-ctl-")) / "ctl.json"
        self._settings = {"open_latency": open_latency, "bandwidth": bandwidth, "fail_reads": fail_reads}
        self._write_ctl()
        cmd = [sys.executable, os.path.abspath(__file__), str(self.source), str(self.mountpoint),
               "--ctl", str(self._ctl)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while not os.path.ismount(self.mountpoint):
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"slowfs exited with {self._proc.returncode}: {err.strip()[-2000:]}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"slowfs did not mount {self.mountpoint} within {start_timeout}s")
            time.sleep(0.02)
        if readahead_kb is not None:
            dev = os.stat(self.mountpoint).st_dev
            try:
                Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").write_text(str(readahead_kb))
            except OSError as exc:
                self.close()
                raise RuntimeError(f"cannot set the readahead of {self.mountpoint}: {exc}") from None

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self._proc.pid

    def _write_ctl(self) -> None:
        tmp = self._ctl.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._settings))
        os.replace(tmp, self._ctl)
        # A second change within the mtime granularity must still be seen; bump mtime explicitly.
        os.utime(self._ctl, ns=(time.time_ns(), time.time_ns()))

    def configure(self, **settings: float) -> None:
        """Change open_latency, bandwidth or fail_reads; takes effect on the next open.

        fail_reads=N fails the first N reads of each file with EIO. The kernel retries a failed read once
        on its own, so a reader sees about N/2 errors per file.
        """
        self._settings.update(settings)
        self._write_ctl()

    def stats(self) -> dict:
        """Counters since mount: opens, opens_by_path ('/rel/path' keys), bytes_read, errors_injected,
        max_inflight (most opens in progress at once: the concurrency a reader achieved), reads (read requests
        served: the kernel asks for at most the mount's readahead window at once)."""
        with open(self.mountpoint / STATS_NAME, "rb") as fh:
            return json.loads(fh.read())

    def kill(self) -> None:
        """Kill the daemon with SIGKILL, as when a network volume drops away; the mount then fails (ENOTCONN)."""
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def close(self) -> None:
        """Unmount (lazily if still busy) and stop the daemon."""
        if os.path.ismount(self.mountpoint) or self._proc.poll() is not None:
            for args in (["-u"], ["-u", "-z"]):
                done = subprocess.run(["fusermount3", *args, str(self.mountpoint)], capture_output=True)
                if done.returncode == 0:
                    break
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        if self._proc.stderr:
            self._proc.stderr.close()
        shutil.rmtree(self._ctl.parent, ignore_errors=True)

    def __enter__(self) -> "SlowVolume":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    """Run the daemon in the foreground: `python slowfs.py SOURCE MOUNTPOINT [--ctl FILE]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--ctl", default=None, help="JSON settings file, re-read when it changes")
    parser.add_argument("--open-latency", type=float, default=0.005)
    parser.add_argument("--bandwidth", type=float, default=0.0, help="bytes/s for all readers; 0: no cap")
    args = parser.parse_args(argv)
    mfusepy, ops_cls = _operations_class()
    ops = ops_cls(args.source, args.open_latency, args.bandwidth, args.ctl)
    ops._reload_ctl()
    mfusepy.FUSE(ops, args.mountpoint, raw_fi=True, foreground=True, nothreads=False, ro=True,
                 fsname="slowfs")


if __name__ == "__main__":
    main()
