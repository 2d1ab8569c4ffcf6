"""The part of an experiment's space a session searches: seed and budget held fixed, plus whatever the user fixed.

Searching the seed would chase noise, and searching the budget (epochs, steps) would let a sampler "win" by
training longer; both are held constant while searching, and the seed varies only in the confirmation re-runs.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping, Sequence

from experiments.registry import ExperimentSpec
from experiments.space import SearchSpace, SpaceError
from orchestrator.agent.trial import Phase, Trial, TrialStatus
from orchestrator.core.direction import Direction
from orchestrator.core.errors import BadInput

SEED_KEY = "seed"


def fixed_params(spec: ExperimentSpec, user_fixed: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The params held constant while searching: the budget, the seed, and the user's `--param`s (validated)."""
    fixed: dict[str, Any] = {k: v for k, v in spec.budget.items() if k in spec.space}
    if SEED_KEY in spec.space:
        fixed[SEED_KEY] = seed
    fixed.update(user_fixed)
    for key, value in fixed.items():
        if key not in spec.space:
            raise BadInput(f"--param {key}: {spec.name} has no such parameter; known: {', '.join(spec.space)}")
        try:
            fixed[key] = spec.space.dims[key].coerce(key, value)
        except SpaceError as exc:
            raise BadInput(str(exc)) from None
    return fixed


def reduced(spec: ExperimentSpec, fixed: Mapping[str, Any]) -> ExperimentSpec:
    """`spec` with the fixed params taken out of its space (conditions on them resolved)."""
    dims = {}
    for name, dim in spec.space.dims.items():
        if name in fixed:
            continue
        if dim.when is not None and dim.when[0] in fixed:
            if fixed[dim.when[0]] not in dim.when[1]:
                continue  # its condition can never hold
            dim = dataclasses.replace(dim, when=None)
        dims[name] = dim
    if not dims:
        raise BadInput("every parameter is fixed: there is nothing to search")
    return dataclasses.replace(spec, space=SearchSpace(dims))


def project(params: Mapping[str, Any], space: SearchSpace) -> dict[str, Any]:
    """The params that belong to the searched space."""
    return {k: v for k, v in params.items() if k in space}


def full(spec: ExperimentSpec, searched: Mapping[str, Any], fixed: Mapping[str, Any]) -> dict[str, Any]:
    """A complete, validated param set for a job: the searched values plus the fixed ones."""
    return spec.space.validate({**searched, **fixed})


def baseline_params(spec: ExperimentSpec, overrides: Mapping[str, Any], fixed: Mapping[str, Any]) -> dict[str, Any]:
    """The baseline's params: the spec's defaults, the user's `--baseline` overrides, then the fixed params.

    BadInput for an override of an unknown or fixed parameter, or one outside the space.
    """
    for key in overrides:
        if key not in spec.space:
            raise BadInput(f"--baseline {key}: {spec.name} has no such parameter; known: {', '.join(spec.space)}")
        if key in fixed:
            raise BadInput(f"--baseline {key}: it is held fixed for the whole session (by --param or the budget)")
    try:
        return spec.space.validate({**overrides, **fixed})
    except SpaceError as exc:
        raise BadInput(f"--baseline: {exc}") from None


def seeded(spec: ExperimentSpec, params: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """`params` run on `seed` (unchanged for an experiment without a seed parameter)."""
    return spec.space.validate({**params, SEED_KEY: seed}) if SEED_KEY in spec.space else dict(params)


def config_key(params: Mapping[str, Any]) -> str:
    """One configuration whatever its seed: runs that differ only in the seed share this key."""
    return repr(sorted((k, repr(v)) for k, v in params.items() if k != SEED_KEY))


def confirm_seeds(session_id: str, count: int, avoid: int) -> list[int]:
    """Fresh seeds for the re-runs, stable for a session (a resume picks the same ones).

    The baseline's extra seeds are the first of these too, so candidates and baseline meet on the same seeds.
    """
    out: list[int] = []
    i = 0
    while len(out) < count:
        seed = zlib.crc32(f"{session_id}:confirm:{i}".encode()) % (2**31 - 1)
        if seed != avoid and seed not in out:
            out.append(seed)
        i += 1
    return out


def top_candidates(trials: Sequence[Trial], baseline: Mapping[str, Any], direction: str, k: int
                   ) -> list[tuple[Trial, set[int]]]:
    """The `k` best configurations by mean over their finished search and re-run trials (the baseline's
    configuration excluded), each as (its best trial, the seeds it already ran on)."""
    groups: dict[str, list[Trial]] = {}
    base_key = config_key(baseline)
    for t in trials:
        if t.phase in (Phase.SEARCH, Phase.CONFIRM) and t.status is TrialStatus.SUCCEEDED:
            key = config_key(t.params)
            if key != base_key:
                groups.setdefault(key, []).append(t)
    d = Direction.of(direction)
    ranked = sorted(groups.values(), key=lambda g: d.key(sum(t.value for t in g) / len(g)))
    out = []
    for group in ranked[:k]:
        best = min(group, key=lambda t: d.key(t.value))
        out.append((best, {int(t.params.get(SEED_KEY, -1)) for t in group}))
    return out
