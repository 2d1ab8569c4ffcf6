"""Which way a metric improves: the one type every ranking, gate, stopping rule and report compares with.

A `Direction` is a str enum, so it is written and read as the plain words `"minimize"` and `"maximize"` (in
autoresearch.toml, JSON summaries, MLflow tags) and compares equal to them; code asks it instead of comparing
strings: `d.better(a, b)`, `d.best(values)`, `d.key(v)` (sorts best first), `d.score(v)` (higher is better).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Iterable


class Direction(StrEnum):
    """A metric's direction of improvement."""

    MINIMIZE = "minimize"
    MAXIMIZE = "maximize"

    @classmethod
    def of(cls, raw: object) -> "Direction":
        """`raw` as a Direction; ValueError naming the two choices otherwise."""
        try:
            return cls(raw)
        except ValueError:
            raise ValueError(f"direction must be minimize or maximize, got {raw!r}") from None

    @property
    def minimizes(self) -> bool:
        return self is Direction.MINIMIZE

    def better(self, a: float, b: float) -> bool:
        """Whether value `a` is strictly better than `b`."""
        return a < b if self.minimizes else a > b

    def at_least_as_good(self, a: float, b: float) -> bool:
        """Whether value `a` is as good as `b` or better."""
        return a <= b if self.minimizes else a >= b

    def key(self, value: float) -> float:
        """A sort key that puts the best value first (ascending)."""
        return value if self.minimizes else -value

    def score(self, value: float) -> float:
        """`value` oriented so that higher is better."""
        return -value if self.minimizes else value

    def best(self, values: Iterable[float]) -> float:
        return min(values) if self.minimizes else max(values)

    def worst(self, values: Iterable[float]) -> float:
        return max(values) if self.minimizes else min(values)
