"""VolumeDataset: files on a slow shared volume, copied to a local cache ahead of use, split across ranks
and DataLoader workers with no setup, resumable mid-epoch.

One file is one sample. An epoch's order is a permutation of the sorted file list fixed by (seed, epoch).
Ranks take it strided (rank r gets positions r, r+W, ...), so once every rank has consumed c samples the
consumed set is exactly the first c*W files of the order: a resume needs only (epoch, samples consumed
globally), whatever the number of workers. Every rank gets the same count per epoch: by default the order
is padded by wrapping around to its start (up to W-1 files seen twice per epoch, as with torch's
DistributedSampler); with drop_last=True the last N mod W files of the order are skipped instead (a
different few each epoch). How workers share a rank's order is in runtime.data.loader.
"""
from __future__ import annotations

import os
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator


from runtime.data.cache import FileCache, Pin
from runtime.errors import VolumeError
from runtime.data.sources import FileInfo, open_source
from runtime.data.loader import epoch_order, rank_order, samples_per_rank, worker_positions
from runtime.data.position import EpochPosition

__all__ = ["VolumeConfig", "VolumeDataset", "FileInfo", "WarmReport", "warm", "epoch_order", "rank_order",
           "samples_per_rank", "worker_positions"]



@dataclass(frozen=True)
class VolumeConfig:
    """Options of a VolumeDataset. `source` is a local/FUSE directory or any fsspec URL."""

    source: str
    pattern: str = "*"  # fnmatch on the path relative to source; `*` also matches `/`
    shuffle: bool = True
    seed: int = 0
    cache_dir: str | None = None  # default: $AUTORESEARCH_HOME/cache
    cache_limit_bytes: int | None = None
    lookahead: int = 16  # files fetched ahead of the one being consumed, per worker
    copy_threads: int = 16  # per worker process
    transform: Callable[[str], Any] | None = None  # applied to the local path inside the worker
    drop_last: bool = False  # equalise ranks by dropping the tail instead of padding
    retries: int = 5  # attempts per file on transient read errors
    retry_backoff_s: float = 0.05  # first wait; doubles each attempt, with jitter

    def __post_init__(self) -> None:
        if isinstance(self.source, os.PathLike):
            object.__setattr__(self, "source", os.fspath(self.source))
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("source must be a non-empty path or URL")
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError("pattern must be a non-empty glob pattern")
        if self.cache_limit_bytes is not None and self.cache_limit_bytes <= 0:
            raise ValueError(f"cache_limit_bytes must be positive, got {self.cache_limit_bytes}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {self.copy_threads}")
        if self.retries < 1:
            raise ValueError(f"retries must be >= 1, got {self.retries}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s}")
        if self.transform is not None and not callable(self.transform):
            raise ValueError("transform must be callable")


def _suffix(rel: str) -> str:
    return os.path.splitext(rel)[1][:16]  # the cached copy keeps the extension, for decoders that look


class VolumeDataset(EpochPosition):
    """Yields local cached paths (or `transform(path)`) of the files under `source`, partitioned by rank
    and worker, with the next `lookahead` files copied to the cache in background threads.

    Accepts `VolumeDataset(VolumeConfig(...))` or `VolumeDataset(source, **options)`. The file list is
    taken once, here; a missing or unreadable volume raises VolumeError naming the path.
    """

    COUNT_KEY = "num_files"
    KIND = "VolumeDataset"

    def __init__(self, source: str | os.PathLike | VolumeConfig, **options: Any):
        self.config = source if isinstance(source, VolumeConfig) else VolumeConfig(source=source, **options)
        if isinstance(source, VolumeConfig) and options:
            raise ValueError("pass either a VolumeConfig or keyword options, not both")
        cfg = self.config
        if cfg.cache_dir is None:
            from runtime.protocol import home_dir  # the runtime never imports the service's settings

            self.cache_dir = str(home_dir().resolve() / "cache")
        else:
            self.cache_dir = os.path.abspath(os.path.expanduser(cfg.cache_dir))
        self.source = open_source(cfg.source)
        self.files: list[FileInfo] = self.source.list(cfg.pattern, threads=cfg.copy_threads)
        if not self.files:
            raise VolumeError(f"no files match {cfg.pattern!r} under {cfg.source}")
        self._init_position()
        self._cache: FileCache | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._owner_pid = -1
        self._held: Any = None  # pins a worker keeps after its last sample (see _stream)

    # -- position (runtime.data.position) -------------------------------------------------------------------
    def _samples(self) -> int:
        return len(self.files)

    def _rank_order(self, spec: dict[str, int]) -> list[int]:
        order = epoch_order(len(self.files), self.config.seed, spec["epoch"], self.config.shuffle)
        return rank_order(order, spec["start"], spec["rank"], spec["world"], self.config.drop_last)

    # -- iteration --------------------------------------------------------------------------------------
    def _resources(self) -> tuple[FileCache, ThreadPoolExecutor]:
        # Created lazily and per process: threads do not survive fork, and spawn would pickle them.
        if self._owner_pid != os.getpid() or self._cache is None:
            self._cache = FileCache(self.cache_dir, self.config.cache_limit_bytes)
            self._pool = ThreadPoolExecutor(self.config.copy_threads, thread_name_prefix="volume-copy")
            self._owner_pid = os.getpid()
        return self._cache, self._pool

    @property
    def cache(self) -> FileCache:
        """This process's view of the cache (hit/miss counters, stats, clear)."""
        return self._resources()[0]

    def _schedule(self, pool: ThreadPoolExecutor, info: FileInfo) -> Any:
        # A hit costs a few local syscalls: take it here rather than pay a thread hand-off per sample.
        pin = self.cache.lookup(self.source.uid(info.rel), info.size, info.version, _suffix(info.rel))
        return pin if pin is not None else pool.submit(self.fetch, info)

    def fetch(self, info: FileInfo) -> Pin:
        """Copy one file into the cache if needed (retrying transient errors) and return it pinned."""
        return self.cache.acquire(self.source.uid(info.rel), info.size, info.version, _suffix(info.rel),
                                  lambda fd: self._copy(info, fd))

    def _copy(self, info: FileInfo, fd: int) -> None:
        cfg, delay = self.config, self.config.retry_backoff_s
        for attempt in range(1, cfg.retries + 1):
            try:
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
                self.source.copy(info.rel, fd)
                return
            except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
                raise VolumeError(f"cannot read {self.source.uid(info.rel)}: {exc}") from exc
            except OSError as exc:
                if attempt == cfg.retries:
                    raise VolumeError(f"reading {self.source.uid(info.rel)} failed after {attempt} attempts: "
                                      f"{exc}") from exc
                time.sleep(delay * (1 + random.random()))  # jitter: workers do not retry in lockstep
                delay *= 2

    def _item(self, index: int) -> FileInfo:
        return self.files[index]

    def _stream(self, files: list[FileInfo], trail: int, hold_at_end: bool) -> Iterator[Any]:
        cache, pool = self._resources()
        transform = self.config.transform
        # With a transform the file is read before the next sample is asked for; without one the path
        # travels to the consumer, so recent files stay pinned a while longer.
        keep = 1 if transform is not None else 1 + max(trail, 0)
        pending: deque = deque()
        pins: deque[Pin] = deque()
        upcoming = iter(files)
        self._release_held()
        finished = False
        try:
            for info in upcoming:
                pending.append(self._schedule(pool, info))
                if len(pending) > self.config.lookahead:
                    break
            while pending:
                head = pending.popleft()
                pin = head if isinstance(head, Pin) else head.result()
                nxt = next(upcoming, None)
                if nxt is not None:
                    pending.append(self._schedule(pool, nxt))
                pins.append(pin)
                while len(pins) > keep:
                    pins.popleft().release()
                yield pin.path if transform is None else transform(pin.path)
            finished = True
        finally:
            for fut in pending:
                if isinstance(fut, Pin):
                    fut.release()
                elif not fut.cancel():
                    fut.add_done_callback(lambda f: f.exception() is None and f.result().release())
            if finished and hold_at_end and transform is None:
                # A worker that ran out still has batches queued at the consumer: keep their files pinned
                # until this process starts its next iteration.
                self._held = pins
            else:
                for pin in pins:
                    pin.release()

    def _release_held(self) -> None:
        held, self._held = self._held, None
        for pin in held or ():
            pin.release()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_cache=None, _pool=None, _owner_pid=-1, _held=None)
        return state


@dataclass(frozen=True)
class WarmReport:
    """What `warm()` did."""

    files: int
    bytes: int
    copied_files: int
    copied_bytes: int
    seconds: float


def warm(dataset: VolumeDataset, *, threads: int = 64, progress: Callable[[int], None] | None = None) -> WarmReport:
    """Copy every file of `dataset` into its cache with `threads` parallel copies, ignoring partitioning.

    `progress(nbytes)` is called after each file. Nothing is left pinned.
    """
    t0 = time.perf_counter()
    copied_files = copied_bytes = 0

    def one(info: FileInfo) -> tuple[bool, int]:
        with dataset.fetch(info) as pin:
            return pin.copied, pin.size

    with ThreadPoolExecutor(threads, thread_name_prefix="volume-warm") as pool:
        for copied, size in pool.map(one, dataset.files):
            copied_files, copied_bytes = copied_files + copied, copied_bytes + size * copied
            if progress is not None:
                progress(size)
    return WarmReport(len(dataset.files), sum(f.size for f in dataset.files), copied_files, copied_bytes,
                      time.perf_counter() - t0)
