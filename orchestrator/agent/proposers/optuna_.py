"""Optuna samplers (TPE, CMA-ES, random) driven ask-and-tell from the experiment's history.

TPE and random search build a fresh in-memory study on each call and add every observation with `add_trial`:
finished trials of the experiment (including runs people submitted by hand), pruned ones with the intermediate
values they reached, failures, and the session's trials still in flight as RUNNING (TPE's constant liar then
keeps parallel asks apart). Rebuilding is cheap at these sizes and means nothing has to survive a crash.
CMA-ES cannot be rebuilt that way: it learns only from trials it asked itself (its generation and search
distribution live on them), so a study rebuilt from `add_trial`s samples its starting distribution forever.
It keeps one study for the life of the proposer and `tell`s it the results of its own asks (matched by
params), adding other trials once; a resumed session rebuilds it from the history and adapts from there.

Starting near the baseline (the session's first runs, the experiment's defaults): the baseline's runs are in
the history like any trial, and until `n_startup_trials` trials have finished, TPE's asks are `enqueue_trial`s
of one-parameter moves of the incumbent (the best finished configuration, else the baseline) instead of uniform
draws: each start-up trial changes one parameter, the next one in a seeded order, by a clear step (a fifth of
its range, log range for log scales, up or down; another value for a category). A move that beats the
incumbent becomes the incumbent, so the later moves build on it (a greedy coordinate search), and every
trial says which single change it measured. Parameters that switch a branch of the space (`arch`, when other
parameters depend on it) are left to the model-based phase: a one-parameter switch would run the other
branch at defaults tuned for this one. Measured on digits (`benchmarks/digits_moves.py`): random neighbours
(every number nudged, each category flipped with probability 1/4) rarely changed the one thing that helps.
CMA-ES starts its search distribution at the incumbent (`x0`) and takes the categories from a random
perturbation while starting up. `random` stays uniform: it is the reference the others are measured against.
"""

from __future__ import annotations

import logging
import math
import warnings
import zlib
from typing import Any, Sequence

from experiments.registry import ExperimentSpec
from orchestrator.agent.proposers.base import Observation, Proposal

log = logging.getLogger(__name__)


class SamplerProposer:
    """`tpe`, `cmaes` or `random` proposals for one experiment.

    `n_startup_trials`: finished trials before TPE models the space itself; until then (with a baseline) its
    asks are one-parameter moves of the incumbent. 10, measured on the benchmark's synthetic landscape
    (samplers alone, 16 trials from a 3-seed baseline, 30 seeds, the noise gate deciding): with random
    neighbours as the start, 5 start-up trials won 22/30, 10 won 26/30. One-parameter moves win 24/30 there
    (a smooth valley where every parameter matters a little) and 6/6 against 3/6 on digits, where a few
    parameters matter a lot (`benchmarks/digits_moves.py --search tpe --sessions 6`, 8 search trials).
    """

    def __init__(self, spec: ExperimentSpec, kind: str = "tpe", *, seed: int = 0, n_startup_trials: int = 10,
                 baseline: dict[str, Any] | None = None):
        if kind not in ("tpe", "cmaes", "random"):
            raise ValueError(f"unknown sampler {kind!r}")
        self.spec = spec
        self.name = kind
        self.seed = seed
        self.n_startup_trials = n_startup_trials
        self.baseline = spec.space.validate(baseline) if baseline is not None else None
        self._live: Any = None  # CMA-ES: the study kept across calls
        self._asked: dict[str, int] = {}  # CMA-ES: params key -> trial number of its asks not yet told
        self._added: set[tuple] = set()  # CMA-ES: observations already in the live study

    def _sampler(self, n_seen: int, incumbent: dict[str, Any] | None = None) -> Any:
        import optuna

        # A different seed per history length: the same history gives the same proposals (reproducible runs),
        # a longer one gives new points even though the study is rebuilt each time.
        # The sampler's name is in the seed so random search and TPE's random start-up draw different points.
        seed = zlib.crc32(f"{self.name}:{self.seed}:{n_seen}".encode())
        if self.name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if self.name == "cmaes":
            # Categorical params go to the independent sampler by design; no need to warn about each.
            x0 = {k: v for k, v in (incumbent or {}).items()
                  if k in self.spec.space.dims and not hasattr(self.spec.space.dims[k], "choices")}
            with warnings.catch_warnings():
                # `x0` is deprecated from optuna 4.9 (to leave in 6.0) with no replacement yet: keep it.
                warnings.simplefilter("ignore", FutureWarning)
                return optuna.samplers.CmaEsSampler(seed=seed, x0=x0 or None,
                                                    n_startup_trials=0 if x0 else self.n_startup_trials,
                                                    warn_independent_sampling=False)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.n_startup_trials, multivariate=True,
                                          group=True, constant_liar=True)

    def study(self, history: Sequence[Observation]) -> Any:
        """An in-memory study holding `history` (observations that do not fit the space are skipped)."""
        import optuna
        from optuna.trial import TrialState, create_trial

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(direction=self.spec.direction,
                                    sampler=self._sampler(len(history), self.incumbent(history)))
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

    def incumbent(self, history: Sequence[Observation]) -> dict[str, Any] | None:
        """The finished configuration in `history` with the best mean over its runs that fits the space, else
        the baseline. By mean, not best run: the baseline's best of 5 seeds is a lucky draw that a real
        one-parameter improvement, run once, would have to beat."""
        sign = 1.0 if self.spec.direction == "minimize" else -1.0
        groups: dict[str, tuple[dict[str, Any], list[float]]] = {}
        for o in history:
            if o.state != "complete" or o.value is None:
                continue
            try:
                params = self.spec.space.validate(o.params)
            except Exception:  # from an older space
                continue
            groups.setdefault(_key(params), (params, []))[1].append(o.value)
        if not groups:
            return self.baseline
        params, _ = min(groups.values(), key=lambda g: sign * sum(g[1]) / len(g[1]))
        return params

    def propose(self, n: int, history: Sequence[Observation]) -> list[Proposal]:
        """`n` proposals; trials asked earlier in the same call count as pending for the later ones."""
        import random as stdlib_random

        study = self._cmaes_study(history) if self.name == "cmaes" else self.study(history)
        finished = sum(1 for o in history if o.state in ("complete", "pruned") and o.proposer != "baseline")
        incumbent = self.incumbent(history)
        rng = stdlib_random.Random(zlib.crc32(f"near:{self.name}:{self.seed}:{len(history)}".encode()))
        out = []
        # The start-up moves go through the parameters in a seeded order; trials in flight took the first ones.
        order = movable(self.spec)
        stdlib_random.Random(zlib.crc32(f"order:{self.seed}".encode())).shuffle(order)
        order = [name for name in order if incumbent is not None and self.spec.space.active(name, incumbent)]
        moved = sum(1 for o in history if o.proposer != "baseline")
        for i in range(n):
            if self.name != "random" and incumbent is not None and finished + i < self.n_startup_trials:
                if self.name == "cmaes":  # CMA-ES moves the numbers around x0 itself; it draws categories at random
                    near = perturb(self.spec, incumbent, rng)
                    near = {k: v for k, v in near.items() if hasattr(self.spec.space.dims[k], "choices")}
                else:
                    near = one_move(self.spec, incumbent, order[(moved + i) % len(order)], rng) if order else \
                        perturb(self.spec, incumbent, rng)
                study.enqueue_trial(near, skip_if_exists=True)
            trial = study.ask()
            params = self.spec.space.validate(self.spec.space.suggest(trial))
            if self.name == "cmaes":
                self._asked[_key(params)] = trial.number
            out.append(Proposal(params=params, proposer=self.name))
        return out

    def _cmaes_study(self, history: Sequence[Observation]) -> Any:
        """The live CMA-ES study, told what became of its asks; built from `history` on the first call."""
        from optuna.trial import TrialState, create_trial

        ended = {"complete": TrialState.COMPLETE, "failed": TrialState.FAIL, "pruned": TrialState.PRUNED}
        if self._live is None:
            self._live = self.study(history)
            self._added = {_obs_key(o) for o in history}
            return self._live
        for obs in history:
            state = ended.get(obs.state)
            if state is None or _obs_key(obs) in self._added or (state == TrialState.COMPLETE and obs.value is None):
                continue
            self._added.add(_obs_key(obs))
            try:
                params = self.spec.space.validate(obs.params)
                number = self._asked.pop(_key(params), None)
                if number is not None:
                    self._live.tell(number, obs.value if state == TrialState.COMPLETE else None, state=state)
                else:
                    self._live.add_trial(create_trial(
                        state=state, value=obs.value if state == TrialState.COMPLETE else None, params=params,
                        distributions=self.spec.space.distributions(params)))
            except Exception as exc:  # from an older space, or told already
                log.debug("skipping observation %s: %s", obs.params, exc)
        return self._live


def _key(params: dict[str, Any]) -> str:
    return repr(sorted((k, repr(v)) for k, v in params.items()))


def _obs_key(obs: Observation) -> tuple:
    return (_key(obs.params), obs.state, obs.value, obs.source)


def perturb(spec: ExperimentSpec, params: dict[str, Any], rng: Any, scale: float = 0.1) -> dict[str, Any]:
    """A random neighbour of `params`: numbers moved by about `scale` of their range (log range for log
    scales), categories changed with probability 1/4; conditions and bounds respected."""
    from experiments.space import Categorical, Float

    out: dict[str, Any] = {}
    for name, dim in spec.space.dims.items():
        if not spec.space.active(name, out):
            continue
        value = params.get(name, dim.default)
        if isinstance(dim, Categorical):
            out[name] = rng.choice(dim.choices) if value is None or rng.random() < 0.25 else value
            continue
        lo, hi = (math.log(dim.low), math.log(dim.high)) if dim.log else (dim.low, dim.high)
        if value is None:
            value = math.exp((lo + hi) / 2) if dim.log else (lo + hi) / 2
        x = (math.log(value) if dim.log else value) + rng.gauss(0.0, scale * (hi - lo))
        x = min(hi, max(lo, x))
        x = math.exp(x) if dim.log else x
        out[name] = min(dim.high, max(dim.low, float(x) if isinstance(dim, Float) else int(round(x))))
    return out


def movable(spec: ExperimentSpec) -> list[str]:
    """The parameters a one-parameter move may change: all but those other parameters' conditions refer to."""
    switches = {dim.when[0] for dim in spec.space.dims.values() if dim.when is not None}
    return [name for name in spec.space.dims if name not in switches]


def one_move(spec: ExperimentSpec, params: dict[str, Any], name: str, rng: Any, step: float = 0.2
             ) -> dict[str, Any]:
    """`params` with parameter `name` moved: a number by `step` of its (log) range, up or down at random (the
    other way at a bound), a category to another of its values. An inactive parameter leaves `params` as is."""
    from experiments.space import Categorical, Float

    out = dict(params)
    dim = spec.space.dims[name]
    if not spec.space.active(name, params):
        return out
    value = params.get(name, dim.default)
    if isinstance(dim, Categorical):
        others = [c for c in dim.choices if c != value]
        if others:
            out[name] = rng.choice(others)
        return out
    lo, hi = (math.log(dim.low), math.log(dim.high)) if dim.log else (dim.low, dim.high)
    x = math.log(value) if dim.log else value
    delta = step * (hi - lo) * (1 if rng.random() < 0.5 else -1)
    if not lo <= x + delta <= hi:
        delta = -delta
    x = min(hi, max(lo, x + delta))
    x = math.exp(x) if dim.log else x
    out[name] = min(dim.high, max(dim.low, float(x) if isinstance(dim, Float) else int(round(x))))
    return out
