"""Typed search spaces: what an experiment lets a person, a sampler or an LLM change, and the allowed values.

Kept import-light (no torch, no optuna at import time): `autoresearch submit --experiment` validates
params on its fast path.

    space = SearchSpace({
        "lr": Float(1e-4, 1e-1, log=True, default=3e-3),
        "layers": Int(1, 8, default=2),
        "activation": Categorical(("gelu", "relu", "swiglu"), default="gelu"),
        "mlp_ratio": Int(2, 4, default=4, when=("activation", ("gelu", "relu"))),
    })
    params = space.validate({"lr": "0.01"})  # -> full, typed dict with defaults filled in
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


class SpaceError(ValueError):
    """A parameter is unknown, of the wrong type, or out of range. The message names the key and the range."""

    def __init__(self, key: str, message: str):
        super().__init__(f"parameter {key!r}: {message}")
        self.key = key


Condition = tuple[str, tuple[Any, ...]]


@dataclass(frozen=True)
class Float:
    """A real number in [low, high]; `log=True` samples on a log scale."""

    low: float
    high: float
    log: bool = False
    default: float | None = None
    when: Condition | None = None
    help: str = ""

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"Float needs low < high, got {self.low} >= {self.high}")
        if self.log and self.low <= 0:
            raise ValueError("Float(log=True) needs low > 0")

    def describe(self) -> str:
        return f"float in [{self.low:g}, {self.high:g}]" + (" (log scale)" if self.log else "")

    def coerce(self, key: str, value: Any) -> float:
        if isinstance(value, bool):
            raise SpaceError(key, f"expected a {self.describe()}, got {value!r}")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise SpaceError(key, f"expected a {self.describe()}, got {value!r}") from None
        if not math.isfinite(out) or not self.low <= out <= self.high:
            raise SpaceError(key, f"{value!r} is out of range: expected a {self.describe()}")
        return out


@dataclass(frozen=True)
class Int:
    """An integer in [low, high] (inclusive); `log=True` samples on a log scale."""

    low: int
    high: int
    log: bool = False
    default: int | None = None
    when: Condition | None = None
    help: str = ""

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"Int needs low < high, got {self.low} >= {self.high}")
        if self.log and self.low <= 0:
            raise ValueError("Int(log=True) needs low > 0")

    def describe(self) -> str:
        return f"integer in [{self.low}, {self.high}]" + (" (log scale)" if self.log else "")

    def coerce(self, key: str, value: Any) -> int:
        if isinstance(value, bool):
            raise SpaceError(key, f"expected an {self.describe()}, got {value!r}")
        if isinstance(value, float):
            if not value.is_integer():
                raise SpaceError(key, f"expected an {self.describe()}, got {value!r}")
            value = int(value)
        try:
            out = int(value) if not isinstance(value, str) else int(value.strip())
        except (TypeError, ValueError):
            raise SpaceError(key, f"expected an {self.describe()}, got {value!r}") from None
        if not self.low <= out <= self.high:
            raise SpaceError(key, f"{value!r} is out of range: expected an {self.describe()}")
        return out


@dataclass(frozen=True)
class Categorical:
    """One of a fixed tuple of choices (str, int, float or bool)."""

    choices: tuple[Any, ...]
    default: Any = None
    when: Condition | None = None
    help: str = ""

    def __post_init__(self) -> None:
        if len(self.choices) < 1:
            raise ValueError("Categorical needs at least one choice")

    def describe(self) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def coerce(self, key: str, value: Any) -> Any:
        for choice in self.choices:
            if type(value) is type(choice) and value == choice:
                return choice
        if isinstance(value, str):  # from the command line: match the textual form
            text = value.strip()
            for choice in self.choices:
                if str(choice) == text or (isinstance(choice, bool) and text.lower() == str(choice).lower()):
                    return choice
        elif not isinstance(value, bool):
            for choice in self.choices:
                if isinstance(choice, (int, float)) and not isinstance(choice, bool) and value == choice:
                    return choice
        raise SpaceError(key, f"{value!r} is not allowed: expected {self.describe()}")


Dimension = Float | Int | Categorical


@dataclass(frozen=True)
class SearchSpace:
    """An ordered mapping of parameter name to dimension, with optional conditions between them."""

    dims: Mapping[str, Dimension]

    def __post_init__(self) -> None:
        for name, dim in self.dims.items():
            if dim.when is not None:
                parent, values = dim.when
                if parent not in self.dims:
                    raise ValueError(f"{name}: condition on unknown parameter {parent!r}")
                if list(self.dims).index(parent) > list(self.dims).index(name):
                    raise ValueError(f"{name}: its condition parent {parent!r} must be declared first")

    def __iter__(self):
        return iter(self.dims)

    def __contains__(self, key: object) -> bool:
        return key in self.dims

    def active(self, name: str, params: Mapping[str, Any]) -> bool:
        """Whether `name` applies given the other params (its condition holds, recursively)."""
        dim = self.dims[name]
        if dim.when is None:
            return True
        parent, values = dim.when
        return self.active(parent, params) and params.get(parent) in values

    def defaults(self) -> dict[str, Any]:
        """Every active parameter at its default value."""
        return self.validate({})

    def validate(self, raw: Mapping[str, Any], *, fill_defaults: bool = True) -> dict[str, Any]:
        """Check and coerce `raw` (strings allowed, as from the CLI). Raises SpaceError naming the key.

        Unknown keys are rejected. Inactive conditional params are dropped. Missing active params take
        their default (or the middle of the range when none is declared) when `fill_defaults` is set.
        """
        for key in raw:
            if key not in self.dims:
                raise SpaceError(key, f"unknown parameter; known: {', '.join(self.dims)}")
        out: dict[str, Any] = {}
        for name, dim in self.dims.items():
            if not self.active(name, out):
                continue
            if name in raw:
                out[name] = dim.coerce(name, raw[name])
            elif fill_defaults:
                out[name] = _default(dim)
        return out

    def describe(self) -> list[dict[str, Any]]:
        """A JSON-able description (for prompts, `--json` output and docs)."""
        rows = []
        for name, dim in self.dims.items():
            row: dict[str, Any] = {"name": name, "type": type(dim).__name__.lower(), "range": dim.describe(),
                                   "default": _default(dim)}
            if isinstance(dim, Categorical):
                row["choices"] = list(dim.choices)
            else:
                row.update(low=dim.low, high=dim.high, log=dim.log)
            if dim.when is not None:
                row["only_when"] = {dim.when[0]: list(dim.when[1])}
            if dim.help:
                row["help"] = dim.help
            rows.append(row)
        return rows

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Sample a full parameter dict from an optuna trial (define-by-run, conditions respected)."""
        out: dict[str, Any] = {}
        for name, dim in self.dims.items():
            if not self.active(name, out):
                continue
            if isinstance(dim, Float):
                out[name] = trial.suggest_float(name, dim.low, dim.high, log=dim.log)
            elif isinstance(dim, Int):
                out[name] = trial.suggest_int(name, dim.low, dim.high, log=dim.log)
            else:
                out[name] = trial.suggest_categorical(name, list(dim.choices))
        return out

    def distributions(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Optuna distributions of the params active in `params` (to `add_trial` a finished run)."""
        import optuna

        out: dict[str, Any] = {}
        for name, dim in self.dims.items():
            if name not in params or not self.active(name, params):
                continue
            if isinstance(dim, Float):
                out[name] = optuna.distributions.FloatDistribution(dim.low, dim.high, log=dim.log)
            elif isinstance(dim, Int):
                out[name] = optuna.distributions.IntDistribution(dim.low, dim.high, log=dim.log)
            else:
                out[name] = optuna.distributions.CategoricalDistribution(list(dim.choices))
        return out


def _default(dim: Dimension) -> Any:
    if dim.default is not None:
        return dim.default
    if isinstance(dim, Categorical):
        return dim.choices[0]
    if dim.log:
        mid = math.sqrt(dim.low * dim.high)
    else:
        mid = (dim.low + dim.high) / 2
    return int(round(mid)) if isinstance(dim, Int) else mid
