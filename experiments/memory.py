"""Config-file experiments remembered by name: `AUTORESEARCH_HOME/experiments.json`.

Once `--experiment ./tinygpt` has been used, later commands (`leaderboard --experiment tinygpt`, `resume`,
`top`, MCP) name it by its `name` alone. Each entry keeps the file it came from and a hash of its text (so a
changed file shows as changed). A name belongs to one file: a second file claiming it is refused, which keeps
the results of two different experiments from being pooled under one name.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime import protocol

if TYPE_CHECKING:
    from experiments.experiment import ExperimentSpec

FILE = "experiments.json"


def _home(home: str | os.PathLike | None) -> Path:
    return protocol.home_dir() if home is None else Path(home).expanduser()


def _read(home: str | os.PathLike | None) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads((_home(home) / FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def file_hash(path: str | os.PathLike) -> str:
    """sha256 of a config file's bytes (the first 16 hex digits)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def remember(spec: ExperimentSpec, home: str | os.PathLike | None = None) -> None:
    """Record `spec`'s name -> its source file. Raises config_file.ConfigError when another file has the name."""
    from filelock import FileLock

    from experiments.config_file import ConfigError

    if not spec.source:
        return
    root = _home(home)
    root.mkdir(parents=True, exist_ok=True)
    source = str(Path(spec.source).resolve())
    with FileLock(str(root / f".{FILE}.lock")):
        table = _read(root)
        entry = table.get(spec.name)
        if entry is not None and entry.get("source") != source and Path(entry.get("source", "")).exists():
            raise ConfigError(f"{spec.source}: experiment name {spec.name!r} is already taken by "
                              f"{entry['source']}; set another `name` in [experiment]")
        digest = file_hash(source)
        if entry is not None and entry.get("source") == source and entry.get("hash") == digest:
            return  # nothing new: no write on the common path
        table[spec.name] = {"source": source, "folder": str(Path(source).parent), "hash": digest,
                            "updated_at": time.time()}
        tmp = root / f".{FILE}.tmp"
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(tmp, root / FILE)  # whole or absent: a reader never sees half a table


def lookup(name: str, home: str | os.PathLike | None = None) -> str | None:
    """The source file remembered for `name`, or None."""
    entry = _read(home).get(name)
    return entry.get("source") if isinstance(entry, dict) else None


def entry(name: str, home: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Everything remembered for `name` (source, folder, hash, updated_at), or None."""
    found = _read(home).get(name)
    return dict(found) if isinstance(found, dict) else None


def names(home: str | os.PathLike | None = None) -> list[str]:
    """Every remembered name, sorted."""
    return sorted(_read(home))
