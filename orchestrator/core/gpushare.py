"""What a job asks of the GPUs: whole devices (`--gpus 2`) or a share of one (`--gpus 0.25`), and GPU memory sizes
(`--gpu-memory 10GiB`). One parser for the CLI, the Python API, MCP and the agent.

A share is 1/k of one device for k from 2 to 16 (0.5, 0.333..., 0.25, ..., 0.0625): shares that divide a device
evenly pack without waste, and k stays small enough for the device's memory and compute to be worth sharing.
A share is written as a decimal close to 1/k (0.33 is 1/3) and stored exactly.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Union

from orchestrator.core.errors import BadInput

MAX_SHARERS = 16  # k of the smallest share, 1/16
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_gpus(value: Union[str, int, float], *, flag: str = "--gpus") -> tuple[int, Optional[float]]:
    """(whole devices, share of one device or None) for a `--gpus` value: "2" -> (2, None), "0.25" -> (1, 0.25).
    BadInput (one line) for anything else: zero, negatives, 1.5, 0.3 (not 1/k), shares below 1/16."""
    if isinstance(value, bool):
        raise BadInput(f"{flag} must be a number of GPUs or a share of one (0.5, 0.25, ...), got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadInput(f"{flag} must be a number of GPUs or a share of one (0.5, 0.25, ...), got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise BadInput(f"{flag} must be more than 0, got {value!r}")
    if number >= 1:
        if number != int(number):
            raise BadInput(f"{flag} {value}: more than one GPU is a whole number of them (jobs are never split "
                           "over a fraction of a device)")
        return int(number), None
    k = round(1 / number)
    if not 2 <= k <= MAX_SHARERS or abs(number * k - 1) > 0.02:
        raise BadInput(f"{flag} {value}: a share of one GPU is 1/k for k from 2 to {MAX_SHARERS} "
                       "(0.5, 0.333, 0.25, 0.2, ..., 0.0625)")
    return 1, 1 / k


def format_gpus(gpus: int, share: Optional[float]) -> str:
    """How `queue`, `show` and `top` print a job's GPU request: "2", or a share as "0.25" ("0.333" for 1/3)."""
    if share is None or share >= 1:
        return str(gpus)
    return f"{share:.3f}".rstrip("0")


def gpu_request(gpus: int, share: Optional[float]) -> Union[int, float]:
    """A job's GPU request as one number: whole devices (an int), or its share of one (a float below 1). What
    `--json` prints as `gpus`, and what projects, quotas and the usage ledger count."""
    return share if share is not None and share < 1 else gpus


def parse_size(value: Union[str, int], *, flag: str = "--gpu-memory") -> int:
    """Bytes of a size: "10GiB", "512MiB", "10GB" (powers of 1000), "1.5g" or plain bytes. BadInput otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise BadInput(f"{flag} must be more than 0 bytes, got {value}")
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise BadInput(f"{flag} must be a size such as 10GiB, 512MiB or 8GB, got {value!r}")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise BadInput(f"{flag} must be more than 0 bytes, got {value!r}")
    return size


def format_size(size: Optional[int]) -> str:
    """A byte count for people: "10.0GiB", "512MiB"; "-" for None."""
    if size is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f}{unit}" if unit in ("TiB", "GiB") else f"{size // scale}{unit}"
    return f"{size}B"
