"""Helpers shared by the CLI modules: the command's settings, JSON output and rich tables."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Optional, Sequence, Union

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


def print_table(title: str, columns: Sequence[Union[str, tuple[str, dict]]], rows: Iterable[Sequence[Any]], *,
                compact: bool = False) -> None:
    """Print a rich table for people. A column is a name, or (name, rich column options). `compact`: no box and
    one line per row, so that many columns fit 80 characters: columns without a `ratio` are never cut, those
    with one share what is left of the width by their ratios (at least `min_width` each), cut with an ellipsis."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cells = [["" if v is None else str(v) for v in row] for row in rows]
    specs = [(col, {}) if isinstance(col, str) else (col[0], dict(col[1])) for col in columns]
    if compact:
        table = Table(title=title, title_justify="left", box=None, padding=(0, 1, 0, 0), pad_edge=False,
                      header_style="bold")
        natural = [max([len(name)] + [len(row[i]) for row in cells]) for i, (name, _) in enumerate(specs)]
        widths = fit_widths(natural, [opts.get("ratio") for _, opts in specs],
                            [opts.pop("min_width", 1) for _, opts in specs], console.width - len(specs))
        for (name, opts), width in zip(specs, widths):
            opts.pop("ratio", None)
            table.add_column(name, width=width, no_wrap=True, overflow="ellipsis", **opts)
    else:
        table = Table(title=title, title_justify="left")
        for name, opts in specs:
            table.add_column(name, **opts)
    for row in cells:
        table.add_row(*row)
    console.print(table)


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
