"""The experiment registry: find bundled experiments by name.

Each experiment package `experiments/<name>/` has a light `spec.py` (no torch import) defining `SPEC`, an
`ExperimentSpec`; its training entry point is a module run as `python -m <entrypoint>`.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from experiments.space import SearchSpace

KNOWN = ("digits", "charlm", "tabular")


class UnknownExperiment(ValueError):
    """No experiment has that name."""


@dataclass(frozen=True)
class ExperimentSpec:
    """What an experiment declares in one place: space, metric and direction, budget, entry point."""

    name: str
    description: str
    space: SearchSpace
    metric: str
    direction: Literal["minimize", "maximize"]
    entrypoint: str
    budget: Mapping[str, Any] = field(default_factory=dict)
    # Intermediate metric the agent's early stopping reads (logged at increasing steps); defaults to `metric`.
    progress_metric: str | None = None
    # A container image its runs use (`submit --image`; agent trials too), None: the service's environment.
    # It runs as `python3 -m ENTRYPOINT` from the bind-mounted repository root: the image needs the dependencies.
    image: str | None = None
    # A metric the run logs once, at its end, on data no search decision uses (a held-out test split): read
    # only after the session, for the baseline's runs and the winner's confirmation re-runs; its direction is
    # `direction`'s. None: the experiment has no holdout. A config-file experiment may set it too.
    holdout_metric: str | None = None

    def __post_init__(self) -> None:
        if self.direction not in ("minimize", "maximize"):
            raise ValueError(f"direction must be minimize or maximize, got {self.direction!r}")
        if self.holdout_metric is not None and self.holdout_metric in (self.metric, self.progress_metric):
            raise ValueError(f"holdout_metric {self.holdout_metric!r} must differ from the metrics the search "
                             "reads (metric, progress_metric)")

    @property
    def search_metrics(self) -> frozenset[str]:
        """The metric names the search may read (the gate, ranking, ASHA, proposers); never the holdout."""
        return frozenset({self.metric, self.progress_metric or self.metric})

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Full, typed params (defaults filled); raises experiments.space.SpaceError naming the key."""
        return self.space.validate(params)

    def argv(self, in_image: bool = False) -> list[str]:
        """The command a job runs for this experiment (params travel in AUTORESEARCH_PARAMS); `in_image`: in
        a container, whose python is not this one."""
        return ["python3" if in_image else sys.executable, "-m", self.entrypoint]

    def better(self, a: float, b: float) -> bool:
        """Whether metric value `a` is strictly better than `b`."""
        return a < b if self.direction == "minimize" else a > b


def get(name: str) -> ExperimentSpec:
    """The spec of experiment `name`; UnknownExperiment (listing the known names) otherwise."""
    if name not in KNOWN:
        raise UnknownExperiment(f"unknown experiment {name!r}; known: {', '.join(KNOWN)}")
    module = importlib.import_module(f"experiments.{name}.spec")
    return module.SPEC


def names() -> tuple[str, ...]:
    """Names of the bundled experiments."""
    return KNOWN
