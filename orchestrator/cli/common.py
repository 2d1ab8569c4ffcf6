"""Helpers shared by the CLI modules: JSON output and rich tables."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Sequence


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
