"""Population-based training's pure rules: who exploits whom at an interval, how a copied trial explores, and
what a lineage's schedule of mutable params looks like (Jaderberg et al. 2017; Ray Tune's PBT and PBTReplay).

- exploit: at each perturbation interval, once every live member has reported there, the members are ranked by
  the value each reported first at or past it; each of the bottom `quantile` takes the checkpoint of a member
  drawn from the top `quantile` (truncation selection).
- explore: each mutable param of the copied config is, with probability `resample`, drawn afresh from its
  range, else multiplied by 0.8 or 1.2 and clipped to the range (ints rounded).
- a schedule is the list `[[step, {param: value}], ...]` a trial's lineage ran: the root's mutable params at
  step 0, then each fork's new values at the step of the checkpoint it copied. Replaying it from scratch (a
  fresh seed, the same params at the same steps) is how the winner is confirmed.

Pure functions over plain data (the agent's checkpointed state), seeded by the session so a resumed session
decides the same again.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from typing import Any, Mapping, Sequence

from orchestrator.core.direction import Direction

QUANTILE = 0.25
RESAMPLE = 0.25
FACTORS = (0.8, 1.2)
# The leaderboard's name for a lineage's schedule (beside the params it started with). Not a name a parameter
# can have (the colon): experiments commonly have a `schedule` param of their own (an lr schedule).
SCHEDULE_KEY = "pbt:schedule"


def rng(*parts: Any) -> random.Random:
    """A generator seeded by `parts` (the session id, a step, a trial number): the same decision on resume."""
    return random.Random(zlib.crc32(":".join(map(str, parts)).encode()))


def sample(space: Any, names: Sequence[str], params: Mapping[str, Any], r: random.Random) -> dict[str, Any]:
    """`params` with each of `names` drawn from its range (log-uniform on a log scale)."""
    out = dict(params)
    for name in names:
        out[name] = _draw(space.dims[name], r)
    return out


def perturb(space: Any, names: Sequence[str], params: Mapping[str, Any], r: random.Random,
            resample: float = RESAMPLE) -> dict[str, Any]:
    """Explore: each of `names` resampled with probability `resample`, else scaled by 0.8 or 1.2 within range."""
    out = dict(params)
    for name in names:
        dim = space.dims[name]
        if r.random() < resample:
            out[name] = _draw(dim, r)
            continue
        value = float(params[name]) * r.choice(FACTORS)
        if value == 0.0:  # a zero never scales away from zero: step into the range instead
            value = dim.low + (dim.high - dim.low) * 0.05
        value = min(dim.high, max(dim.low, value))
        out[name] = int(round(value)) if isinstance(dim.low, int) and isinstance(dim.high, int) else value
    return out


def _draw(dim: Any, r: random.Random) -> Any:
    lo, hi = float(dim.low), float(dim.high)
    value = math.exp(r.uniform(math.log(lo), math.log(hi))) if getattr(dim, "log", False) else r.uniform(lo, hi)
    return int(round(value)) if isinstance(dim.low, int) and isinstance(dim.high, int) else value


def value_at(history: Sequence[Sequence[float]], step: int) -> float | None:
    """The value first reported at or past `step` in `history` ([(step, value)] by step), None before it."""
    for at, value in history:
        if at >= step and math.isfinite(value):
            return float(value)
    return None


def pairs(values: Mapping[int, float], direction: str, r: random.Random, quantile: float = QUANTILE
          ) -> list[tuple[int, int]]:
    """(loser, donor) member pairs: each of the bottom `quantile` of `values` ({member: value}) with a donor
    drawn from the top `quantile`. None with fewer than 2 members (there is no one to copy)."""
    if len(values) < 2:
        return []
    d = Direction.of(direction)
    ranked = sorted(values, key=lambda m: (d.key(values[m]), m))
    q = max(1, int(len(ranked) * quantile))
    top, bottom = ranked[:q], ranked[-q:]
    return [(loser, r.choice(top)) for loser in bottom if loser not in top]


def changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `after` that differ from `before`."""
    return {k: v for k, v in after.items() if before.get(k) != v}


def text(schedule: Sequence[Sequence[Any]]) -> str:
    """One canonical text for a schedule (runs of the same schedule group together on the leaderboard)."""
    return json.dumps([[int(step), {k: values[k] for k in sorted(values)}] for step, values in schedule],
                      separators=(",", ":"))


def row_params(params: Mapping[str, Any], schedule: Sequence[Sequence[Any]] | None) -> dict[str, Any]:
    """A leaderboard row's params for a run of a schedule: the params it started with plus the schedule, so a
    lineage and its replays are one configuration, apart from plain runs of the same start."""
    if not schedule:
        return dict(params)
    return {**params, **schedule[0][1], SCHEDULE_KEY: text(schedule)}


def table(schedule_text: str) -> list[dict[str, Any]]:
    """A schedule's text as rows of {step, param: value} (every mutable param's value in force from there)."""
    rows, current = [], {}
    for step, values in json.loads(schedule_text):
        current = {**current, **values}
        rows.append({"step": int(step), **current})
    return rows
