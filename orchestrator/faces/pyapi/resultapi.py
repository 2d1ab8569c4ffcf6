"""Results from Python: `leaderboard` (typed) and `boards` (the JSON the CLI and MCP print), `experiment` and
`experiments` (what can be searched), and `serve` (a queue service inside this process, for a notebook)."""

from __future__ import annotations

from typing import Any, Optional

from orchestrator.core.config import Settings
from orchestrator.faces.pyapi.types import Experiment, Leaderboard


def boards(experiment: Optional[str] = None, settings: Optional[Settings] = None) -> list[dict[str, Any]]:
    """The boards of `autoresearch leaderboard --json`: one experiment's (a program's as `program:FOLDER`), or
    every experiment's with results."""
    settings = settings or Settings.load()
    if experiment and experiment.startswith("program:"):  # a program session's commits (see `tree`)
        from orchestrator.programs.session import leaderboard as program_board

        return [program_board(experiment, settings)]
    from orchestrator.agent import runner

    return runner.leaderboard(experiment, settings)


def leaderboard(experiment: Optional[str] = None, *, settings: Optional[Settings] = None) -> list[Leaderboard]:
    """Configurations ranked by mean metric over seeds, agent-made and hand-submitted runs together, with the
    verdict against the baseline (`autoresearch leaderboard`): one board for `experiment`, or one per experiment
    with results. `BadInput` for an unknown experiment."""
    return [Leaderboard.from_dict(b) for b in boards(experiment, settings)]


def experiment(name: str, *, settings: Optional[Settings] = None) -> Experiment:
    """An experiment by what `--experiment` takes (a bundled name, a folder or its `autoresearch.toml`, a W&B
    sweep file, a name used before): its metric, direction and search space. `BadInput` when there is none."""
    from orchestrator.agent.runner import load_spec

    spec = load_spec(name, settings)
    return Experiment(name=spec.name, metric=spec.metric, direction=spec.direction,
                      description=spec.description, space=tuple(spec.space.describe()), source=spec.source)


def experiments(*, settings: Optional[Settings] = None) -> list[str]:
    """The names `experiment` knows: the bundled experiments, then the config files used before on this home."""
    from experiments import registry

    return list(registry.all_names((settings or Settings.load()).home))


class Service:
    """A queue service running in this process's threads (`autoresearch serve` runs the same in the foreground),
    so that a notebook's jobs run: `stop()` it, or use it as a context manager. Jobs still running when it
    stops keep running, and the next service on this home adopts them."""

    def __init__(self, inner: Any):
        self._inner = inner

    @property
    def devices(self) -> list[str]:
        """The devices it schedules."""
        return list(self._inner.device_names)

    def stop(self) -> None:
        """Stop scheduling."""
        self._inner.stop()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(devices: Optional[str] = None, *, preempt_after: Optional[float] = None,
          settings: Optional[Settings] = None) -> Service:
    """Start a queue service for this home in background threads and return it (`BadInput` when one already
    runs for this home). `devices`: `auto`, `cpu:N` (N virtual slots) or a list `0,1,3` (default: the setting)."""
    from orchestrator.service.daemon import Service as Daemon

    return Service(Daemon(settings or Settings.load(), devices=devices, preempt_after=preempt_after).start())
