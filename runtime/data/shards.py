"""ShardDataset: the samples of a pack of tar shards (`autoresearch data pack`, runtime.data.packing) on a slow shared
volume, each shard copied whole into the local cache ahead of use, split across ranks and DataLoader workers,
resumable mid-epoch: VolumeDataset's contract, with a few long sequential reads instead of an open per file.

    ds = ShardDataset("/mnt/vol/images-shards", split="train", transform=decode)   # decode({"__key__", "jpg", ...})
    loader = DataLoader(ds, batch_size=32, num_workers=2)
    state = TrainState(model, optimizer, loader=loader)                            # the position resumes exactly

Order. An epoch is a sequence of sample indices fixed by (seed, epoch): with `shuffle=True` the shards in a
shuffled order and, inside each shard, the samples shuffled within windows of `shuffle_window` (so a worker
needs only the shard it reads and the next ones it fetches); `shuffle="global"` is VolumeDataset's order over
the samples sorted by key (a pack of the same files then trains identically: use it when the shards fit the
cache); `shuffle=False` is index order. Ranks, workers, padding and the position (epoch, samples consumed
globally) are exactly VolumeDataset's (runtime.data.loader), so the rest of a resumed epoch is the unseen
samples, whatever the worker count.

Integrity. A shard is copied from the volume in ranged reads (several streams at once, each opening it once),
each range's CRC-32 taken as it lands and the shard's combined from them; a size or
checksum that differs from the index is a ShardError naming the shard and the first sample it breaks (found
by each member's own CRC-32), and nothing is cached. Complete copies live in the FileCache shared with
VolumeDataset (same locks: several workers or jobs copy a shard once), least recently used first out under
`cache_limit_bytes`; shards in use are never evicted.
"""

from __future__ import annotations

import bisect
import os
import random
import time
import zlib
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator


from runtime.data.cache import FileCache, Pin
from runtime.data.crc import crc32_combine
from runtime.data.loader import epoch_order, rank_order
from runtime.data.position import EpochPosition
from runtime.data.shardindex import read_index
from runtime.data.sources import open_source
from runtime.errors import ShardError, VolumeError

__all__ = ["ShardConfig", "ShardDataset", "shard_order"]

_SHUFFLES = ("shards", "global", "none")


@dataclass(frozen=True)
class ShardConfig:
    """Options of a ShardDataset. `source` is a pack's directory (local/FUSE) or any fsspec URL to it."""

    source: str
    split: str | None = None  # one split of a pack made with --split-by; None: every sample
    shuffle: bool | str = True  # True or "shards", "global", False or "none" (see the module docstring)
    shuffle_window: int = 4096  # samples shuffled together inside a shard
    seed: int = 0
    members: str = "bytes"  # member values: "bytes", or "path" (a file of its own in the cache)
    transform: Callable[[dict[str, Any]], Any] | None = None  # applied to each sample dict inside the worker
    cache_dir: str | None = None  # default: $AUTORESEARCH_HOME/cache, shared with VolumeDataset
    cache_limit_bytes: int | None = None
    lookahead: int = 2  # shards fetched ahead of the one being read, per worker
    copy_threads: int = 8  # ranged reads of one shard at once, per worker process
    part_bytes: int = 8 << 20  # the size of one ranged read
    drop_last: bool = False  # equalise ranks by dropping the tail instead of padding
    retries: int = 5  # attempts per shard on transient read errors

    def __post_init__(self) -> None:
        if isinstance(self.source, os.PathLike):
            object.__setattr__(self, "source", os.fspath(self.source))
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("source must be a non-empty path or URL")
        shuffle = {True: "shards", False: "none"}.get(self.shuffle, self.shuffle) \
            if isinstance(self.shuffle, bool) else self.shuffle
        if shuffle not in _SHUFFLES:
            raise ValueError(f"shuffle must be True, False, or one of {', '.join(_SHUFFLES)}; got {self.shuffle!r}")
        object.__setattr__(self, "shuffle", shuffle)
        if self.shuffle_window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {self.shuffle_window}")
        if self.members not in ("bytes", "path"):
            raise ValueError(f"members must be 'bytes' or 'path', got {self.members!r}")
        if self.cache_limit_bytes is not None and self.cache_limit_bytes <= 0:
            raise ValueError(f"cache_limit_bytes must be positive, got {self.cache_limit_bytes}")
        if self.lookahead < 0 or self.copy_threads < 1 or self.retries < 1 or self.part_bytes < 1:
            raise ValueError("lookahead must be >= 0, copy_threads, part_bytes and retries >= 1")
        if self.transform is not None and not callable(self.transform):
            raise ValueError("transform must be callable")


def shard_order(counts: list[int], seed: int, epoch: int, window: int) -> list[int]:
    """The epoch's sample indices: shards in a shuffled order, each one's samples shuffled within windows."""
    rng = random.Random(f"shards:{seed}:{epoch}")  # str seeds hash stably across runs
    shards = list(range(len(counts)))
    rng.shuffle(shards)
    first = [0]
    for c in counts:
        first.append(first[-1] + c)
    out: list[int] = []
    for s in shards:
        for lo in range(first[s], first[s + 1], window):
            chunk = list(range(lo, min(lo + window, first[s + 1])))
            rng.shuffle(chunk)
            out.extend(chunk)
    return out


class ShardDataset(EpochPosition):
    """Yields each sample as `{"__key__": key, member: bytes or path, ...}` (or `transform(sample)`), partitioned
    by rank and worker, with the next `lookahead` shards copied into the cache in background threads.

    Accepts `ShardDataset(ShardConfig(...))` or `ShardDataset(source, **options)`. The index is read once, here:
    a missing volume, a directory that is not a complete pack, or an unknown split raises VolumeError.
    """

    COUNT_KEY = "num_samples"
    KIND = "ShardDataset"

    def __init__(self, source: str | os.PathLike | ShardConfig, **options: Any):
        if isinstance(source, ShardConfig) and options:
            raise ValueError("pass either a ShardConfig or keyword options, not both")
        self.config = source if isinstance(source, ShardConfig) else ShardConfig(source=source, **options)
        cfg = self.config
        if cfg.cache_dir is None:
            from runtime.protocol import home_dir  # the runtime never imports the service's settings

            self.cache_dir = str(home_dir().resolve() / "cache")
        else:
            self.cache_dir = os.path.abspath(os.path.expanduser(cfg.cache_dir))
        index = read_index(cfg.source)
        shards = index["shards"]
        if cfg.split is not None:
            splits = sorted({s["split"] for s in shards})
            shards = [s for s in shards if s["split"] == cfg.split]
            if not shards:
                raise VolumeError(f"{cfg.source} has no split {cfg.split!r}; it has: {', '.join(splits) or 'none'}")
        self.shards: list[dict[str, Any]] = shards
        self.source = open_source(cfg.source)
        self._first = [0]
        for s in shards:
            self._first.append(self._first[-1] + len(s["samples"]))
        self.num_samples = self._first[-1]
        if not self.num_samples:
            raise VolumeError(f"no samples in {cfg.source}" + (f" split {cfg.split!r}" if cfg.split else ""))
        self._init_position()
        self._orders: tuple[int, list[int]] | None = None  # (epoch, order): one shuffle per epoch per process
        self._cache: FileCache | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._owner_pid = -1
        self._parts: ThreadPoolExecutor | None = None
        self._parts_pid = -1
        self._held: Any = None  # member pins a worker keeps after its last sample (members="path")

    # -- position (runtime.data.position, as VolumeDataset's) ------------------------------------------------
    def _samples(self) -> int:
        return self.num_samples

    def epoch_order(self, epoch: int) -> list[int]:
        """Every sample index of `epoch` in delivery order (before ranks and workers take their part)."""
        if self._orders is None or self._orders[0] != epoch:
            cfg = self.config
            if cfg.shuffle == "shards":
                counts = [len(s["samples"]) for s in self.shards]
                order = shard_order(counts, cfg.seed, epoch, cfg.shuffle_window)
            else:
                order = epoch_order(self.num_samples, cfg.seed, epoch, cfg.shuffle == "global")
            self._orders = (epoch, order)
        return self._orders[1]

    def key(self, index: int) -> str:
        """The key of sample `index`."""
        s = bisect.bisect_right(self._first, index) - 1
        return self.shards[s]["samples"][index - self._first[s]]["key"]

    def read(self, index: int) -> dict[str, Any]:
        """Sample `index` as `{"__key__": key, member: bytes}`, on any rank (no partitioning, no transform):
        for small sets every rank reads whole, such as a validation split."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of {self.num_samples}")
        s = bisect.bisect_right(self._first, index) - 1
        entry = self.shards[s]["samples"][index - self._first[s]]
        with self.fetch(s) as pin:
            fd = os.open(pin.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return {"__key__": entry["key"], **{m: _pread(fd, size, offset)
                                                    for m, (offset, size, _) in entry["members"].items()}}
            finally:
                os.close(fd)

    # -- iteration ---------------------------------------------------------------------------------------------
    def _resources(self) -> tuple[FileCache, ThreadPoolExecutor]:
        # Created lazily and per process: threads do not survive fork, and spawn would pickle them.
        if self._owner_pid != os.getpid() or self._cache is None:
            self._cache = FileCache(self.cache_dir, self.config.cache_limit_bytes)
            self._pool = ThreadPoolExecutor(self.config.lookahead + 1, thread_name_prefix="shard-copy")
            self._owner_pid = os.getpid()
        return self._cache, self._pool

    @property
    def cache(self) -> FileCache:
        """This process's view of the cache (hit/miss counters, stats, clear)."""
        return self._resources()[0]

    def _rank_order(self, spec: dict[str, int]) -> list[int]:
        return rank_order(self.epoch_order(spec["epoch"]), spec["start"], spec["rank"], spec["world"],
                          self.config.drop_last)

    def _item(self, index: int) -> int:
        return index  # a sample's number: `_stream` finds its shard and members

    def fetch(self, shard: int) -> Pin:
        """Copy shard number `shard` into the cache if needed (checking size and checksum) and return it pinned."""
        info = self.shards[shard]
        return self.cache.acquire(self.source.uid(info["name"]), info["bytes"], info["checksum"], ".tar",
                                  lambda fd: self._copy(info, fd))

    def _copy(self, info: dict[str, Any], fd: int) -> None:
        delay, uid = 0.05, self.source.uid(info["name"])
        for attempt in range(1, self.config.retries + 1):
            try:
                os.ftruncate(fd, 0)
                got, crc = self._copy_parts(info, fd)
                break
            except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
                raise VolumeError(f"cannot read shard {uid}: {exc}") from exc
            except OSError as exc:
                if attempt == self.config.retries:
                    raise VolumeError(f"reading shard {uid} failed after {attempt} attempts: {exc}") from exc
                time.sleep(delay * (1 + random.random()))
                delay *= 2
        if got != info["bytes"]:
            raise ShardError(_torn(uid, info, got))
        if f"crc32:{crc:08x}" != info["checksum"]:
            raise ShardError(_corrupt(uid, info, fd))

    def _copy_parts(self, info: dict[str, Any], fd: int) -> tuple[int, int]:
        """Copy a shard in `part_bytes` ranges, `copy_threads` streams at once (network storage caps each stream,
        not the sum: parallel ranged reads, as multipart downloads do), each stream one open of the shard, each
        range's CRC-32 taken as it lands (zlib releases the GIL: the checks run in parallel too); returns (bytes
        copied, the whole shard's CRC-32)."""
        size, part = info["bytes"], self.config.part_bytes
        ranges = [(off, min(part, size - off)) for off in range(0, size, part)] or [(0, 0)]
        streams = min(self.config.copy_threads, len(ranges))

        def copy(mine: list[tuple[int, int]]) -> list[tuple[int, int]]:
            return self.source.copy_ranges(info["name"], fd, mine)

        if streams == 1:
            results = copy(ranges)
        else:
            per_stream = list(self._parts_pool().map(copy, [ranges[i::streams] for i in range(streams)]))
            results = [r for i in range(len(ranges)) for r in per_stream[i % streams][i // streams:i // streams + 1]]
        total = crc = 0
        for got, part_crc in results:
            crc = crc32_combine(crc, part_crc, got)
            total += got
            if got < part:
                break
        return total, crc

    def _parts_pool(self) -> ThreadPoolExecutor:
        # Separate from the shard pool, whose threads wait here: one pool for both could deadlock.
        self._resources()
        if self._parts is None or self._parts_pid != os.getpid():
            self._parts = ThreadPoolExecutor(self.config.copy_threads, thread_name_prefix="shard-part")
            self._parts_pid = os.getpid()
        return self._parts

    def _stream(self, ids: list[int], trail: int, hold_at_end: bool) -> Iterator[Any]:
        cache, pool = self._resources()
        cfg = self.config
        first = self._first
        shard_of = [bisect.bisect_right(first, g) - 1 for g in ids]
        seq = list(dict.fromkeys(shard_of))  # shards in the order this worker first needs them
        where = {s: i for i, s in enumerate(seq)}
        fetching: dict[int, Future] = {}
        opened: OrderedDict[int, tuple[Pin, int]] = OrderedDict()  # shard -> (pin, read fd)
        keep_open = 2 if cfg.shuffle != "global" else max(8, cfg.lookahead + 2)
        keep = 1 if cfg.transform is not None else 1 + max(trail, 0)  # member pins (members="path")
        member_pins: deque[list[Pin]] = deque()
        self._release_held()
        finished = False

        def shard_fd(s: int) -> int:
            if s in opened:
                opened.move_to_end(s)
                return opened[s][1]
            fut = fetching.pop(s, None)
            pin = fut.result() if fut is not None else self.fetch(s)
            try:
                fd = os.open(pin.path, os.O_RDONLY | os.O_CLOEXEC)
            except BaseException:
                pin.release()
                raise
            opened[s] = (pin, fd)
            while len(opened) > keep_open:
                old_pin, old_fd = opened.popitem(last=False)[1]
                os.close(old_fd)
                old_pin.release()
            for nxt in seq[where[s] + 1:where[s] + 1 + cfg.lookahead]:
                if nxt not in opened and nxt not in fetching:
                    fetching[nxt] = pool.submit(self.fetch, nxt)
            return fd

        try:
            for g, s in zip(ids, shard_of):
                fd = shard_fd(s)
                entry = self.shards[s]["samples"][g - first[s]]
                sample: dict[str, Any] = {"__key__": entry["key"]}
                pins: list[Pin] = []
                for member, (offset, size, crc) in entry["members"].items():
                    if cfg.members == "bytes":
                        sample[member] = _pread(fd, size, offset)
                    else:
                        pin = self._member_file(s, entry["key"], member, fd, offset, size, crc)
                        pins.append(pin)
                        sample[member] = pin.path
                if pins:
                    member_pins.append(pins)
                    while len(member_pins) > keep:
                        for p in member_pins.popleft():
                            p.release()
                yield sample if cfg.transform is None else cfg.transform(sample)
            finished = True
        finally:
            for fut in fetching.values():
                if not fut.cancel():
                    fut.add_done_callback(lambda f: f.exception() is None and f.result().release())
            for pin, fd in opened.values():
                os.close(fd)
                pin.release()
            if finished and hold_at_end and cfg.transform is None and member_pins:
                self._held = member_pins  # paths still queued at the consumer: keep them until the next pass
            else:
                for pins in member_pins:
                    for p in pins:
                        p.release()

    def _member_file(self, s: int, key: str, member: str, fd: int, offset: int, size: int, crc: int) -> Pin:
        shard = self.shards[s]
        suffix = os.path.splitext(f"x.{member}")[1][:16] if member else ""

        def extract(out: int) -> None:
            data = _pread(fd, size, offset)
            if zlib.crc32(data) != crc:
                raise ShardError(f"shard {self.source.uid(shard['name'])}: sample {key!r} member {member!r} does "
                                 "not match its checksum in the cache; run `autoresearch cache clear`")
            _write_all(out, data)

        uid = f"{self.source.uid(shard['name'])}#{key}.{member}"
        return self.cache.acquire(uid, size, shard["checksum"], suffix, extract)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        for pins in held or ():
            for p in pins:
                p.release()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_cache=None, _pool=None, _owner_pid=-1, _parts=None, _parts_pid=-1, _held=None, _orders=None)
        return state


def _pread(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    while len(data) < size:  # pread may return less than asked (large reads); never past a complete shard's end
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise ShardError(f"cached shard ended at {offset + len(data)} bytes, before a member's end")
        data += more
    return data


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _torn(uid: str, info: dict[str, Any], got: int) -> str:
    for entry in info["samples"]:
        for member, (offset, size, _) in entry["members"].items():
            if offset + size > got:
                return (f"shard {uid} is torn ({got} of {info['bytes']} bytes): sample {entry['key']!r} "
                        f"(member {member!r}) and those after it are missing; re-run `autoresearch data pack`")
    return (f"shard {uid} has {got} bytes, the index says {info['bytes']} (after its last sample "
            f"{info['samples'][-1]['key']!r}); re-run `autoresearch data pack`")


def _corrupt(uid: str, info: dict[str, Any], fd: int) -> str:
    for entry in info["samples"]:
        for member, (offset, size, crc) in entry["members"].items():
            if zlib.crc32(_pread(fd, size, offset)) != crc:
                return (f"shard {uid} is corrupt: sample {entry['key']!r} (member {member!r}) does not match its "
                        "checksum; re-run `autoresearch data pack`")
    return (f"shard {uid} is corrupt outside its samples' data (a tar header); its samples are intact up to "
            f"{info['samples'][-1]['key']!r}; re-run `autoresearch data pack`")
