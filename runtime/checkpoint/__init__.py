"""Checkpoints: DCP checkpoint/resume for training jobs (`manager`: CheckpointManager, CheckpointConfig;
`trainstate`: TrainState), the volume writer and reader (`io`) and the host staging arena (`stage`).
`from runtime.checkpoint import CheckpointManager, TrainState` is the documented path."""

from __future__ import annotations

from runtime.checkpoint.manager import CheckpointConfig, CheckpointManager, TrainState

__all__ = ["CheckpointConfig", "CheckpointManager", "TrainState"]
