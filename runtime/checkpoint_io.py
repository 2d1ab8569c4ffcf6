"""Checkpoint I/O under `runtime.checkpoint`: DCP storage for a slow shared volume, and a low-stall stager.

- `VolumeWriter` writes each rank's DCP files on local disk first, then moves them onto the volume (a rename
  when both are on one filesystem, else a copy), fsyncs them, and only then commits ``.metadata`` (tmp +
  fsync + rename + directory fsync). A directory without a committed ``.metadata`` is not a checkpoint.
- `VolumeReader` reads a checkpoint and can `validate()` it cheaply first (metadata unpickles, every data
  file it names exists and is long enough), so torn checkpoints are skipped before any tensor is touched.
- `SnapshotStager` is the part that keeps `CheckpointManager.maybe_save` cheap for the training loop. The
  out-of-the-box async path copies the whole state to fresh CPU memory before returning (about half of a
  torch.save). Here the caller only copies what the forward/backward pass may change (buffers, RNG, loader
  position: small) and hands the big tensors (parameters and optimizer state, which only
  ``optimizer.step()`` mutates) to a background thread that copies them into buffers reused across saves
  (pinned on CUDA). The manager blocks the next ``optimizer.step()`` until that copy is done, so the copy
  overlaps the next forward/backward instead of stalling the loop.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from runtime import faults
from runtime.errors import CheckpointError

METADATA = ".metadata"


def fsync_dir(path: Path) -> None:
    """Make a rename or new file in `path` durable (no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def default_stage_root() -> Path:
    """Local scratch for staged checkpoint files: $AUTORESEARCH_CKPT_STAGE or the system temp dir."""
    return Path(os.environ.get("AUTORESEARCH_CKPT_STAGE") or tempfile.gettempdir()) / "autoresearch-ckpt-stage"


def sweep_stage(root: Path | None = None) -> None:
    """Remove staging dirs left by processes that died mid-save (their names carry the writer's pid)."""
    root = root or default_stage_root()
    for entry in root.iterdir() if root.is_dir() else ():
        parts = entry.name.rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def lower_this_thread(nice: int) -> None:
    """Give the calling thread `nice` more niceness (Linux schedules threads one by one; elsewhere a no-op).

    For the save's background threads: on a host whose cores the training already keeps busy, every
    CPU-second they take is taken from the training steps; niced, they run mostly when a core is idle."""
    if nice <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False


def _publish(src: Path, dst: Path, sync: bool) -> None:
    # A rename is atomic and free on one filesystem; across filesystems copy to a tmp name and rename so a
    # reader never sees half a file under the final name.
    if _same_filesystem(src.parent, dst.parent):
        os.replace(src, dst)
        return
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        shutil.copyfileobj(fin, fout, length=16 << 20)
        if sync:
            fout.flush()
            os.fsync(fout.fileno())
    os.replace(tmp, dst)
    src.unlink(missing_ok=True)


class VolumeWriter(FileSystemWriter):
    """DCP StorageWriter for a checkpoint dir on a slow shared volume: stage locally, publish, commit last.

    `device`: the CUDA device of the rank, made current in the thread that writes (see `write_data`).
    `nice`: added to the writing thread's niceness (see `lower_this_thread`); for async saves only.
    `step` only serves fault injection (``checkpoint@STEP:crash`` in AUTORESEARCH_FAULTS kills the process
    after the data is published and before the metadata commit, the worst moment to die).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        stage_dir: str | os.PathLike | None = None,
        thread_count: int = 1,
        sync_files: bool = True,
        step: int | None = None,
        device: int | None = None,
        nice: int = 0,
    ) -> None:
        self.volume_path = Path(path)
        self.nice = nice
        self.device = device
        self.stage_root = Path(stage_dir) if stage_dir else default_stage_root()
        self.step = step
        super().__init__(self._new_stage_path(), single_file_per_rank=True, sync_files=sync_files,
                         thread_count=thread_count, overwrite=True)

    def _new_stage_path(self) -> Path:
        return self.stage_root / f"{self.volume_path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.volume_path = Path(checkpoint_id)
        super().reset(None)
        self.path = self._new_stage_path()

    def write_data(self, plan, planner) -> Future:
        lower_this_thread(self.nice)  # an async save's upload thread, made for this save alone
        if self.device is not None:
            # Async saves write from an upload thread, whose current device is 0; DCP's writer asks CUDA for
            # the current stream there: without this, a rank > 0 makes a context on GPU 0.
            torch.cuda.set_device(self.device)
        Path(self.path).mkdir(parents=True, exist_ok=True)
        fut = super().write_data(plan, planner)  # FileSystemWriter writes synchronously; the future is done
        results = fut.wait()
        self.volume_path.mkdir(parents=True, exist_ok=True)
        for name in sorted({wr.storage_data.relative_path for wr in results}):
            _publish(Path(self.path) / name, self.volume_path / name, self.sync_files)
        if self.sync_files:
            fsync_dir(self.volume_path)
        shutil.rmtree(self.path, ignore_errors=True)
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        if self.step is not None and faults.injected(f"checkpoint@{self.step}", "crash"):
            os.kill(os.getpid(), signal.SIGKILL)
        self.path = self.volume_path  # the metadata goes straight to the volume, tmp + rename (atomic)
        super().finish(metadata, results)
        if self.sync_files:
            fsync_dir(self.volume_path)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.volume_path


class VolumeReader(FileSystemReader):
    """DCP StorageReader for a checkpoint dir on the volume, with a cheap completeness check."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.volume_path = Path(path)

    def validate(self) -> Metadata:
        """Raise CheckpointError unless the metadata is committed and unpickles, and every data file it
        references exists and is at least as long as the bytes it should hold."""
        meta_path = self.volume_path / METADATA
        try:
            with open(meta_path, "rb") as fh:
                metadata = pickle.load(fh)
        except FileNotFoundError:
            raise CheckpointError(f"{self.volume_path}: no committed {METADATA}") from None
        except Exception as exc:  # a torn or foreign metadata file may raise anything while unpickling
            raise CheckpointError(f"{self.volume_path}: unreadable {METADATA}: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self.volume_path}: {METADATA} is not DCP metadata")
        need: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for name, size in need.items():
            try:
                have = (self.volume_path / name).stat().st_size
            except OSError:
                raise CheckpointError(f"{self.volume_path}: data file {name} is missing") from None
            if have < size:
                raise CheckpointError(f"{self.volume_path}: data file {name} is truncated ({have} < {size} bytes)")
        return metadata


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
        self.by_waiter = 0  # copies the training thread made itself

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
                copies.by_waiter += 1
                try:
                    copies.run(i)
                except Exception:
                    break  # recorded: join() raises it, and so does the background thread, failing the save
        copies.join()

    def synchronize_staging(self) -> None:
        self.wait()

    def close(self) -> None:
        """Stop the staging thread and free (unpin) the host buffer."""
        self._pool.shutdown(wait=True)
        if self._arena is not None:
            self._arena.release()
            self._arena = None
