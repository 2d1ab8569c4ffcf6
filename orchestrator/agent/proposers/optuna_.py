"""Optuna samplers (TPE, CMA-ES, random) driven ask-and-tell from the experiment's history.

Each call builds a fresh in-memory study and adds every observation with `add_trial`: finished trials of the
experiment (including runs people submitted by hand), pruned ones with the intermediate values they reached,
failures, and the session's trials still in flight as RUNNING (TPE's constant liar then keeps parallel asks
apart). Rebuilding is cheap at these sizes and means nothing about the sampler has to survive a crash.
"""

from __future__ import annotations

import logging
import warnings
import zlib
from typing import Any, Sequence

from experiments.registry import ExperimentSpec
from orchestrator.agent.proposers.base import Observation, Proposal

log = logging.getLogger(__name__)


class SamplerProposer:
    """`tpe`, `cmaes` or `random` proposals for one experiment."""

    def __init__(self, spec: ExperimentSpec, kind: str = "tpe", *, seed: int = 0, n_startup_trials: int = 5):
        if kind not in ("tpe", "cmaes", "random"):
            raise ValueError(f"unknown sampler {kind!r}")
        self.spec = spec
        self.name = kind
        self.seed = seed
        self.n_startup_trials = n_startup_trials

    def _sampler(self, n_seen: int) -> Any:
        # 5 random start-up points rather than Optuna's 10: sessions here run tens of trials, not hundreds.
        import optuna

        # A different seed per history length: the same history gives the same proposals (reproducible runs),
        # a longer one gives new points even though the study is rebuilt each time.
        # The sampler's name is in the seed so random search and TPE's random start-up draw different points.
        seed = zlib.crc32(f"{self.name}:{self.seed}:{n_seen}".encode())
        if self.name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if self.name == "cmaes":
            # Categorical params go to the independent sampler by design; no need to warn about each.
            return optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=self.n_startup_trials,
                                                warn_independent_sampling=False)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.n_startup_trials, multivariate=True,
                                          group=True, constant_liar=True)

    def study(self, history: Sequence[Observation]) -> Any:
        """An in-memory study holding `history` (observations that do not fit the space are skipped)."""
        import optuna
        from optuna.trial import TrialState, create_trial

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(direction=self.spec.direction, sampler=self._sampler(len(history)))
        states = {"complete": TrialState.COMPLETE, "failed": TrialState.FAIL, "pruned": TrialState.PRUNED,
                  "running": TrialState.RUNNING}
        for obs in history:
            state = states.get(obs.state)
            if state is None or (state == TrialState.COMPLETE and obs.value is None):
                continue
            try:
                params = self.spec.space.validate(obs.params)
                study.add_trial(create_trial(
                    state=state, value=obs.value if state == TrialState.COMPLETE else None, params=params,
                    distributions=self.spec.space.distributions(params),
                    intermediate_values=dict(obs.intermediate) if state == TrialState.PRUNED else None))
            except Exception as exc:  # a hand-submitted run from an older space, say: not worth failing over
                log.debug("skipping observation %s: %s", obs.params, exc)
        return study

    def propose(self, n: int, history: Sequence[Observation]) -> list[Proposal]:
        """`n` proposals; trials asked earlier in the same call count as pending for the later ones."""
        study = self.study(history)
        out = []
        for _ in range(n):
            trial = study.ask()
            params = self.spec.space.validate(self.spec.space.suggest(trial))
            out.append(Proposal(params=params, proposer=self.name))
        return out
