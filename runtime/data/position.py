"""Where a dataset is in its epochs, shared by `VolumeDataset` and `ShardDataset`: the epoch and the samples
consumed by all ranks, saved in a `TrainState` and restored so that a resumed job continues at the next unseen
sample. The `DataLoader` (`runtime.data.loader`) drives it through `_begin`, `_advance` and `_end_epoch`."""

from __future__ import annotations

import warnings
from typing import Any, Iterator

from torch.utils.data import IterableDataset, get_worker_info

from runtime.data.loader import _dist_rank_world, _Spec, rank_length, samples_per_rank, worker_positions

STATE_VERSION = 1


class EpochPosition(IterableDataset):
    """The position half of a resumable dataset. A subclass sets `config` (with `seed` and `drop_last`) and
    says how many samples an epoch has (`_samples`), under which name its state records that count
    (`COUNT_KEY`: a different count on resume means a different order) and its name for errors (`KIND`); for
    iteration, this rank's order of an epoch's sample indices (`_rank_order`), what a sample index stands for
    (`_item`) and how items become samples (`_stream`)."""

    COUNT_KEY = "num_samples"
    KIND = "dataset"
    config: Any

    def _init_position(self) -> None:
        self._epoch = 0
        self._consumed = 0  # global samples consumed in this epoch (all ranks)
        self._spec = _Spec()  # set by runtime.data.loader.DataLoader, which then keeps the position

    def _samples(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        """Samples this rank gets per epoch."""
        return samples_per_rank(self._samples(), _dist_rank_world()[1], self.config.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch` (a new order from (seed, epoch)); a no-op for the current epoch, so a resumed
        training loop that calls set_epoch(start_epoch) continues mid-epoch instead of restarting it."""
        if epoch != self._epoch:
            self._epoch, self._consumed = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        """The position as plain ints: epoch and samples consumed globally, plus what must match to resume."""
        return {"version": STATE_VERSION, "epoch": self._epoch, "samples_consumed": self._consumed,
                "seed": self.config.seed, self.COUNT_KEY: self._samples(), "world_size": _dist_rank_world()[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`: the rest of that epoch is exactly the samples not yet consumed."""
        try:
            epoch, consumed = int(state["epoch"]), int(state["samples_consumed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a {self.KIND} state: {state!r}") from exc
        for key, now in (("seed", self.config.seed), (self.COUNT_KEY, self._samples())):
            if key in state and int(state[key]) != now:
                warnings.warn(f"resuming data with {key}={now}, saved with {state[key]}: the order differs, "
                              "so the rest of the epoch is not exactly the unseen samples", stacklevel=2)
        self._epoch, self._consumed = epoch, consumed

    # -- iteration -------------------------------------------------------------------------------------------
    def _rank_order(self, spec: dict[str, int]) -> list[int]:
        raise NotImplementedError

    def _item(self, index: int) -> Any:
        raise NotImplementedError

    def _stream(self, items: list, trail: int, hold_at_end: bool) -> Iterator[Any]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        """This rank's and DataLoader worker's part of the epoch, as the loader's spec says; iterated without a
        loader, the dataset keeps its own position."""
        spec, info = self._spec.get(), get_worker_info()
        track = spec is None and info is None  # without a loader, iterating here keeps its own position
        if spec is None:
            rank, world = _dist_rank_world()
            spec = dict(epoch=self._epoch, start=self._consumed, block=1, trail=1, rank=rank, world=world)
        order = self._rank_order(spec)
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        positions = worker_positions(len(order), max(spec["block"], 1), worker, workers)
        delivered = 0
        for item in self._stream([self._item(order[p]) for p in positions], spec["trail"],
                                 hold_at_end=info is not None):
            delivered += 1
            if track:  # counted when handed over, as the loader counts delivered batches
                self._advance(spec["start"], delivered, spec["world"])
            yield item
        if track:
            self._end_epoch()

    # -- hooks for runtime.data.loader.DataLoader ----------------------------------------------------------
    def _begin(self, block: int, trail: int) -> int:
        """Publish this iteration's spec for the workers; returns the samples this rank will deliver."""
        rank, world = _dist_rank_world()
        self._spec.set(epoch=self._epoch, start=self._consumed, block=block, trail=trail, rank=rank, world=world)
        return rank_length(self._samples(), self._consumed, rank, world, self.config.drop_last)

    def _advance(self, start: int, delivered: int, world: int) -> None:
        self._consumed = start + delivered * world

    def _end_epoch(self) -> None:
        self._epoch, self._consumed = self._epoch + 1, 0
