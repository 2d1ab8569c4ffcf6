"""packreads: the files a pack writes next, read from SRC by a pool of threads in plan order (many opens in flight:
what a slow volume needs), at most `max_inflight_bytes` ahead of the one writer; files too big to hold are
streamed by the writer instead. A failed read is retried with backoff; a file that is missing or unreadable is a
`PackError` naming it (runtime.data.packing writes what these read)."""

from __future__ import annotations

import random
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from runtime.data.sources import FileInfo
from runtime.errors import PackError

_STREAM_ABOVE = 64 << 20  # members bigger than this are streamed by the writer, not read ahead into memory


class ReadAhead:
    """The files of the shards to write, read by the pool in plan order, at most max_inflight_bytes ahead."""

    def __init__(self, pool: ThreadPoolExecutor, source: Any, shards: list[Any], cfg: Any):
        self.pool, self.source, self.cfg = pool, source, cfg
        self._upcoming = iter([f for sh in shards for s in sh.samples for _, f in s.files])
        self._pending: deque[tuple[FileInfo, Future | None]] = deque()
        self._bytes = 0

    def _fill(self) -> None:
        limit = self.cfg.max_inflight_bytes
        while len(self._pending) < 4 * self.cfg.threads and (self._bytes < limit or not self._pending):
            info = next(self._upcoming, None)
            if info is None:
                return
            if info.size > _STREAM_ABOVE:
                self._pending.append((info, None))  # the writer streams it
                continue
            self._pending.append((info, self.pool.submit(self._read, info)))
            self._bytes += info.size

    def next(self, info: FileInfo) -> bytes | None:
        """The bytes of `info` (the next file in plan order), or None for a file the writer must stream."""
        self._fill()
        head, fut = self._pending.popleft()
        assert head is info, (head, info)
        if fut is None:
            return None
        data = fut.result()
        self._bytes -= info.size
        self._fill()
        return data

    def _read(self, info: FileInfo) -> bytes:
        return _retrying(self.source, info, self.cfg.retries, lambda fh: fh.read())

    def stream(self, info: FileInfo, write: Callable[[bytes], None]) -> None:
        """Copy a big file in blocks (a retry after a partial copy cannot happen: a failure is final)."""
        def copy(fh: Any) -> None:
            left = info.size
            while left > 0:
                block = fh.read(min(8 << 20, left))
                if not block:
                    break
                write(block)
                left -= len(block)
            if left:
                raise PackError(f"{self.source.uid(info.rel)} shrank while it was packed")

        _retrying(self.source, info, 1, copy)

    def cancel(self) -> None:
        for _, fut in self._pending:
            if fut is not None:
                fut.cancel()


def _retrying(source: Any, info: FileInfo, retries: int, use: Callable[[Any], Any]) -> Any:
    delay = 0.05
    for attempt in range(1, retries + 1):
        try:
            with source.open(info.rel) as fh:
                return use(fh)
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
            raise PackError(f"cannot read {source.uid(info.rel)}: {exc}") from None
        except OSError as exc:
            if attempt == retries:
                raise PackError(f"reading {source.uid(info.rel)} failed after {attempt} attempts: {exc}") from None
            time.sleep(delay * (1 + random.random()))
            delay *= 2
