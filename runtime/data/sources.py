"""Where a volume's files live: a local or FUSE-mounted directory (`LocalSource`, plain syscalls) or any fsspec
URL (`FsspecSource`: s3://, gs://, memory://, ...). Each lists its files with a version (mtime or etag), so a
cached copy is known to be current, and copies one file into an open descriptor."""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Callable, TypeVar

from runtime.errors import VolumeError


@dataclass(frozen=True)
class FileInfo:
    """One file of the volume: path relative to the source, size, and a version (mtime or etag)."""

    rel: str
    size: int
    version: str


T, R = TypeVar("T"), TypeVar("R")
SLOW_CALL_S = 0.002  # a filesystem call slower than this is a round trip: the rest of a listing runs in parallel


class _Calls:
    """Runs a listing's filesystem calls in order while they are fast, and on a thread pool (started then) from
    the first one that is slow (a network or FUSE round trip)."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        out: list[R] = []
        for i, item in enumerate(items):
            if self._pool is not None:
                return out + list(self._pool.map(fn, items[i:]))
            t0 = time.perf_counter()
            out.append(fn(item))
            if time.perf_counter() - t0 > SLOW_CALL_S and self.threads > 1:
                self._pool = ThreadPoolExecutor(self.threads)
        return out

    def __enter__(self) -> "_Calls":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class LocalSource:
    """A local or FUSE-mounted directory, read with plain syscalls (sendfile: no copy through Python)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self._sequential: bool | None = None  # whether reads tell the kernel they are sequential (_open)

    def _open(self, rel: str) -> int:
        """A descriptor for reading `rel` from start to end. Where the volume's readahead window is under
        1 MiB, the kernel is told the read is sequential (POSIX_FADV_SEQUENTIAL, as `cp` does) and doubles the
        window for it: a FUSE or network volume is asked for twice as much per request (256 KiB where FUSE's
        default is 128 KiB), half the round trips. At 1 MiB requests are already as large as such volumes take,
        and a doubled window only puts more readahead in flight (measured slower there)."""
        if self._sequential is None:
            window = readahead_kb(self.root)
            self._sequential = window is None or window < 1024
        fd = os.open(os.path.join(self.root, rel), os.O_RDONLY | os.O_CLOEXEC)
        if self._sequential:
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass  # no such hint on this system or filesystem: the same reads, in the window's requests
        return fd

    def uid(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def list(self, pattern: str, threads: int) -> list[FileInfo]:
        def stat_or_none(rel: str) -> os.stat_result | None:
            try:
                return os.stat(os.path.join(self.root, rel))
            except FileNotFoundError:
                return None  # removed while we listed

        try:
            if not os.path.isdir(self.root):
                os.stat(self.root)  # raises the precise reason (missing, dead mount) when there is one
                raise NotADirectoryError(20, "not a directory")
            found, level, seen = {}, [""], set()
            # A stat is a round trip on network storage, and scandir cannot always tell a file from a
            # directory without one: stat every entry, one directory level at a time, in parallel once a
            # call shows the storage is slow (on a local disk the pool's hand-offs cost 100x the stats).
            with _Calls(threads) as calls:
                while level:
                    listings = calls.map(lambda d: os.listdir(os.path.join(self.root, d)), level)
                    names = [os.path.join(d, n) if d else n for d, names in zip(level, listings) for n in names]
                    level = []
                    for rel, st in zip(names, calls.map(stat_or_none, names)):
                        if st is None:
                            continue
                        if stat.S_ISDIR(st.st_mode):
                            if (st.st_dev, st.st_ino) not in seen:  # a symlink loop is walked once
                                seen.add((st.st_dev, st.st_ino))
                                level.append(rel)
                        elif stat.S_ISREG(st.st_mode) and fnmatch.fnmatchcase(rel, pattern):
                            found[rel] = st
        except FileNotFoundError:
            raise VolumeError(f"data volume not found: {self.root}") from None
        except OSError as exc:
            raise VolumeError(f"data volume {self.root} is unreadable: {exc.strerror or exc}") from None
        return [FileInfo(r, found[r].st_size, str(found[r].st_mtime_ns)) for r in sorted(found)]

    def open(self, rel: str) -> BinaryIO:
        """The file for reading (unbuffered: callers read large blocks)."""
        return open(self._open(rel), "rb", buffering=0)

    def copy_ranges(self, rel: str, fd: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Copy byte ranges (offset, size) of a file to the same offsets of `fd`, with one open of the file (an open
        is a round trip on network storage), in the kernel (sendfile, no copy through Python), each range then
        read back from the page cache for its CRC-32; returns (bytes copied, their CRC-32) for each range, up to
        and including the first one the file cuts short."""
        src = self._open(rel)
        try:
            try:
                # A descriptor of our own on the same file: its position is ours, whatever other threads do with `fd`.
                out = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                return _copy_ranges_by_reads(open(src, "rb", buffering=0, closefd=False), fd, ranges)
            try:
                results: list[tuple[int, int]] = []
                for offset, size in ranges:
                    got = _sendfile_range(src, out, offset, size)
                    results.append((got, _crc_of_range(fd, offset, got)))
                    if got < size:
                        break
                return results
            finally:
                os.close(out)
        finally:
            os.close(src)

    def copy(self, rel: str, fd: int) -> None:
        src = self._open(rel)
        try:
            while os.sendfile(fd, src, None, 1 << 22):
                pass
        finally:
            os.close(src)


class FsspecSource:
    """Any fsspec URL (s3://, gs://, file://, memory://, ...); the version is the etag when there is one."""

    def __init__(self, url: str):
        import fsspec

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")

    def uid(self, rel: str) -> str:
        return self.fs.unstrip_protocol(f"{self.root}/{rel}")

    def list(self, pattern: str, threads: int) -> list[FileInfo]:
        try:
            if not self.fs.isdir(self.root):
                raise VolumeError(f"data volume not found: {self.url}")
            found = self.fs.find(self.root, detail=True, withdirs=False)
        except OSError as exc:
            raise VolumeError(f"data volume {self.url} is unreadable: {exc}") from None
        out = []
        for path, info in sorted(found.items()):
            rel = path[len(self.root):].lstrip("/")
            if fnmatch.fnmatchcase(rel, pattern):
                version = next((str(info[k]) for k in ("ETag", "etag", "mtime", "LastModified", "created")
                                if info.get(k) is not None), "")
                out.append(FileInfo(rel, int(info["size"]), version))
        return out

    def open(self, rel: str) -> BinaryIO:
        """The file for reading."""
        return self.fs.open(f"{self.root}/{rel}", "rb")

    def copy_ranges(self, rel: str, fd: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Copy byte ranges (offset, size) of a file to the same offsets of `fd`, with one open of the file, each
        range's CRC-32 taken as its blocks pass; (bytes copied, CRC-32) for each range, as LocalSource's."""
        return _copy_ranges_by_reads(self.open(rel), fd, ranges)

    def copy(self, rel: str, fd: int) -> None:
        with self.fs.open(f"{self.root}/{rel}", "rb") as src, open(fd, "wb", closefd=False) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)


_BLOCK = 4 << 20


def readahead_kb(path: str) -> int | None:
    """The readahead window, in KiB, of the filesystem `path` lies on (its backing device's read_ahead_kb: a
    FUSE or NFS mount has its own), or None where it cannot be read (a disk partition, which shares its disk's
    entry, or no sysfs)."""
    try:
        dev = os.stat(path).st_dev
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def _sendfile_range(src: int, out: int, offset: int, size: int) -> int:
    os.lseek(out, offset, os.SEEK_SET)
    left = size
    while left > 0:
        n = os.sendfile(out, src, offset + size - left, left)
        if not n:
            break
        left -= n
    return size - left


def _crc_of_range(fd: int, offset: int, size: int) -> int:
    """CRC-32 of bytes of a local file (just written: read back from the page cache)."""
    crc, end = 0, offset + size
    while offset < end:
        block = os.pread(fd, min(_BLOCK, end - offset), offset)
        if not block:
            break
        crc = zlib.crc32(block, crc)
        offset += len(block)
    return crc


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _copy_ranges_by_reads(src: BinaryIO, fd: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    results: list[tuple[int, int]] = []
    with src:
        for offset, size in ranges:
            src.seek(offset)
            done = crc = 0
            while done < size:
                block = src.read(min(size - done, _BLOCK))
                if not block:
                    break
                crc = zlib.crc32(block, crc)
                _pwrite_all(fd, block, offset + done)
                done += len(block)
            results.append((done, crc))
            if done < size:
                break
    return results


def open_source(source: str) -> LocalSource | FsspecSource:
    """A plain path is read directly; anything with a protocol goes through fsspec."""
    return FsspecSource(source) if "://" in source else LocalSource(source)
