"""A local file cache shared by every worker and every job on a host, with no coordinator.

Layout under the cache root:
    objects/ab/<key><suffix>   complete copies; the key hashes (source id, size, version)
    tmp/<key>.<pid>.<n>.part   copies in progress; renamed into objects/ only once complete
    locks/<3 hex>.lock         striped copy locks, so two processes never copy the same file at once
    evict.lock                 one evictor at a time

Safety rests on kernel file locks (flock), which the kernel drops when a process dies, so a crash leaves
nothing to clean up but a `.part` file (removed later, once its owner pid is gone):
- a torn file is never served: bytes land in tmp/ and are renamed into place, and a hit whose size differs
  from the expected size (e.g. after power loss) counts as a miss;
- a file in use is never evicted: users hold a shared flock on the entry (a `Pin`), the evictor deletes
  only what it can lock exclusively without waiting;
- eviction is least-recently-used by mtime, which a hit refreshes.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Bounded, so a cache of millions of files does not also hold millions of lock files.
_STRIPES = 4096
# A hit refreshes the entry's mtime (its LRU age) only when older than this: saves a write per read.
_TOUCH_AFTER_S = 60.0
# Evict down to this share of the limit, so a full cache does not rescan on every insert.
_LOW_WATER = 0.9

_live_caches: "weakref.WeakSet[FileCache]" = weakref.WeakSet()


def _close_inherited_fds() -> None:
    # A forked child (a DataLoader worker) inherits the parent's lock fds; flock locks live as long as any
    # copy of the fd, so the child must drop its copies or the parent's locks would never be released.
    for cache in list(_live_caches):
        cache._drop_fds_after_fork()


os.register_at_fork(after_in_child=_close_inherited_fds)


@dataclass(frozen=True)
class CacheStats:
    """What `cache stats` reports: complete entries, their bytes, leftover partial copies, the limit."""

    root: str
    files: int
    bytes: int
    partial_files: int
    limit_bytes: int | None


class Pin:
    """A cached file held in use: it cannot be evicted until `release()` (or process exit)."""

    __slots__ = ("path", "size", "copied", "_fd", "_cache")

    def __init__(self, path: str, size: int, fd: int, cache: "FileCache", copied: bool):
        self.path, self.size, self.copied, self._fd, self._cache = path, size, copied, fd, cache

    def release(self) -> None:
        """Let the entry be evicted again. Idempotent."""
        if self._fd >= 0:
            self._cache._close(self._fd)
            self._fd = -1

    def __enter__(self) -> "Pin":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class FileCache:
    """Content cache on local disk, safe for concurrent threads, processes and jobs.

    `acquire()` returns a pinned entry, calling `fetch(fd)` to fill it on a miss. `limit_bytes` caps the
    total size of entries not in use; files in use are never evicted, so the cap may be exceeded by them.
    """

    def __init__(self, root: str | os.PathLike, limit_bytes: int | None = None):
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"cache limit must be positive, got {limit_bytes}")
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        for sub in ("objects", "tmp", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = self.bytes_copied = 0
        self._lock = threading.Lock()
        self._fds: set[int] = set()
        self._seq = itertools.count()
        self._estimate: int | None = None  # bytes of entries as last scanned plus our own inserts since
        self._added = 0  # bytes this process has inserted, ever
        _live_caches.add(self)
        self.remove_orphans()

    # -- keys and paths -------------------------------------------------------------------------------
    @staticmethod
    def key(source_id: str, size: int, version: str) -> str:
        """Entry key: changes when the source file is replaced (new size or version/mtime/etag)."""
        return hashlib.sha256(f"{source_id}\0{size}\0{version}".encode()).hexdigest()[:40]

    def entry_path(self, key: str, suffix: str = "") -> Path:
        """Where a complete entry lives (the suffix keeps the extension, for decoders that look at it)."""
        return self.root / "objects" / key[:2] / f"{key}{suffix}"

    # -- fd bookkeeping (for fork safety) --------------------------------------------------------------
    def _open(self, path: str | Path, flags: int, mode: int = 0o644) -> int:
        fd = os.open(path, flags | os.O_CLOEXEC, mode)
        with self._lock:
            self._fds.add(fd)
        return fd

    def _close(self, fd: int) -> None:
        with self._lock:
            if fd not in self._fds:
                return  # opened before a fork and already dropped here: the number may be reused now
            self._fds.discard(fd)
        os.close(fd)

    def _drop_fds_after_fork(self) -> None:
        self._lock = threading.Lock()  # the parent's lock may have been held by a thread that is gone
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = set()

    # -- lookup and fill ---------------------------------------------------------------------------------
    def _try_pin(self, path: Path, size: int) -> Pin | None:
        try:
            fd = self._open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            # The evictor may have unlinked the file between our open and our lock: check it is still there.
            if st.st_nlink == 0 or os.stat(path).st_ino != st.st_ino or st.st_size != size:
                self._close(fd)
                return None
            if time.time() - st.st_mtime > _TOUCH_AFTER_S:
                os.utime(fd)  # LRU: a hit makes the entry young again (at most once a minute: a metadata write)
            return Pin(str(path), size, fd, self, copied=False)
        except FileNotFoundError:
            self._close(fd)
            return None
        except BaseException:
            self._close(fd)
            raise

    def lookup(self, source_id: str, size: int, version: str, suffix: str) -> Pin | None:
        """The entry pinned if it is cached and complete, else None; never touches the source."""
        pin = self._try_pin(self.entry_path(self.key(source_id, size, version), suffix), size)
        if pin is not None:
            self.hits += 1
        return pin

    def acquire(self, source_id: str, size: int, version: str, suffix: str,
                fetch: Callable[[int], None]) -> Pin:
        """Return the entry for a source file, pinned; on a miss `fetch(fd)` writes the file into `fd`.

        `fetch` may be called more than once by its own retry logic; it must write from offset 0 and may
        truncate. If it raises, nothing is cached and the error propagates.
        """
        key = self.key(source_id, size, version)
        path = self.entry_path(key, suffix)
        pin = self._try_pin(path, size)
        if pin is not None:
            self.hits += 1
            return pin
        stripe = self._open(self.root / "locks" / f"{int(key[:3], 16) % _STRIPES:03x}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(stripe, fcntl.LOCK_EX)
            pin = self._try_pin(path, size)  # another process may have copied it while we waited
            if pin is not None:
                self.hits += 1
                return pin
            if path.exists():
                self._remove(path)  # a wrong-size (torn) entry; remove it if nobody holds it
            pin = self._fill(path, key, size, fetch)
        finally:
            self._close(stripe)
        self.misses += 1
        self.bytes_copied += size
        self._account(size)
        return pin

    def _fill(self, path: Path, key: str, size: int, fetch: Callable[[int], None]) -> Pin:
        tmp = self.root / "tmp" / f"{key}.{os.getpid()}.{next(self._seq)}.part"
        fd = self._open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            # Pin the inode before it becomes visible under objects/, so no evictor can take it from us.
            fcntl.flock(fd, fcntl.LOCK_SH)
            fetch(fd)
            got = os.fstat(fd).st_size
            if got != size:
                raise OSError(errno.EIO, f"copied {got} bytes, expected {size} (file changed while copying?)")
            path.parent.mkdir(exist_ok=True)
            os.rename(tmp, path)
        except BaseException:
            self._close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return Pin(str(path), size, fd, self, copied=True)

    # -- eviction -------------------------------------------------------------------------------------
    def _entries(self) -> list[tuple[int, int, str]]:
        """(mtime_ns, size, path) of every complete entry."""
        out = []
        for sub in os.scandir(self.root / "objects"):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime_ns, st.st_size, entry.path))
        return out

    def _remove(self, path: str | Path) -> bool:
        """Delete an entry unless it is in use; True if it is gone."""
        try:
            fd = self._open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._close(fd)
            return False
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except FileNotFoundError:
            pass
        finally:
            self._close(fd)
        return True

    def _account(self, added: int) -> None:
        if self.limit_bytes is None:
            return
        with self._lock:
            if self._estimate is None:
                self._estimate = sum(size for _, size, _ in self._entries())
            else:
                self._estimate += added
            self._added += added
            over = self._estimate > self.limit_bytes
        if over:
            self.evict(int(self.limit_bytes * _LOW_WATER))

    def evict(self, target_bytes: int) -> int:
        """Remove least-recently-used entries not in use until at most `target_bytes` remain.

        Returns the bytes remaining. If another process is evicting right now, returns without waiting.
        """
        lock = self._open(self.root / "evict.lock", os.O_RDWR | os.O_CREAT)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return self._estimate or 0
            with self._lock:
                added_before = self._added
            entries = sorted(self._entries())
            total = sum(size for _, size, _ in entries)
            for _, size, path in entries:
                if total <= target_bytes:
                    break
                if self._remove(path):
                    total -= size
            with self._lock:
                # Copies finished by other threads during the scan may or may not be in it: count them.
                self._estimate = total + self._added - added_before
            return total
        finally:
            self._close(lock)

    def remove_orphans(self, max_age_s: float = 3600.0) -> int:
        """Delete partial copies whose process is gone (a copy killed mid-file). Returns how many.

        A copy older than `max_age_s` is also removed: its pid may have been reused, or it may come from
        another pid namespace (a container) where we cannot tell whether it is alive.
        """
        removed = 0
        now = time.time()
        for entry in os.scandir(self.root / "tmp"):
            try:
                pid = int(entry.name.split(".")[-3])
                os.kill(pid, 0)
                alive = True
            except (ValueError, IndexError, ProcessLookupError):
                alive = False
            except PermissionError:
                alive = True  # someone else's live process
            try:
                stale = now - entry.stat().st_mtime > max_age_s
            except FileNotFoundError:
                continue
            if not alive or stale:
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
        return removed

    def clear(self) -> tuple[int, int]:
        """Remove every entry not in use and every orphaned partial copy; returns (removed, kept in use)."""
        removed = kept = 0
        for _, _, path in self._entries():
            if self._remove(path):
                removed += 1
            else:
                kept += 1
        self.remove_orphans()
        with self._lock:
            self._estimate = None
        return removed, kept

    def stats(self) -> CacheStats:
        """Sizes as they are on disk now (all jobs together)."""
        entries = self._entries()
        partial = sum(1 for _ in os.scandir(self.root / "tmp"))
        return CacheStats(str(self.root), len(entries), sum(s for _, s, _ in entries), partial, self.limit_bytes)
