"""The index of a pack of tar shards (`index.json`), shared by the writer (runtime.data.packing) and the reader
(runtime.data.shards): its format, how a file's path splits into sample key and member name, and reading it.

    {"format": "autoresearch-shards", "version": 1, "source": SRC, "shard_size": BYTES, "split_by": RE|null,
     "files": N, "bytes": B, "samples": S,
     "shards": [{"name": "shard-000000.tar", "split": "", "bytes": B, "checksum": "crc32:1a2b3c4d",
                 "samples": [{"key": "a/x", "members": {"jpg": [OFFSET, SIZE, CRC32], ...}}, ...]}, ...]}

Offsets are where a member's bytes start inside the tar file (after its header), so a reader can take one
member with one pread, and each member's CRC-32 names the sample a damaged shard breaks. The index is
written last, atomically: a directory without it is a pack still running or killed, and is refused.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from runtime.errors import VolumeError

INDEX = "index.json"
FORMAT = "autoresearch-shards"
VERSION = 1
SHARD_NAME = re.compile(r"^(?:[A-Za-z0-9_.-]+-)?\d{6}\.tar(?:\.part)?$")  # what a pack writes, and may remove


def split_key(rel: str) -> tuple[str, str]:
    """(sample key, member name) of a file: the path up to the first dot of the file name, and the rest.

    `a/x.jpg` and `a/x.seg.png` are members `jpg` and `seg.png` of sample `a/x` (the WebDataset convention,
    so its reader groups them the same way); a name with no dot is a sample of one member named "".
    """
    head, _, name = rel.rpartition("/")
    stem, dot, ext = name.partition(".")
    if not stem:  # `.hidden`: a leading dot is part of the name, not a separator
        stem, ext = name, ""
    return (f"{head}/{stem}" if head else stem), (ext if dot and stem != name else "")


def shard_name(split: str, number: int) -> str:
    """`shard-000007.tar`, or `<split>-000007.tar` for a named split (WebDataset brace patterns match both)."""
    return f"{split or 'shard'}-{number:06d}.tar"


def parse_index(text: str, where: str) -> dict[str, Any]:
    """The index in `text` after checking its format; VolumeError naming `where` otherwise."""
    try:
        index = json.loads(text)
    except json.JSONDecodeError as exc:
        raise VolumeError(f"{where}: the shard index is not valid JSON ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise VolumeError(f"{where}: not an index of tar shards written by `autoresearch data pack`")
    if index.get("version") != VERSION:
        raise VolumeError(f"{where}: shard index version {index.get('version')} is not {VERSION}; re-pack")
    return index


def read_index(dest: str) -> dict[str, Any]:
    """The index of the pack at `dest` (a directory or any fsspec URL); VolumeError if it has none."""
    if "://" in dest:
        import fsspec

        fs, root = fsspec.core.url_to_fs(dest)
        path = f"{root.rstrip('/')}/{INDEX}"
        try:
            with fs.open(path, "rb") as fh:
                text = fh.read().decode()
        except FileNotFoundError:
            text = None
        except OSError as exc:
            raise VolumeError(f"cannot read {dest}/{INDEX}: {exc}") from None
    else:
        path = os.path.join(os.path.expanduser(dest), INDEX)
        try:
            with open(path, "rb") as fh:
                text = fh.read().decode()
        except FileNotFoundError:
            text = None
        except OSError as exc:
            raise VolumeError(f"cannot read {path}: {exc.strerror or exc}") from None
    if text is None:
        if "://" not in dest and not os.path.isdir(os.path.expanduser(dest)):
            raise VolumeError(f"data volume not found: {dest}")
        raise VolumeError(f"{dest} has no {INDEX}: not a pack of shards, or a pack still running or killed "
                          "(run `autoresearch data pack` again to finish it)")
    return parse_index(text, dest)
