"""ParquetDataset: Parquet files on a slow shared volume, streamed one row group at a time into batches of
rows, split by rows across ranks and DataLoader workers, shuffled per epoch, resumable mid-epoch.

    ds = ParquetDataset("/mnt/vol/export", columns=["x", "y"], batch_rows=1024, seed=0)
    loader = DataLoader(ds, batch_size=None, num_workers=2)   # the dataset yields whole batches
    state = TrainState(model, optimizer, loader=loader)       # the position travels in the checkpoint

Sources: a directory written by `autoresearch data export-delta` (its MANIFEST.json, written last, lists the
files and row groups; a directory without one is an export still running or torn, and is refused), a glob
(`/mnt/vol/t/*.parquet`, footers read in parallel), one file, or a list of files. Files are copied into the
local cache that VolumeDataset uses (same cache, same locks, `lookahead` files ahead) and read from there
(plain reads, not mmap, so RSS is what the loader holds); only the row groups of the current shuffle
window are ever decoded, never the whole table.

Who gets which rows, how shuffling works and why resume is exact are in runtime.data.parquet_plan. Equal rows per
rank: padded by wrapping around (default) or, with drop_last=True, the tail dropped. The position is
(epoch, batches consumed); it survives a change of the worker count between save and resume.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from runtime.errors import VolumeError
from runtime.data.loader import _dist_rank_world
from runtime.data.parquet_files import MANIFEST, list_parquet, read_manifest
from runtime.data.parquet_plan import RankPlan, consumed_after, from_ranges, pass_runs, to_ranges

__all__ = ["MANIFEST", "ParquetConfig", "ParquetDataset", "read_manifest"]  # the last two: parquet_files

STATE_VERSION = 1
_MAX_RANGES = 512  # consumed ranges a resumed position may hold (grows by ~workers per resume in one epoch)
_FORMATS = ("torch", "numpy", "arrow")


@dataclass(frozen=True)
class ParquetConfig:
    """Options of a ParquetDataset. `paths` is an export directory, a glob, a file, or a list of files."""

    paths: str | tuple[str, ...]
    columns: tuple[str, ...] | None = None  # None: every column
    batch_rows: int = 1024
    shuffle: bool = True
    seed: int = 0
    shuffle_rows: int = 65536  # in-buffer shuffle window (rounded up to a multiple of batch_rows)
    drop_last: bool = False  # equalise ranks by dropping the tail instead of padding
    format: str = "torch"  # batches as dicts of torch tensors, of numpy arrays, or a pyarrow.RecordBatch
    transform: Callable[[Any], Any] | None = None  # applied to each batch inside the worker
    cache_dir: str | None = None  # default: $AUTORESEARCH_HOME/cache, shared with VolumeDataset
    cache_limit_bytes: int | None = None
    lookahead: int = 4  # files fetched ahead of the one being read, per worker
    copy_threads: int = 4  # per worker process

    def __post_init__(self) -> None:
        paths = self.paths
        if isinstance(paths, os.PathLike):
            paths = os.fspath(paths)
        if not isinstance(paths, str):
            paths = tuple(os.fspath(p) for p in paths)
            if not paths:
                raise ValueError("paths must name at least one file")
        elif not paths:
            raise ValueError("paths must be a non-empty path, glob or URL")
        object.__setattr__(self, "paths", paths)
        if self.columns is not None:
            if isinstance(self.columns, str):
                raise ValueError("columns must be a list of names, not one string")
            object.__setattr__(self, "columns", tuple(self.columns))
        if self.batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {self.batch_rows}")
        if self.shuffle_rows < 1:
            raise ValueError(f"shuffle_rows must be >= 1, got {self.shuffle_rows}")
        if self.format not in _FORMATS:
            raise ValueError(f"format must be one of {', '.join(_FORMATS)}, got {self.format!r}")
        if self.lookahead < 0 or self.copy_threads < 1:
            raise ValueError("lookahead must be >= 0 and copy_threads >= 1")
        if self.transform is not None and not callable(self.transform):
            raise ValueError("transform must be callable")


class _Position:
    """What the loader publishes to its workers before each pass: epoch, rank, world, workers, and the
    batches already consumed as ranges. Persistent workers only see it through memory shared before they
    start, so `share()` moves it into an anonymous shared array (the same trick as runtime.data.loader._Spec)."""

    HEAD = 6  # valid, epoch, rank, world, workers, number of ranges

    def __init__(self) -> None:
        self._values: Any = [0] * (self.HEAD + 2 * _MAX_RANGES)

    def share(self, ctx) -> None:
        if isinstance(self._values, list):
            self._values = ctx.RawArray("q", self._values)

    def publish(self, epoch: int, rank: int, world: int, workers: int, consumed: list[list[int]]) -> None:
        if len(consumed) > _MAX_RANGES:
            raise VolumeError(f"position too fragmented to resume ({len(consumed)} ranges): resume with the "
                              "worker count it was saved with")
        flat = [v for r in consumed for v in r]
        self._values[1:self.HEAD] = [epoch, rank, world, workers, len(consumed)]
        self._values[self.HEAD:self.HEAD + len(flat)] = flat
        self._values[0] = 1

    def get(self) -> dict[str, Any] | None:
        if not self._values[0]:
            return None
        epoch, rank, world, workers, n = list(self._values[1:self.HEAD])
        flat = list(self._values[self.HEAD:self.HEAD + 2 * n])
        # `start` and `world` are what runtime.data.loader.DataLoader reads back and hands to _advance.
        return {"epoch": epoch, "rank": rank, "world": world, "workers": workers, "start": 0,
                "consumed": [flat[i:i + 2] for i in range(0, len(flat), 2)]}

    def __getstate__(self):
        from multiprocessing.context import get_spawning_popen

        return {"_values": self._values if get_spawning_popen() is not None else list(self._values)}


class ParquetDataset(IterableDataset):
    """Batches of rows (dicts of tensors or numpy arrays, or RecordBatches) from Parquet files, partitioned
    by rank and worker. Accepts `ParquetDataset(ParquetConfig(...))` or `ParquetDataset(paths, **options)`.

    Files and their row groups are listed here, once: a missing volume, an incomplete export or an unknown
    column raises VolumeError (ValueError for the column) naming it.
    """

    def __init__(self, paths_or_glob: str | os.PathLike | Sequence[str] | ParquetConfig, **options: Any):
        if isinstance(paths_or_glob, ParquetConfig):
            if options:
                raise ValueError("pass either a ParquetConfig or keyword options, not both")
            self.config = paths_or_glob
        else:
            self.config = ParquetConfig(paths=paths_or_glob, **options)
        cfg = self.config
        listing = list_parquet(cfg.paths, cache_dir=cfg.cache_dir, cache_limit_bytes=cfg.cache_limit_bytes,
                               threads=max(cfg.copy_threads, 8))
        self.volume, self.files, self.manifest = listing.volume, listing.files, listing.manifest
        self.schema, unit_rows, self.units = listing.schema, listing.unit_rows, listing.units
        names = self.schema.names
        missing = [c for c in self.config.columns or () if c not in names]
        if missing:
            raise ValueError(f"unknown column {missing[0]!r}; the files have: {', '.join(names)}")
        self.columns = list(self.config.columns) if self.config.columns is not None else list(names)
        self.unit_rows = unit_rows
        self.num_rows = int(sum(unit_rows))
        if self.num_rows == 0:
            raise VolumeError(f"no rows in {self.config.paths}")
        self._epoch = 0
        self._consumed: set[int] = set()  # batches of this rank already delivered in this epoch
        self._workers = 1  # set by runtime.data.loader.DataLoader: the delivery order depends on it
        self._pass: tuple[list[list[int]], int] | None = None  # this pass's per-worker runs and deliveries
        self._spec = _Position()  # named like VolumeDataset's: runtime.data.loader.DataLoader shares it
        self._pool: ThreadPoolExecutor | None = None
        self._owner_pid = -1

    # -- position ---------------------------------------------------------------------------------------------
    def _plan(self, epoch: int, rank: int, world: int) -> RankPlan:
        cfg = self.config
        return RankPlan.make(self.unit_rows, seed=cfg.seed, epoch=epoch, rank=rank, world=world,
                             batch_rows=cfg.batch_rows, window=cfg.shuffle_rows, shuffle=cfg.shuffle,
                             drop_last=cfg.drop_last)

    def __len__(self) -> int:
        """Batches this rank gets per epoch (only the last may hold fewer than batch_rows rows)."""
        return self._plan(0, *_dist_rank_world()).num_batches

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch` (a new order); a no-op for the current one, so a resumed loop continues mid-epoch."""
        if epoch != self._epoch:
            self._epoch, self._consumed = int(epoch), set()

    def _consumed_now(self) -> set[int]:
        if self._pass is None:
            return self._consumed
        runs, delivered = self._pass
        return self._consumed | set(consumed_after(runs, delivered))

    def state_dict(self) -> dict[str, Any]:
        """The position as plain values: epoch and this rank's consumed batches (as ranges), plus what
        must match for the rest of the epoch to be exactly the unseen rows."""
        done = self._consumed_now()
        return {"version": STATE_VERSION, "epoch": self._epoch, "batches_consumed": len(done),
                "consumed": to_ranges(done), "seed": self.config.seed, "rows": self.num_rows,
                "batch_rows": self.config.batch_rows, "world_size": _dist_rank_world()[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`: the rest of that epoch is exactly the batches not yet delivered."""
        try:
            epoch, consumed = int(state["epoch"]), from_ranges(state["consumed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a ParquetDataset state: {state!r}") from exc
        now = {"seed": self.config.seed, "rows": self.num_rows, "batch_rows": self.config.batch_rows,
               "world_size": _dist_rank_world()[1]}
        for key, value in now.items():
            if key in state and int(state[key]) != value:
                warnings.warn(f"resuming data with {key}={value}, saved with {state[key]}: the rest of the "
                              "epoch is not exactly the unseen rows", stacklevel=2)
        self._epoch, self._consumed, self._pass = epoch, consumed, None

    # -- hooks for runtime.data.loader.DataLoader ------------------------------------------------------------------
    def _begin(self, block: int, trail: int) -> int:
        """Publish this pass for the workers; returns the batches this rank will deliver."""
        if block != 1:
            raise ValueError("ParquetDataset yields whole batches of batch_rows rows: build the loader "
                             "with DataLoader(dataset, batch_size=None)")
        rank, world = _dist_rank_world()
        self._consumed = self._consumed_now()
        runs = pass_runs(self._plan(self._epoch, rank, world).num_batches, self._consumed, self._workers)
        self._pass = (runs, 0)
        self._spec.publish(self._epoch, rank, world, self._workers, to_ranges(self._consumed))
        return sum(map(len, runs))

    def _advance(self, start: int, delivered: int, world: int) -> None:
        if self._pass is not None:
            self._pass = (self._pass[0], delivered)

    def _end_epoch(self) -> None:
        self._epoch, self._consumed, self._pass = self._epoch + 1, set(), None

    # -- iteration ---------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        spec, info = self._spec.get(), get_worker_info()
        track = spec is None and info is None  # iterated directly: keep the position here
        if spec is None:
            rank, world = _dist_rank_world()
            spec = {"epoch": self._epoch, "rank": rank, "world": world, "consumed": to_ranges(self._consumed)}
        plan = self._plan(spec["epoch"], spec["rank"], spec["world"])
        done = from_ranges(spec["consumed"])
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        runs = pass_runs(plan.num_batches, done, workers)
        if track:
            self._consumed, self._pass = done, (runs, 0)
        for n, batch in enumerate(self._read(plan, runs[worker]), start=1):
            if track:
                self._pass = (runs, n)
            yield batch
        if track:
            self._end_epoch()

    def _resources(self) -> ThreadPoolExecutor:
        # Per process: threads do not survive fork, and spawn would pickle them.
        if self._owner_pid != os.getpid() or self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.copy_threads, thread_name_prefix="parquet-copy")
            self._owner_pid = os.getpid()
        return self._pool

    def _read(self, plan: RankPlan, batches: list[int]) -> Iterator[Any]:
        """Decode the windows `batches` fall in, one at a time, fetching files `lookahead` ahead."""
        pool = self._resources()
        windows = list(dict.fromkeys(plan.window_of(b) for b in batches))
        pieces = {w: plan.segments(w) for w in windows}
        needed = list(dict.fromkeys(self.units[s.unit][0] for w in windows for s in pieces[w]))
        fetching: dict[int, Future] = {}
        opened: OrderedDict[int, tuple[Any, pq.ParquetFile]] = OrderedDict()  # file -> (pin, reader)
        ahead = iter(needed)
        keep_open = max(self.config.lookahead, 1) + 4
        last_group: tuple[int, pa.Table] | None = None

        def fill() -> None:
            while len(fetching) < self.config.lookahead:
                f = next(ahead, None)
                if f is None:
                    return
                if f not in opened and f not in fetching:
                    fetching[f] = pool.submit(self.volume.fetch, self.files[f])

        def reader(f: int) -> pq.ParquetFile:
            if f in opened:
                opened.move_to_end(f)
                return opened[f][1]
            fut = fetching.pop(f, None)
            pin = fut.result() if fut is not None else self.volume.fetch(self.files[f])
            opened[f] = (pin, pq.ParquetFile(pin.path))  # read, not mapped: mapped pages would count as ours
            while len(opened) > keep_open:
                old_pin, old_reader = opened.popitem(last=False)[1]
                old_reader.close()
                old_pin.release()
            fill()
            return opened[f][1]

        try:
            fill()
            by_window: dict[int, list[int]] = {}
            for b in batches:
                by_window.setdefault(plan.window_of(b), []).append(b)
            for w in windows:
                parts = []
                for seg in pieces[w]:
                    if last_group is None or last_group[0] != seg.unit:
                        f, g = self.units[seg.unit]
                        last_group = (seg.unit, reader(f).read_row_group(g, columns=self.columns))
                    parts.append(last_group[1].slice(seg.lo, seg.hi - seg.lo))
                window = self._window(pa.concat_tables(parts), plan.permutation(w) if plan.shuffle else None)
                del parts
                for b in by_window[w]:
                    lo, hi = plan.batch_slice(b)
                    yield self._batch(window, lo, hi)
                del window
        finally:
            for fut in fetching.values():
                if not fut.cancel():
                    fut.add_done_callback(lambda f: f.exception() is None and f.result().release())
            for pin, rdr in opened.values():
                rdr.close()
                pin.release()

    def _window(self, table: pa.Table, order: np.ndarray | None) -> Any:
        """A decoded window in its shuffled order: one Arrow record batch, or one numpy array per column
        (permuted once here, so each batch is a cheap view; the arrays are our own copies, so writable)."""
        if self.config.format == "arrow":
            table = table.take(pa.array(order)) if order is not None else table
            return table.combine_chunks().to_batches(max_chunksize=None)[0]
        columns = {}
        for name in table.column_names:
            array = _to_numpy(table.column(name))
            columns[name] = array[order] if order is not None else np.array(array)
        return columns

    def _batch(self, window: Any, lo: int, hi: int) -> Any:
        if self.config.format == "arrow":
            batch = window.slice(lo, hi - lo)
        elif self.config.format == "torch":
            batch = {name: torch.from_numpy(a[lo:hi]) if a.dtype != object else a[lo:hi] for name, a in window.items()}
        else:
            batch = {name: a[lo:hi] for name, a in window.items()}
        transform = self.config.transform
        return transform(batch) if transform is not None else batch

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_pool=None, _owner_pid=-1)
        return state


_NUMPY = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
          pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
          pa.float16(): np.float16, pa.float32(): np.float32, pa.float64(): np.float64}


def _to_numpy(column: pa.ChunkedArray) -> np.ndarray:
    """A column as numpy, read-only. Fixed-width columns without nulls are a view of the Arrow buffer: pyarrow's
    own to_numpy() imports pandas (a second of start-up and tens of MB in every worker process)."""
    array = column.chunk(0) if column.num_chunks == 1 else pa.concat_arrays(column.chunks)
    dtype = _NUMPY.get(array.type)
    if dtype is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)  # strings, booleans, nulls: objects or NaN as pyarrow does
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                         offset=array.offset * np.dtype(dtype).itemsize)
