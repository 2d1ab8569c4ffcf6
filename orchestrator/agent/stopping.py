"""Asynchronous successive halving (ASHA) over intermediate MLflow metrics.

Rungs sit at `grace * eta**k` progress reports (the agent numbers a trial's evaluations 1, 2, 3, ...; digits
reports once per epoch), below the trial's full budget when that is known. When a trial first reports at or
past a rung, the value it reported there is its rung value; once at least `eta`
trials have a value at that rung, a trial outside the top `1/eta` of them is stopped. Stopping is a pause: the
agent demotes the job, so it checkpoints and waits in line, and `promotable` later picks paused trials that
the rung has since come to rank in its top `1/eta` (later trials did worse), to resume from their checkpoint.

Pure functions over plain dicts (the agent's checkpointed state), so every decision is unit-testable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from orchestrator.core.direction import Direction


@dataclass(frozen=True)
class ASHA:
    """Rung layout and the halving rule. `direction` is the progress metric's."""

    grace: int = 1
    eta: int = 3
    max_step: int | None = None
    direction: Direction = Direction.MINIMIZE

    def __post_init__(self) -> None:
        if self.grace < 1 or self.eta < 2:
            raise ValueError("ASHA needs grace >= 1 and eta >= 2")
        object.__setattr__(self, "direction", Direction.of(self.direction))

    @classmethod
    def for_budget(cls, max_step: int | None, direction: str, eta: int = 3, rungs: int = 3) -> "ASHA":
        """Rungs spread over a trial of `max_step` steps: the first at max_step / eta**rungs (at least 1)."""
        grace = max(1, int(max_step // eta**rungs)) if max_step else 1
        return cls(grace=grace, eta=eta, max_step=max_step, direction=direction)

    def rungs(self) -> list[int]:
        """Rung steps below 80% of the full budget (stopping a trial that is nearly done saves nothing)."""
        out, step, k = [], self.grace, 0
        while self.max_step is None and k < 12 or self.max_step is not None and step < 0.8 * self.max_step:
            out.append(step)
            k += 1
            step = self.grace * self.eta**k
        return out

    def rung_values(self, history: Sequence[tuple[int, float]]) -> dict[int, float]:
        """For each rung reached in `history` ((step, value) by step), the value first logged at or past it."""
        out: dict[int, float] = {}
        for rung in self.rungs():
            for step, value in history:
                if step >= rung and math.isfinite(value):
                    out[rung] = value
                    break
        return out

    def keep(self, value: float, peers: Iterable[float]) -> bool:
        """Whether `value` is in the top 1/eta of `peers` (which include it); True while peers are few."""
        ranked = sorted(peers, key=self.direction.key)
        if len(ranked) < self.eta:
            return True
        top = ranked[: max(1, len(ranked) // self.eta)]
        return value in top or self.direction.at_least_as_good(value, top[-1])

    def judge(self, trial: Mapping, trials: Sequence[Mapping]) -> int | None:
        """The first unjudged rung at which `trial` falls outside the top 1/eta, or None to let it go on.

        Trials carry `rungs` ({str(step): value}) and `judged` (rung steps already ruled on).
        """
        judged = set(trial.get("judged", ()))
        for key, value in sorted(trial.get("rungs", {}).items(), key=lambda kv: int(kv[0])):
            if int(key) in judged:
                continue
            peers = [t["rungs"][key] for t in trials if key in t.get("rungs", {})]
            if not self.keep(value, peers):
                return int(key)
        return None

    def promotable(self, paused: Sequence[Mapping], trials: Sequence[Mapping]) -> list[Mapping]:
        """Paused trials that now rank in the top 1/eta at the rung where they were stopped, best first."""
        out = []
        for t in paused:
            rung = t.get("stopped_at")
            if rung is None:
                continue
            key = str(rung)
            peers = [p["rungs"][key] for p in trials if key in p.get("rungs", {})]
            if len(peers) >= self.eta * 2 and self.keep(t["rungs"][key], peers):
                out.append(t)
        return sorted(out, key=lambda t: self.direction.key(t["rungs"][str(t["stopped_at"])]))

    def most_promising(self, paused: Sequence[Mapping]) -> list[Mapping]:
        """Paused trials by how far they got and how well they did there: the furthest rung first, the best
        value at it first (what a session finishes when it has no time left to wait for promotions)."""
        out = [t for t in paused if t.get("stopped_at") is not None and str(t["stopped_at"]) in t.get("rungs", {})]
        return sorted(out, key=lambda t: (-int(t["stopped_at"]), self.direction.key(t["rungs"][str(t["stopped_at"])])))
