"""Checkpoint I/O under `runtime.checkpoint.manager`: DCP storage for a slow shared volume.

- `VolumeWriter` writes each rank's DCP files on local disk first, then moves them onto the volume (a rename
  when both are on one filesystem, else a copy), fsyncs them, and only then commits ``.metadata`` (tmp +
  fsync + rename + directory fsync). A directory without a committed ``.metadata`` is not a checkpoint.
- `VolumeReader` reads a checkpoint and can `validate()` it cheaply first (metadata unpickles, every data
  file it names exists and is long enough), so torn checkpoints are skipped before any tensor is touched.

The stager that keeps the save cheap for the training loop is in `runtime.checkpoint.stage`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import tempfile
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path

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
