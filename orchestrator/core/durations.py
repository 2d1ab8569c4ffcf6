"""Durations as people type them: `90`, `90s`, `5m`, `1.5h` (for `submit --time-limit` and `time_limit`)."""

from __future__ import annotations

import re

from orchestrator.core.errors import BadInput

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "": 1}


def parse_duration(text: str | int | float, *, what: str = "duration", most: float = 30 * 86400) -> float:
    """Seconds in `text` (a number is seconds); BadInput with a one-line reason otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
        if not m:
            raise BadInput(f"bad {what} {text!r}: expected e.g. 90s, 5m or 1.5h")
        value, unit = float(m.group(1)), m.group(2)
    seconds = value * _UNITS[unit]
    if not 0 < seconds <= most:
        raise BadInput(f"{what} {text!r} must be more than 0 and at most {most / 86400:g} days")
    return seconds
