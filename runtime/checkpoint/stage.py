"""Checkpoint staging under `runtime.checkpoint.manager`: `SnapshotStager`, a DCP AsyncStager with a low stall.

`SnapshotStager` is the part that keeps `CheckpointManager.maybe_save` cheap for the training loop. The
out-of-the-box async path copies the whole state to fresh CPU memory before returning (about half of a
torch.save). Here the caller only copies what the forward/backward pass may change (buffers, RNG, loader
position: small) and hands the big tensors (parameters and optimizer state, which only
``optimizer.step()`` mutates) to a background thread that copies them into buffers reused across saves
(pinned on CUDA). The manager blocks the next ``optimizer.step()`` until that copy is done, so the copy
overlaps the next forward/backward instead of stalling the loop; on CPU, the copies the background thread
has not started by then are made by the waiting thread itself (`_Copies`), so that wait never exceeds a
synchronous copy.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from runtime import faults
from runtime.checkpoint.io import lower_this_thread
from runtime.errors import CheckpointError


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_ALIGN = 64  # bytes: every staged tensor starts on a cache line (and any dtype's alignment)


class HostArena:
    """One host buffer of exactly the bytes a set of tensors needs (plus at most 63 bytes of alignment each),
    carved into one view per tensor. Pinned with cudaHostRegister when the sources live on CUDA, so it is
    page-locked at its exact size: the caching host allocator behind ``pin_memory=True`` rounds every block
    up to a power of two and keeps it cached after use. `release()` unpins and frees it."""

    def __init__(self, layout: tuple[tuple[str, torch.Size, torch.dtype], ...], pin: bool) -> None:
        self.layout, offsets, total = layout, [], 0
        for _, shape, dtype in layout:
            offsets.append(total)
            n = shape.numel() * dtype.itemsize
            total += -(-n // _ALIGN) * _ALIGN
        self.nbytes = total
        self._flat = torch.empty(total, dtype=torch.uint8)
        self.pinned = False
        if pin and total:
            err = int(torch.cuda.cudart().cudaHostRegister(self._flat.data_ptr(), total, 0))
            if err:
                raise CheckpointError(f"pinning {total} bytes of staging memory failed (cudaError {err})")
            self.pinned = True
        self.views = {name: self._flat[o:o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                      for (name, shape, dtype), o in zip(layout, offsets)}

    def release(self) -> None:
        """Unpin and drop the buffer (the views must no longer be in use)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._flat.data_ptr())
            self.pinned = False
        self.views.clear()
        self._flat = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0


class _Copies:
    """The tensor copies of one stage(), taken one at a time by the background thread and, once the training
    thread needs them done (SnapshotStager.wait), by the training thread too. Whichever thread comes first
    gets the host buffers ready (`open`)."""

    def __init__(self, jobs: list, stealable: bool) -> None:
        self.jobs, self.stealable = jobs, stealable
        self._next = self._done = 0
        self._cond = threading.Condition()
        self._arena: HostArena | None = None
        self._stream = None
        self._error: BaseException | None = None

    def open(self, make_arena, stream=None) -> None:
        with self._cond:
            if self._arena is None:
                self._arena, self._stream = make_arena(), stream

    def untaken(self) -> bool:
        with self._cond:
            return self._next < len(self.jobs)

    def take(self) -> int | None:
        with self._cond:
            if self._next >= len(self.jobs):
                return None
            self._next += 1
            return self._next - 1

    def run(self, i: int) -> None:
        container, key, src, name = self.jobs[i]
        try:
            buf = self._arena.views[name]
            with torch.no_grad(), (torch.cuda.stream(self._stream) if self._stream is not None
                                   else contextlib.nullcontext()):
                buf.copy_(src, non_blocking=self._stream is not None)
            container[key] = buf
        except BaseException as exc:
            self._error = self._error or exc
            raise
        finally:
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    def join(self) -> None:
        """Wait until every copy taken by any thread has run (or been enqueued); re-raise the first failure."""
        with self._cond:
            self._cond.wait_for(lambda: self._done >= len(self.jobs))
        if self._error is not None:
            raise self._error


class SnapshotStager:
    """DCP AsyncStager: snapshot small state now, copy the big optimizer-owned tensors in the background.

    Set `deferred` to the storage pointers of tensors that nothing but ``optimizer.step()`` mutates before
    each `stage()`; everything else is copied synchronously. The caller must not mutate a deferred tensor
    until `wait()` returns (CheckpointManager enforces it with an optimizer step pre-hook). The host buffer
    (a `HostArena`, exact-sized, pinned on CUDA) is reused across saves while the layout stays the same, so
    only one staged state may be alive at a time (the manager keeps one in flight); `close()` frees it.

    With a process `group`, a rank stages only what it will write: a plain tensor that a lower rank also
    has is replicated (DDP), DCP writes one copy of it, and with the lower rank holding it that copy is
    the lower rank's; so rank 0 stages the replicated model and optimizer state and the other ranks only
    their own entries (their RNG/loader blobs), instead of every rank pinning a full copy.
    """

    _synchronize_after_execute = False

    def __init__(self, group: Any = None, nice: int = 0) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage",
                                        initializer=lower_this_thread, initargs=(nice,))
        self._arena: HostArena | None = None
        self._future: Future | None = None
        self._copies: _Copies | None = None
        self.deferred: set[int] = set()
        # The step being staged; only serves fault injection (``checkpoint@STEP:crash-staging`` stalls
        # halfway through the background copy, then SIGKILLs the process), like VolumeWriter's `step`.
        self.step: int | None = None
        self.group = group
        self.left_to_lower_ranks = 0  # tensors the last stage() left out (a lower rank writes them)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    @property
    def staged_bytes(self) -> int:
        """Bytes of host memory held for the background copies (0 when none is held)."""
        return self._arena.nbytes if self._arena is not None else 0

    def _lower_ranks_have(self, state_dict: dict[str, Any]) -> set[str]:
        if self.group is None:
            return set()
        import torch.distributed as dist

        mine: list[str] = []

        def paths(obj: Any, name: str) -> None:
            if type(obj) is torch.Tensor:
                mine.append(name)
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    paths(v, f"{name}.{k}")
            elif isinstance(obj, list):
                for k, v in enumerate(obj):
                    paths(v, f"{name}.{k}")

        paths(state_dict, "")
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        rank = dist.get_rank(self.group)
        return {p for lower in everyone[:rank] for p in lower}

    def stage(self, state_dict: dict[str, Any]) -> Future:
        """Return a Future of a CPU copy of `state_dict`; small parts are copied before returning."""
        # (container, key, source, buffer name): the slot is filled in the background, where the buffer is
        # also allocated the first time, so even the first save's page faults / pinning stay off this thread.
        jobs: list[tuple[Any, Any, torch.Tensor, str]] = []
        elsewhere = self._lower_ranks_have(state_dict)
        self.left_to_lower_ranks = 0

        def walk(obj: Any, name: str) -> Any:
            if isinstance(obj, torch.Tensor):
                return obj.detach().to("cpu", copy=True)
            if isinstance(obj, dict):
                out: Any = {}
                items = obj.items()
            elif isinstance(obj, list):
                out, items = [None] * len(obj), enumerate(obj)
            else:
                return copy.deepcopy(obj)  # tuples included: they hold no optimizer-owned tensors in practice
            for k, v in items:
                path = f"{name}.{k}"
                if type(v) is torch.Tensor and path in elsewhere and isinstance(out, dict):
                    self.left_to_lower_ranks += 1  # not staged, not in this rank's plan: a lower rank writes it
                elif type(v) is torch.Tensor and v.numel() and _storage_key(v) in self.deferred:
                    jobs.append((out, k, v, path))
                else:
                    out[k] = walk(v, path)
            return out

        staged = walk(state_dict, "")
        event = None
        if any(src.is_cuda for _, _, src, _ in jobs):
            event = torch.cuda.Event()
            event.record()  # the side stream must see the values as of now, not later kernels' writes
        crash_at = len(jobs) // 2 if self.step is not None and faults.injected(
            f"checkpoint@{self.step}", "crash-staging") else None
        # On CUDA the background thread only enqueues copies on its side stream (microseconds each): nothing
        # to take over. On CPU it does the copying, competing with the training compute for the cores.
        self._copies = _Copies(jobs, stealable=crash_at is None and event is None)
        self._future = self._pool.submit(self._copy, self._copies, event, staged, crash_at)
        return self._future

    def _arena_for(self, jobs) -> HostArena:
        layout = tuple((name, src.shape, src.dtype) for _, _, src, name in jobs)
        if self._arena is None or self._arena.layout != layout:
            if self._arena is not None:
                self._arena.release()  # exact sizes: a new layout gets a new buffer, not a bigger cached one
                self._arena = None
            self._arena = HostArena(layout, pin=any(src.is_cuda for _, _, src, _ in jobs))
        return self._arena

    def _copy(self, copies: _Copies, event, staged, crash_at=None):
        jobs, stream = copies.jobs, None
        if event is not None:
            # A new thread's current device is 0: set the tensors' device first, or this thread's first CUDA
            # call (and leaving a stream context) creates a context on GPU 0 for every rank.
            device = next(s.device for _, _, s, _ in jobs if s.is_cuda)
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device=device)
            stream.wait_event(event)
        copies.open(lambda: self._arena_for(jobs), stream)
        for i in iter(copies.take, None):
            if i == crash_at:  # stall as a big model's copy would, so the loop could run ahead; then die
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            copies.run(i)
        copies.join()  # copies the training thread took (see wait()) are finished or enqueued on `stream`
        if stream is not None:
            stream.synchronize()
        return staged

    def wait(self) -> None:
        """Block until the last `stage()` finished copying (re-raising its error). On CPU the calling thread
        makes whatever copies the background thread has not started itself: with the training loop stopped
        they run at full speed, so this blocks no longer than copying the rest synchronously would (what
        ``dcp.async_save``'s default stager does for the whole state on every save)."""
        copies = self._copies
        if copies is None or not copies.stealable:
            if self._future is not None:
                self._future.result()
            return
        if copies.untaken():
            copies.open(lambda: self._arena_for(copies.jobs))
            for i in iter(copies.take, None):
                with contextlib.suppress(Exception):  # recorded by run(): join() raises it; the save fails
                    copies.run(i)
        copies.join()

    def synchronize_staging(self) -> None:
        self.wait()

    def close(self) -> None:
        """Stop the staging thread and free (unpin) the host buffer."""
        self._pool.shutdown(wait=True)
        if self._arena is not None:
            self._arena.release()
            self._arena = None
