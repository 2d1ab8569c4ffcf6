"""Build the charlm corpus: Python's standard-library source, as byte shards in a volume directory.

No network: the text is the `.py` files of the interpreter running this script (tests, idlelib and lib2to3
left out), about 11 MB on CPython 3.11. Files are split into train, validation and test by a stable hash of
their relative path (about 10% validation, 10% test), so no file leaks across the splits whatever order they
are read in. The validation files are those of version 1 (which had no test split); the test files come out
of its training files. Only the end of a run scores the test split (`test_loss`): no search decision reads it.
Each split is concatenated in path order and cut into fixed-size shard files, one training sample each:

    $AUTORESEARCH_HOME/volumes/charlm/train-00000.bin ... val-00000.bin ... test-00000.bin ... MANIFEST.json

Runs by itself the first time a trial needs the data (`ensure()`), safely when several jobs start at once.
By hand: `python -m experiments.charlm.prepare [--out DIR] [--shards]`.

The same files packed into tar shards (`ensure_shards()`, what `autoresearch data pack --split-by` writes), one
set per split, for trials run with `data=shards`:

    $AUTORESEARCH_HOME/volumes/charlm-shards/train-000000.tar ... val-000000.tar ... index.json
"""

from __future__ import annotations

import argparse
import platform
import sysconfig
import zlib
from pathlib import Path

from experiments.common import prepare_once

NAME = "charlm"
VERSION = 2  # bump when the layout or the content rules change: old volumes are rebuilt
SHARD_BYTES = 64 * 1024
PACKED_SHARD_BYTES = 4 << 20  # tar shards of about 64 training files each
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
VAL_EVERY = 10  # one file in ten (by hash) goes to validation, another one in ten to test


def source_files(root: Path) -> list[Path]:
    """The standard library's `.py` files under `root`, in a stable order."""
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_of(relpath: str) -> str:
    """The split a file belongs to, "train", "val" or "test" (stable across machines and runs)."""
    bucket = zlib.crc32(relpath.encode()) % VAL_EVERY
    return "val" if bucket == 0 else "test" if bucket == 1 else "train"


def is_val(relpath: str) -> bool:
    """Whether a file belongs to the validation split."""
    return split_of(relpath) == "val"


def write_shards(stream: bytes, out: Path, prefix: str) -> int:
    """Cut `stream` into SHARD_BYTES pieces named `<prefix>-NNNNN.bin`; the short tail is dropped so every
    shard has the same size. Returns the number of shards."""
    count = len(stream) // SHARD_BYTES
    for i in range(count):
        (out / f"{prefix}-{i:05d}.bin").write_bytes(stream[i * SHARD_BYTES:(i + 1) * SHARD_BYTES])
    return count


def build(out: Path) -> dict:
    """Write the train, val and test shards into the empty directory `out`; return facts for the manifest."""
    root = Path(sysconfig.get_paths()["stdlib"])
    splits: dict[str, list[bytes]] = {"train": [], "val": [], "test": []}
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        # A header line marks file boundaries, so the model sees where one module ends and the next begins.
        splits[split_of(rel)].append(f"# file: {rel}\n".encode() + path.read_bytes())
    facts = {"source": str(root), "python": platform.python_version(), "shard_bytes": SHARD_BYTES}
    for split, parts in splits.items():
        stream = b"\n\n".join(parts)
        facts[f"{split}_files"] = len(parts)
        facts[f"{split}_shards"] = write_shards(stream, out, split)
    if facts["val_shards"] < 1 or facts["test_shards"] < 1 or facts["train_shards"] < 8:
        raise RuntimeError(f"standard library at {root} is too small to build the charlm corpus: {facts}")
    return facts


def ensure(target: Path | None = None) -> Path:
    """The corpus directory, built on first use (idempotent; concurrent callers wait for one builder)."""
    return prepare_once(NAME, VERSION, build, target)


def pack_shards(out: Path) -> dict:
    """Pack the corpus's files into tar shards per split in the empty directory `out`."""
    from runtime.data.packing import PackConfig, pack

    index = pack(PackConfig(ensure(), out, shard_size=PACKED_SHARD_BYTES, pattern="*.bin",
                            split_by=r"^(train|val|test)-", threads=8))
    return {"files": index["files"], "shards": len(index["shards"]), "shard_size": PACKED_SHARD_BYTES}


def ensure_shards(target: Path | None = None) -> Path:
    """The corpus packed into tar shards, built on first use (from `ensure()`'s files; idempotent)."""
    return prepare_once(f"{NAME}-shards", VERSION, pack_shards, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="volume directory (default: under the home)")
    parser.add_argument("--shards", action="store_true", help="the tar shards packed from the files instead")
    args = parser.parse_args(argv)
    print(ensure_shards(args.out) if args.shards else ensure(args.out))


if __name__ == "__main__":
    main()
