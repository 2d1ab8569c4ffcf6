"""Reusable test support: real stand-ins for the edges of the system (a slow FUSE volume in `slowfs`) and
datasets of small files whose content names them, so order, duplicates and torn copies are visible."""

from __future__ import annotations

import random
from pathlib import Path


def write_files(root: Path, count: int, size: int = 2048, *, subdirs: int = 3, prefix: str = "") -> list[str]:
    """Write `count` files whose first 8 bytes are their index; returns their relative paths, sorted.

    The rest of each file is pseudo-random bytes fixed by the index, so a torn or mixed-up copy shows.
    """
    rels = []
    for i in range(count):
        rel = f"d{i % subdirs}/{prefix}{i:05d}.bin" if subdirs else f"{prefix}{i:05d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(file_bytes(i, size))
        rels.append(rel)
    return sorted(rels)


def file_bytes(index: int, size: int) -> bytes:
    """The expected content of file `index` written by write_files."""
    head = f"{index:08d}".encode()
    return (head + random.Random(index).randbytes(max(size - len(head), 0)))[:size]


def sample_index(path: str) -> int:
    """The index stored in a file written by write_files (a picklable transform for worker processes)."""
    with open(path, "rb") as fh:
        return int(fh.read(8))


def checked_index(path: str) -> int:
    """Like sample_index, but verifies every byte, so a torn cached file fails the test."""
    data = Path(path).read_bytes()
    index = int(data[:8])
    assert data == file_bytes(index, len(data)), f"{path} does not hold file {index} intact"
    return index
