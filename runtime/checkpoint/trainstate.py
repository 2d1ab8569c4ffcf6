"""TrainState: what a resumed run needs to continue bitwise (model, optimizer, loader position, RNG, step), as one
DCP `Stateful` that `runtime.checkpoint.manager.CheckpointManager` saves and loads."""

from __future__ import annotations

import logging
import pickle
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["TrainState"]

log = logging.getLogger("autoresearch.runtime.checkpoint")


def rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class TrainState(Stateful):
    """Everything a resumed run needs to continue bitwise: model, optimizer, loader position, RNG, step.

    Model and optimizer go through DCP's get_state_dict/set_state_dict (so DDP/compiled wrappers and
    parameter FQNs are handled). Per-rank state (torch/CUDA/numpy/python RNG and `loader.state_dict()`) is
    pickled into one uint8 tensor per rank, because DCP writes non-tensor values from rank 0 only.
    `loader` is anything with state_dict()/load_state_dict().
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 loader: Any = None, *, step: int = 0) -> None:
        self.model, self.optimizer, self.loader, self.step = model, optimizer, loader, step
        self._load_blob: int | None = None  # blob size to load into; -1: the checkpoint has none for us

    @property
    def _blob_key(self) -> str:
        return f"rank{rank()}"

    def _blob(self) -> torch.Tensor:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                 # This rank's device only: get_rng_state_all() visits (and so makes a context on) every GPU.
                 "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
                 "loader": self.loader.state_dict() if self.loader is not None else None}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def state_dict(self) -> dict[str, Any]:
        """The state to save (or, between `prepare_load` and `load_state_dict`, the tensors to load into)."""
        model_sd, optim_sd = get_state_dict(self.model, [self.optimizer] if self.optimizer else [])
        sd: dict[str, Any] = {"model": model_sd, "step": torch.tensor(self.step, dtype=torch.int64)}
        if self.optimizer is not None:
            sd["optim"] = optim_sd
        if self._load_blob is None:
            sd[self._blob_key] = self._blob()
        elif self._load_blob >= 0:
            sd[self._blob_key] = torch.empty(self._load_blob, dtype=torch.uint8)
        return sd

    def prepare_load(self, metadata: Any, prefix: str) -> None:
        """Size the per-rank blob from the checkpoint's metadata before DCP loads into `state_dict()`;
        `metadata=None` cancels (back to saving mode)."""
        if metadata is None:
            self._load_blob = None
            return
        entry = metadata.state_dict_metadata.get(f"{prefix}.{self._blob_key}")
        self._load_blob = int(entry.size[0]) if entry is not None else -1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a loaded state dict (DCP calls this after filling `state_dict()`'s tensors)."""
        set_state_dict(self.model, [self.optimizer] if self.optimizer else [],
                       model_state_dict=state_dict["model"], optim_state_dict=state_dict.get("optim", {}))
        self.step = int(state_dict["step"])
        blob = state_dict.get(self._blob_key)
        self._load_blob = None
        if blob is None:
            log.warning("checkpoint has no RNG/loader state for %s (world size changed?)", self._blob_key)
            return
        state = pickle.loads(blob.numpy().tobytes())
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if state["cuda"] is not None and torch.cuda.is_available():
            if isinstance(state["cuda"], (list, tuple)):  # written before per-device states: one per GPU
                torch.cuda.set_rng_state_all(state["cuda"])
            else:
                torch.cuda.set_rng_state(state["cuda"])
        if self.loader is not None and state["loader"] is not None:
            self.loader.load_state_dict(state["loader"])
