"""Helpers shared by the CLI modules: the command's settings, JSON output and rich tables."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Optional, Sequence

from orchestrator.config import Settings

_settings: Optional[Settings] = None


def load_settings() -> Settings:
    """Resolve this command's settings once (env, then config.toml): a malformed file fails every command
    here, as one line and exit 2, before anything is touched."""
    global _settings
    _settings = Settings.load()
    return _settings


def settings(**flags: Any) -> Settings:
    """The command's one settings object, with this command's flags on top (None: not given)."""
    base = _settings or load_settings()
    return base.with_flags(**flags) if flags else base


def print_json(data: Any) -> None:
    """Print `data` as JSON on stdout (datetimes and paths as strings)."""
    sys.stdout.write(json.dumps(data, default=str, indent=2) + "\n")


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Print a rich table for people."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    Console().print(table)


def info(message: str) -> None:
    """A human note on stderr (keeps stdout clean for --json)."""
    print(message, file=sys.stderr)
