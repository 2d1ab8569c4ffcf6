"""What an experiment is, whichever file declared it: `ExperimentSpec` (a bundled `spec.py`, an
`autoresearch.toml`, a W&B sweep file or a project's own Python), and `UnknownExperiment` when a name resolves
to none. A leaf: the registry, the config-file reader and the memory of names all import it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from experiments.space import SearchSpace
from orchestrator.core.direction import Direction


class UnknownExperiment(ValueError):
    """No experiment has that name."""


@dataclass(frozen=True)
class ExperimentSpec:
    """What an experiment declares in one place: space, metric and direction, budget, entry point."""

    name: str
    description: str
    space: SearchSpace
    metric: str
    direction: Direction  # "minimize" or "maximize" given as a string becomes a Direction
    entrypoint: str
    budget: Mapping[str, Any] = field(default_factory=dict)
    # Intermediate metric the agent's early stopping reads (logged at increasing steps); defaults to `metric`.
    progress_metric: str | None = None
    # A container image its runs use (`submit --image`; agent trials too), None: the service's environment.
    # It runs as `python3 -m ENTRYPOINT` from the bind-mounted repository root: the image needs the dependencies.
    image: str | None = None
    # A config-file experiment (`experiments.config_file`): how its job runs the user's own command.
    run: str | None = None  # the command template (placeholders `{args}`, `{NAME}`, `{checkpoint_dir}`, ...)
    args_format: str = "--{name}={value}"  # how `{args}` writes each parameter
    pattern: str | None = None  # output lines read as metric reports (None: `^<metric>: <number>`)
    resume: str | None = None  # added to the command when the job's checkpoint dir is not empty
    fixed: Mapping[str, Any] = field(default_factory=dict)  # passed like params, never searched or validated
    bools: tuple[str, str] = ("True", "False")  # the words a bool parameter is written as (True, False)
    seed_param: str | None = None  # the script's name for the `seed` parameter
    time_limit: float | None = None  # seconds an attempt may run
    cwd: str | None = None  # where the command runs (the toml's folder)
    source: str | None = None  # the file it was read from
    # A metric the run logs once, at its end, on data no search decision uses (a held-out test split): read
    # only after the session, for the baseline's runs and the winner's confirmation re-runs; its direction is
    # `direction`'s. None: the experiment has no holdout. A config-file experiment may set it too.
    holdout_metric: str | None = None
    # Parameters a run may change mid-training and keep its state (population-based training): learning rate,
    # weight decay, dropout, a batch size where the loader allows; never the architecture. A float or int
    # parameter of the space each; the experiment applies a changed one after loading a copied checkpoint.
    mutable: tuple[str, ...] = ()
    # The parameter that says after how many steps a config-file experiment's run stops (`steps` in the toml, e.g.
    # "max_iters"): PBT runs its members and replays as segments that each stop at the next interval and resume.
    steps: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "direction", Direction.of(self.direction))
        object.__setattr__(self, "mutable", tuple(self.mutable))
        for name in self.mutable:
            dim = self.space.dims.get(name)
            if dim is None or not hasattr(dim, "low"):
                raise ValueError(f"mutable {name!r} must name a float or int parameter of the space")
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
        a container, whose python is not this one. A config-file experiment runs its own command through
        the job wrapper (`orchestrator.executors.scriptjob`), which fills in the placeholders when the attempt starts."""
        python = "python3" if in_image else sys.executable
        if self.run is None:
            return [python, "-m", self.entrypoint]
        import json

        plan = {"run": self.run, "args": self.args_format, "metric": self.metric, "pattern": self.pattern,
                "resume": self.resume, "fixed": dict(self.fixed), "seed": self.seed_param,
                "bools": list(self.bools)}
        if self.steps:
            plan["steps"] = self.steps
        return [python, "-m", "orchestrator.executors.scriptjob", json.dumps(plan, separators=(",", ":"))]

    def job_fields(self, in_image: bool = False) -> dict[str, Any]:
        """What a job of this experiment needs besides its params, decided here for every face (CLI, MCP,
        agent): its argv, the folder it runs in and its time limit. Explicit job options override them."""
        import experiments

        root = str(Path(experiments.__file__).resolve().parent.parent)  # where `python -m experiments.x` resolves
        return {"argv": self.argv(in_image), "cwd": self.cwd or root, "time_limit": self.time_limit,
                "image": self.image, "experiment": self.name}

    @property
    def seeded(self) -> bool:
        """Whether runs of one configuration can differ by a seed parameter (else re-runs only repeat it)."""
        return "seed" in self.space

    def better(self, a: float, b: float) -> bool:
        """Whether metric value `a` is strictly better than `b`."""
        return self.direction.better(a, b)
