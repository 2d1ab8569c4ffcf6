"""DataLoader: torch's DataLoader with defaults that keep compute fed from a VolumeDataset, and a position
(`state_dict()`) that a checkpoint can carry to resume the data exactly.

The position is counted here, in the training process, from batches actually delivered: workers run
ahead (prefetch), so only the consumer knows what has been used. Because the dataset deals each rank's
order to workers in blocks of `batch_size`, and torch collects one batch from each worker in turn, the
k-th delivered batch is always samples [k*B, (k+1)*B) of the rank's order, whatever the worker count.
The functions that fix that order (per epoch, per rank, per worker) live here too; VolumeDataset uses them.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import random
import signal
import threading
from typing import Any, Callable, Iterator

import torch
import torch.utils.data


# -- the order of delivery: pure functions, property-tested ----------------------------------------------------
def epoch_order(num_files: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global order of file indices for one epoch; identical on every rank and worker."""
    order = list(range(num_files))
    if shuffle:
        random.Random(f"volume:{seed}:{epoch}").shuffle(order)  # str seeds hash stably across runs
    return order


def samples_per_rank(num_files: int, world_size: int, drop_last: bool = False) -> int:
    """Samples each rank gets in a full epoch."""
    return num_files // world_size if drop_last else math.ceil(num_files / world_size)


def rank_order(order: list[int], consumed: int, rank: int, world_size: int, drop_last: bool = False) -> list[int]:
    """File indices rank `rank` still has to deliver after `consumed` samples of `order` (all ranks)."""
    n = len(order)
    tail = order[consumed:] if consumed < n else []
    if drop_last:
        tail = tail[: len(tail) - len(tail) % world_size]
    elif n:
        tail = tail + [order[i % n] for i in range((-len(tail)) % world_size)]
    return tail[rank::world_size]


def rank_length(num_files: int, consumed: int, rank: int, world_size: int, drop_last: bool = False) -> int:
    """len(rank_order(...)) without building (and shuffling) the order: the loader needs it each epoch."""
    tail = max(num_files - consumed, 0)
    if drop_last:
        tail -= tail % world_size
    elif num_files:
        tail += (-tail) % world_size
    return max(0, -(-(tail - rank) // world_size))


def worker_positions(length: int, block: int, worker: int, num_workers: int) -> list[int]:
    """Positions (into a rank's order) that one worker delivers: blocks of `block`, dealt round-robin."""
    out: list[int] = []
    for start in range(worker * block, length, num_workers * block):
        out.extend(range(start, min(start + block, length)))
    return out


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class _Spec:
    """What an iteration covers (epoch, start, block, trail, rank, world), written by the loader before
    workers start an epoch. Persistent workers only see it through shared memory, so `share()` moves it
    into an anonymous shared array (freed with the last process that maps it: nothing left after a crash)."""

    FIELDS = ("valid", "epoch", "start", "block", "trail", "rank", "world")

    def __init__(self) -> None:
        self._values: Any = [0] * len(self.FIELDS)

    def share(self, ctx) -> None:
        if isinstance(self._values, list):
            self._values = ctx.RawArray("q", self._values)

    def set(self, **values: int) -> None:
        for name, value in values.items():
            self._values[self.FIELDS.index(name)] = int(value)
        self._values[0] = 1

    def get(self) -> dict[str, int] | None:
        values = list(self._values)
        return dict(zip(self.FIELDS, values)) if values[0] else None

    def __getstate__(self):
        from multiprocessing.context import get_spawning_popen

        # A shared array pickles only while spawning a worker; anywhere else, keep a plain copy.
        return {"_values": self._values if get_spawning_popen() is not None else list(self._values)}


# -- the hand-off: how a worker's batch reaches the training process ----------------------------------------------
# torch moves every tensor of a batch through its own shared-memory segment: the worker creates it, and the
# consumer, unpickling, asks the worker's resource-sharer thread for the file descriptor over a socket. That
# round trip waits for the worker process to be scheduled and for its GIL, which the worker holds while it
# reads and decodes the next batches: milliseconds per batch on a busy host (benchmarks/RESULTS.md), even for
# a batch of 32 labels. Small tensors therefore travel inside the queue message itself (a copy of a
# few KiB, no second process involved); big ones keep torch's shared memory, where one descriptor is cheaper
# than copying the bytes through a pipe.
INLINE_MAX_BYTES = 64 << 10


def _rebuild_inline(data: bytes, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _reduce_tensor(t: torch.Tensor) -> tuple:
    from torch.multiprocessing.reductions import reduce_tensor

    if (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
            and not t.is_quantized and t.nbytes <= INLINE_MAX_BYTES):
        raw = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        return _rebuild_inline, (raw.numpy().tobytes(), t.dtype, t.shape)
    return reduce_tensor(t)


def _inline_small_tensors() -> None:
    # Registered in the worker process only (the one that pickles batches); the consumer just unpickles.
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(torch.Tensor, _reduce_tensor)


def _worker_init(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    # A preemption sends SIGTERM to every process of the job (its group, or its whole tree), workers too.
    # A worker dying of it makes the training process raise instead of checkpointing, so workers take
    # SIGTERM only from their parent (the loader's own shutdown: multiprocessing terminates its workers at
    # exit) and ignore everyone else's; the trainer then checkpoints and shuts them down, or the stop's
    # SIGKILL ends them. Who sent a signal is only known to sigwaitinfo, hence the blocked signal and the
    # thread that waits for it (threads started later inherit the mask).
    _inline_small_tensors()
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_take_sigterm, args=(parent,), name="loader-sigterm", daemon=True).start()
    if user_init is not None:
        user_init(worker_id)


def _take_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(128 + signal.SIGTERM)  # as the default action would have ended it


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader with volume-friendly defaults and a resumable position.

    Defaults: 2 workers that persist across epochs (no re-fork and cold thread pools each epoch), 4
    batches prefetched per worker, pinned memory when CUDA is available. Tensors of up to 64 KiB
    (labels, indices, lengths) come back inside the worker's message instead of through a shared-memory
    segment per tensor (see INLINE_MAX_BYTES). Any other torch DataLoader
    argument passes through. With a VolumeDataset, `state_dict()` / `load_state_dict()` / `set_epoch()`
    carry the dataset position; iterating past the end of an epoch moves to the next one.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 32, num_workers: int = 2,
                 collate_fn: Callable | None = None, *, pin_memory: bool | None = None,
                 persistent_workers: bool | None = None, prefetch_factor: int | None = None,
                 drop_last: bool = False, **kwargs: Any):
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        if prefetch_factor is None and num_workers > 0:
            prefetch_factor = 4
        # Workers outlive a preemption's SIGTERM until the trainer has checkpointed (see _worker_init).
        kwargs["worker_init_fn"] = functools.partial(_worker_init, kwargs.get("worker_init_fn"))
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
                         pin_memory=pin_memory, persistent_workers=persistent_workers,
                         prefetch_factor=prefetch_factor, drop_last=drop_last, **kwargs)
        self._volume = dataset if hasattr(dataset, "_begin") else None
        if self._volume is not None and num_workers > 0:
            # Persistent workers keep their copy of the dataset; the per-epoch spec reaches them only
            # through memory shared before they start.
            self._volume._spec.share(multiprocessing)

    def __iter__(self) -> Iterator[Any]:
        if self._volume is None:
            return super().__iter__()
        return self._tracked()

    def _tracked(self) -> Iterator[Any]:
        ds = self._volume
        ds._workers = max(self.num_workers, 1)  # a ParquetDataset's delivery order depends on it
        block = self.batch_size or 1
        # Paths (no transform) are read by the consumer later: keep the files of every batch a worker may
        # have queued pinned, so eviction cannot remove one before it is read.
        trail = block * ((self.prefetch_factor or 0) + 2)
        remaining = ds._begin(block, trail)
        spec = ds._spec.get()
        delivered = 0
        for batch in super().__iter__():
            delivered = min(remaining, delivered + block)
            ds._advance(spec["start"], delivered, spec["world"])
            yield batch
        ds._end_epoch()

    def _need_volume(self) -> Any:
        if self._volume is None:
            raise TypeError("state_dict/load_state_dict/set_epoch need a VolumeDataset")
        return self._volume

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its shuffle); the current epoch is kept where it is, for resumed loops."""
        self._need_volume().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """Plain ints: epoch, samples consumed globally (all ranks), seed, num_files, world_size."""
        return self._need_volume().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields exactly the rest of the saved epoch."""
        self._need_volume().load_state_dict(state)
