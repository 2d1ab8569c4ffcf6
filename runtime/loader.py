"""DataLoader: torch's DataLoader with defaults that keep compute fed from a VolumeDataset, and a position
(`state_dict()`) that a checkpoint can carry to resume the data exactly.

The position is counted here, in the training process, from batches actually delivered: workers run
ahead (prefetch), so only the consumer knows what has been used. Because the dataset deals each rank's
order to workers in blocks of `batch_size`, and torch collects one batch from each worker in turn, the
k-th delivered batch is always samples [k*B, (k+1)*B) of the rank's order, whatever the worker count.
"""

from __future__ import annotations

import multiprocessing.sharedctypes  # noqa: F401  (RawArray for the shared iteration spec)
from typing import Any, Callable, Iterator

import torch
import torch.utils.data


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader with volume-friendly defaults and a resumable position.

    Defaults: 2 workers that persist across epochs (no re-fork and cold thread pools each epoch), 4
    batches prefetched per worker, pinned memory when CUDA is available. Any other torch DataLoader
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
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
                         pin_memory=pin_memory, persistent_workers=persistent_workers,
                         prefetch_factor=prefetch_factor, drop_last=drop_last, **kwargs)
        self._volume = dataset if hasattr(dataset, "_begin") else None
        if self._volume is not None:
            self._volume._managed = True
            if num_workers > 0:
                # Persistent workers keep their copy of the dataset; the per-epoch spec reaches them only
                # through memory shared before they start.
                self._volume._spec.share(multiprocessing)

    def __iter__(self) -> Iterator[Any]:
        if self._volume is None:
            return super().__iter__()
        return self._tracked()

    def _tracked(self) -> Iterator[Any]:
        ds = self._volume
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
