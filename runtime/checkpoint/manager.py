"""Checkpoint and resume with torch.distributed.checkpoint (DCP): `TrainState` and `CheckpointManager`.

Layout: ``<dir>/step_0000000100/`` holds one DCP checkpoint; it counts only once its ``.metadata`` is
committed (see `runtime.checkpoint.io.VolumeWriter`). The newest `keep_last` complete checkpoints are kept;
the only loadable one is never deleted. Typical loop::

    state = TrainState(model, optimizer, loader)
    ckpt = CheckpointManager(ctx.checkpoint_dir, keep_last=2, interval_steps=100)
    start = ckpt.load_latest(state) or 0
    for step in range(start, total):
        ...  # forward, backward, optimizer.step()
        state.step = step + 1
        ckpt.maybe_save(step + 1, state)
        if ctx.should_stop():
            ckpt.save_now(step + 1, state)
            ctx.exit_preempted()
    ckpt.close()

What `maybe_save` costs the loop: it snapshots the small state (buffers, RNG, loader position, step) and
returns; parameters and optimizer state are copied by a background thread into host buffers kept for the
whole run (one extra copy of that state in host memory, exact-sized, pinned on CUDA, freed by `close()`; with
several ranks only rank 0 holds the replicated part), and the next ``optimizer.step()``
waits until the copy is done (a step pre-hook), making the copies the background thread has not started
itself (so it never waits longer than a synchronous copy would take). Code that changes parameters any other
way before that step must call `wait_staged()` first. On a CPU host whose cores the training keeps busy,
`background_nice` lowers the background threads' priority (see README, Performance). The upload then runs in
the background; the next save waits for it, and a failed one raises CheckpointError from the next
`maybe_save`/`save_now`/`wait`.

With several ranks, build the manager after `init_distributed()` and call its methods at the same points on
every rank (they are collective). It creates its own gloo group so background uploads never interleave with
the training loop's collectives. If a checkpoint passes validation everywhere but then fails to load on one
rank only, DCP's collectives may not recover; validation (metadata + file sizes) is voted on first for that
reason. Single-device and DDP models are what this is tested with; sharded (FSDP2/DTensor) state is not.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from runtime.checkpoint.io import METADATA, VolumeReader, VolumeWriter, sweep_stage
from runtime.checkpoint.interval import TimedInterval
from runtime.checkpoint.stage import SnapshotStager
from runtime.checkpoint.trainstate import TrainState, rank as _rank
from runtime.errors import CheckpointError

__all__ = ["CheckpointConfig", "CheckpointManager", "TrainState", "VolumeReader", "VolumeWriter"]

log = logging.getLogger("autoresearch.runtime.checkpoint")
# DCP warns on every single-process save/load; single-process is a normal case here, not a mistake.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)", category=UserWarning)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _cuda_device() -> int | None:
    """The rank's current CUDA device, for the save's own threads (None when CUDA is not in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def _last_line(exc: BaseException) -> str:
    """The cause of a failed save in one line (DCP's exceptions carry every rank's traceback; the cause, such
    as "No space left on device", is their last line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


@dataclass(frozen=True)
class CheckpointConfig:
    """How often to save (every `interval_steps` steps, or about every `interval_minutes` of training), how many
    to keep, and whether saves overlap training."""

    keep_last: int = 2
    interval_steps: int = 100
    interval_minutes: float | None = None
    async_save: bool = True
    stage_dir: str | None = None  # local scratch for VolumeWriter; None: $AUTORESEARCH_CKPT_STAGE or /tmp
    # Niceness added to the background copy and upload threads: on a host whose cores the training keeps
    # busy (CPU training), the save's CPU work then waits for idle cores instead of slowing the steps.
    background_nice: int = 0

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        if self.interval_steps < 1:
            raise ValueError("interval_steps must be >= 1")
        if self.interval_minutes is not None and not self.interval_minutes > 0:
            raise ValueError("interval_minutes must be > 0")
        if not 0 <= self.background_nice <= 19:
            raise ValueError("background_nice must be between 0 and 19")


def _as_dict(state: Any) -> dict[str, Any]:
    return dict(state) if isinstance(state, Mapping) else {"train": state}


class CheckpointManager:
    """Periodic async saves, synchronous saves on preemption, retention, and loading the latest good one."""

    def __init__(self, directory: str | Path, keep_last: int = 2, interval_steps: int = 100,
                 async_save: bool = True, *, stage_dir: str | None = None, background_nice: int = 0,
                 interval_minutes: float | None = None) -> None:
        """`interval_minutes`: save about that often instead of every `interval_steps` steps (rank 0's clock
        decides, at steps agreed in advance, so every rank saves the same step)."""
        self.config = CheckpointConfig(keep_last, interval_steps, interval_minutes, async_save, stage_dir,
                                       background_nice)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # A group of our own: the upload thread's collectives must not interleave with the loop's.
        self._pg = dist.new_group(backend="gloo") if distributed else None
        # A time-based interval decides on a group of its own (runtime.checkpoint.interval).
        self._timed = TimedInterval(interval_minutes, distributed) if interval_minutes else None
        self._stager = SnapshotStager(group=self._pg, nice=background_nice)
        sweep_stage(Path(stage_dir) if stage_dir else None)
        self._inflight: Future | None = None  # the save in flight: done once committed and retention ran
        self._hooks: dict[int, Any] = {}
        self.stats = {"saves": 0, "blocked_s": 0.0, "staging_wait_s": 0.0, "last_call_s": 0.0}

    # -- listing -----------------------------------------------------------------------------------------

    def path_for(self, step: int) -> Path:
        """The directory of the checkpoint for `step`."""
        return self.dir / f"step_{step:010d}"

    def _all_steps(self) -> list[int]:
        steps = []
        for p in self.dir.iterdir() if self.dir.exists() else ():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def complete_steps(self) -> list[int]:
        """Steps whose metadata is committed, oldest first (not yet validated)."""
        return [s for s in self._all_steps() if (self.path_for(s) / METADATA).exists()]

    # -- saving ------------------------------------------------------------------------------------------

    def _guard(self, state: dict[str, Any]) -> None:
        """Tell the stager which tensors may be copied late, and hold their optimizer until it has."""
        deferred: set[int] = set()
        for obj in state.values():
            opt = getattr(obj, "optimizer", None)
            model = getattr(obj, "model", None)
            if opt is None or model is None:
                continue
            deferred.update(p.untyped_storage().data_ptr() for p in model.parameters())
            for pstate in opt.state.values():
                deferred.update(v.untyped_storage().data_ptr() for v in pstate.values() if torch.is_tensor(v))
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(lambda *_: self.wait_staged())
        self._stager.deferred = deferred

    def wait_staged(self) -> None:
        """Block until the in-flight save has copied the parameters and optimizer state (called before every
        optimizer.step() by a hook; call it yourself before mutating parameters any other way)."""
        t0 = time.perf_counter()
        try:
            self._stager.wait()
        except Exception:
            pass  # a failed copy fails the save, which wait() reports; it must not break optimizer.step()
        self.stats["staging_wait_s"] += time.perf_counter() - t0

    def maybe_save(self, step: int, state: Any) -> bool:
        """Save when `step` is a positive multiple of interval_steps (or, with interval_minutes, when that much
        time has passed since the last save); True when a save was started."""
        if step <= 0 or not self._due(step):
            return False
        if not self.config.async_save:
            self.save_now(step, state)
            return True
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight: its upload owns the staging buffers
        if self._agree((self.path_for(step) / METADATA).exists()):
            return False
        sd = _as_dict(state)
        self._guard(sd)
        self._stager.step = step
        writer = VolumeWriter(self.path_for(step), stage_dir=self.config.stage_dir, step=step, device=_cuda_device(),
                              nice=self.config.background_nice)
        resp = dcp.async_save(
            sd, storage_writer=writer,
            process_group=self._pg, no_dist=self._pg is None, async_stager=self._stager)
        # Retention runs in the upload thread before the save counts as done, so wait() sees a tidy dir.
        self._inflight = done = Future()

        def finished(upload: Future) -> None:
            try:
                upload.result()
                self._retain()
                done.set_result(step)
            except BaseException as exc:  # surfaced by wait() on the training thread
                done.set_exception(exc)

        resp.upload_completion.add_done_callback(finished)
        self._account(t0)
        return True

    def _due(self, step: int) -> bool:
        """Whether `step` is a save step: a multiple of `interval_steps`, or what the timed interval says."""
        if self._timed is None:
            return step % self.config.interval_steps == 0
        return self._timed.due(step)

    def save_now(self, step: int, state: Any) -> None:
        """Save `step` synchronously (for preemption: returns once the checkpoint is committed)."""
        t0 = time.perf_counter()
        self.wait()
        if not self._agree((self.path_for(step) / METADATA).exists()):
            try:
                dcp.save(_as_dict(state), process_group=self._pg, no_dist=self._pg is None,
                         storage_writer=VolumeWriter(self.path_for(step), stage_dir=self.config.stage_dir,
                                                     step=step))
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException: a loop would miss it
                self._drop_torn(step)
                raise CheckpointError(f"checkpoint save of step {step} failed: {_last_line(exc)}") from exc
            self._retain()
        self._account(t0)

    def _drop_torn(self, step: int) -> None:
        """Remove a save that failed before its `.metadata` was committed (on a full disk its files are space
        the next save needs); the previous complete checkpoint is untouched and stays the one loaded."""
        path = self.path_for(step)
        if _rank() == 0 and not (path / METADATA).exists():
            shutil.rmtree(path, ignore_errors=True)

    def _account(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.stats["saves"] += 1
        self.stats["blocked_s"] += dt
        self.stats["last_call_s"] = dt

    @property
    def staged_bytes(self) -> int:
        """Host memory this rank holds for staging saves (exact-sized; 0 before the first save and after
        `close()`; on ranks > 0 of a DDP job only their own small entries)."""
        return self._stager.staged_bytes

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and is not committed yet."""
        return self._inflight is not None and not self._inflight.done()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise CheckpointError if it failed."""
        done, self._inflight = self._inflight, None
        if done is None:
            return
        try:
            done.result()
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"checkpoint save failed: {_last_line(exc)}") from exc

    # -- retention ---------------------------------------------------------------------------------------

    def _loadable(self, step: int) -> bool:
        try:
            VolumeReader(self.path_for(step)).validate()
            return True
        except CheckpointError:
            return False

    def _retain(self) -> None:
        if _rank() != 0:
            return  # one deleter on a shared volume
        complete = self.complete_steps()
        keep = set(complete[-self.config.keep_last:])
        if not any(self._loadable(s) for s in keep):
            older = [s for s in reversed(complete) if s not in keep and self._loadable(s)]
            keep.update(older[:1])  # never delete the only loadable checkpoint
        newest = complete[-1] if complete else None
        for step in self._all_steps():
            # Incomplete dirs newer than the newest complete one may be a save in progress: leave them.
            if step in keep or newest is None or step > newest:
                continue
            path = self.path_for(step)
            (path / METADATA).unlink(missing_ok=True)  # uncommit first: a half-deleted dir stays incomplete
            shutil.rmtree(path, ignore_errors=True)

    # -- loading -----------------------------------------------------------------------------------------

    def _agree(self, value: Any) -> Any:
        if self._pg is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        if self._pg is None:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
        return not flag.item()

    def load_latest(self, state: Any) -> int | None:
        """Load the newest complete, valid checkpoint into `state`; return its step, or None if none loads.

        Torn or corrupt checkpoints are skipped with a warning and the previous complete one is tried. With
        several ranks, rank 0's listing and a vote after validation keep every rank on the same checkpoint.
        """
        self.wait()
        sd = _as_dict(state)
        for step in self._agree(list(reversed(self.complete_steps()))):
            reader = VolumeReader(self.path_for(step))
            try:
                metadata, err = reader.validate(), None
            except CheckpointError as exc:
                metadata, err = None, exc
            if not self._all_ok(err is None):
                log.warning("skipping checkpoint step %d: %s", step, err or "invalid on another rank")
                continue
            for key, obj in sd.items():
                if hasattr(obj, "prepare_load"):
                    obj.prepare_load(metadata, key)
            try:
                dcp.load(sd, storage_reader=reader, process_group=self._pg, no_dist=self._pg is None)
            except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
                log.warning("skipping checkpoint step %d: load failed: %s", step, exc)
                self._cancel_load(sd)
                continue
            return step
        self._cancel_load(sd)
        return None

    @staticmethod
    def _cancel_load(sd: dict[str, Any]) -> None:
        for key, obj in sd.items():
            if hasattr(obj, "prepare_load"):
                obj.prepare_load(None, key)

    def close(self) -> None:
        """Wait for the save in flight, remove the optimizer hooks, free the staging buffers."""
        self.wait()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._stager.close()
