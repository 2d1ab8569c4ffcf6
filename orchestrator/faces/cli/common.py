"""Helpers shared by the CLI modules: the command's settings, JSON output and rich tables."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Optional, Sequence

from orchestrator.core.config import Settings

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


def print_columns(columns: Sequence[tuple[str, dict]], rows: Iterable[Sequence[Any]],
                  width: Optional[int] = None) -> None:
    """Print rows as plain aligned columns, one line each, within `width` (default: the terminal's, 80 when
    there is none, COLUMNS when set), like `squeue` or `docker ps`. A column is (header, options): `right`
    (align right), `ratio` and `min_width`: columns without a ratio are never cut; those with one share what
    is left of the width by their ratios (never narrower than their header), cut with an ellipsis. Plain text, not
    a rich table, which costs far more a row (benchmarks/RESULTS.md)."""
    import shutil

    from rich.cells import cell_len, set_cell_size

    def size(text: str) -> int:  # terminal cells: CJK and emoji take two
        return len(text) if text.isascii() else cell_len(text)

    width = width or shutil.get_terminal_size((80, 24)).columns
    cells = [["" if v is None else " ".join(str(v).split("\n")) for v in row] for row in rows]
    natural = [max([size(name)] + [size(row[i]) for row in cells]) for i, (name, _) in enumerate(columns)]
    widths = fit_widths(natural, [opts.get("ratio") for _, opts in columns],
                        [max(opts.get("min_width", 1), size(name)) for name, opts in columns],
                        width - (len(columns) - 1))
    right = [bool(opts.get("right")) for _, opts in columns]

    def cell(text: str, i: int) -> str:
        room, used = widths[i], size(text)
        if used > room:
            text = set_cell_size(text, room - 1) + "…" if room > 1 else set_cell_size(text, room)
            used = room
        pad = " " * (room - used)
        return pad + text if right[i] else text + pad

    out = [" ".join(cell(name, i) for i, (name, _) in enumerate(columns)).rstrip()]
    out += [" ".join(cell(text, i) for i, text in enumerate(row)).rstrip() for row in cells]
    sys.stdout.write("\n".join(out) + "\n")


def fit_widths(natural: Sequence[int], ratios: Sequence[Optional[int]], minimum: Sequence[int],
               room: int) -> list[int]:
    """Column widths within `room`: columns without a ratio get their natural width; the others get their
    minimum (or natural width, if smaller) and share what is left by ratio, none past its natural width."""
    widths = [n if r is None else min(n, m) for n, r, m in zip(natural, ratios, minimum)]
    left = room - sum(widths)
    open_ = [i for i, r in enumerate(ratios) if r is not None and widths[i] < natural[i]]
    while left > 0 and open_:
        total = sum(ratios[i] for i in open_)
        given = 0
        for i in open_:
            more = min(natural[i] - widths[i], max(1, left * ratios[i] // total))
            more = min(more, left - given)
            widths[i] += more
            given += more
        left -= given
        open_ = [i for i in open_ if widths[i] < natural[i]]
    return widths


def info(message: str) -> None:
    """A human note on stderr (keeps stdout clean for --json)."""
    print(message, file=sys.stderr)
