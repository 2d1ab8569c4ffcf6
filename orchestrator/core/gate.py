"""The noise gate: is a candidate's mean over seeds really better than the baseline's, or is it seed noise?

Method: Welch's t-test (unequal variances), as a two-sided confidence interval on the difference of means.
Why Welch and not a bootstrap: a session has 2-5 seeds per side. Resampling 3 values gives at most 10 distinct
means and shrinks the spread by (n-1)/n, so percentile-bootstrap intervals are far too narrow at these sizes
and would call noise a win; Welch's t-distribution with Satterthwaite's degrees of freedom widens the interval
as the seed count drops, which is the honest answer with few seeds. Welch rather than Student because a
candidate (e.g. a higher learning rate) often has a different spread from the baseline.

A candidate wins when the lower end of the CI of its better-positive delta is above `min_effect` (>= 0).

Edge cases, decided so that noise can never pass:
- A candidate with one run can never win (its noise is unknown); its CI is infinite.
- A baseline with one run borrows the candidate's spread (equal-variance assumption, df = n_candidate - 1).
- Identical values (zero spread) are not zero noise: every side's std is floored at `NOISE_FLOOR_REL` times
  the larger |mean| (at least `NOISE_FLOOR_ABS`), so three identical runs still give a finite, honest CI.
- Except where re-runs repeat the very same configuration (`exact=True`: an experiment with no seed
  parameter) and both sides came back identical: the script showed no seed noise, so there is no interval to
  compute; the difference is what it is, and any difference above `min_effect` is a win. The verdict says so
  instead of printing a confidence interval made from zero spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from scipy import stats

from orchestrator.core.direction import Direction

#: The smallest per-run standard deviation the gate believes, relative to the metric's scale: 0.1 %.
#: Deterministic runs (same seed, same data) give identical values; without a floor any difference between
#: two such groups would be "significant" with an interval of zero width.
NOISE_FLOOR_REL = 1e-3
#: The floor for metrics whose means are at or near zero.
NOISE_FLOOR_ABS = 1e-9

DIRECTIONS = tuple(Direction)


@dataclass(frozen=True)
class Verdict:
    """The gate's answer for one candidate against the baseline.

    `delta` and `ci` are signed so that positive means better in the metric's direction (for a minimized loss,
    +0.02 means 0.02 lower). Means and stds are in the metric's own units and sign.
    """

    win: bool
    delta: float
    ci: tuple[float, float]
    level: float
    baseline_mean: float
    baseline_std: float
    n_baseline: int
    candidate_mean: float
    candidate_std: float
    n_candidate: int
    method: str
    exact: bool = False  # re-runs of each side were identical: no seed noise, no interval

    def describe(self) -> str:
        """One line for people: the improvement with its CI over the baseline, or why there is none."""
        if self.exact:
            base = f"baseline {_num(self.baseline_mean)}, {_seeds(self.n_baseline, 're-run')}"
            note = "the re-runs were identical: the experiment showed no seed noise"
            if self.win:
                return f"improvement {_signed(self.delta)} over {base} ({note}, so the difference is exact)"
            return (f"no improvement over the baseline ({base}; candidate {_num(self.candidate_mean)}, "
                    f"{_seeds(self.n_candidate, 're-run')}: {_signed(self.delta)}; {note})")
        pct = f"{self.level * 100:g}%"
        base = f"baseline {_num(self.baseline_mean)} ± {_spread(self.baseline_std)}, {_seeds(self.n_baseline)}"
        interval = f"{pct} CI {_signed(self.ci[0])}..{_signed(self.ci[1])}"
        if self.win:
            return f"improvement {_signed(self.delta)} ({interval}) over {base}"
        cand = (f"candidate {_num(self.candidate_mean)} ± {_spread(self.candidate_std)}, "
                f"{_seeds(self.n_candidate)}: {_signed(self.delta)}, {interval}")
        return f"no improvement over the baseline ({base}; {cand})"


def gate(baseline: Sequence[float], candidate: Sequence[float], *, direction: str = "maximize",
         level: float = 0.95, min_effect: float = 0.0, exact: bool = False) -> Verdict:
    """Compare a candidate's runs (one value per seed) with the baseline's by Welch's t-test; `exact`: the runs
    repeat one configuration with nothing seeded (identical values then mean no noise, see the module doc).

    Raises ValueError for an empty side, a non-finite value, an unknown direction, a level outside (0, 1) or
    a negative `min_effect`.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be between 0 and 1, not {level}")
    if min_effect < 0 or not math.isfinite(min_effect):
        raise ValueError(f"min_effect must be a finite number >= 0, not {min_effect}")
    b, c = _values(baseline, "baseline"), _values(candidate, "candidate")
    sign = 1.0 if direction == Direction.MAXIMIZE else -1.0
    b_mean, c_mean = _mean(b), _mean(c)
    b_std, c_std = _std(b), _std(c)
    delta = sign * (c_mean - b_mean)
    floor = max(NOISE_FLOOR_REL * max(abs(b_mean), abs(c_mean)), NOISE_FLOOR_ABS)
    nb, nc = len(b), len(c)
    if exact and nb >= 2 and nc >= 2 and b_std == 0 and c_std == 0:
        return Verdict(win=delta > min_effect, delta=delta, ci=(delta, delta), level=level, baseline_mean=b_mean,
                       baseline_std=0.0, n_baseline=nb, candidate_mean=c_mean, candidate_std=0.0, n_candidate=nc,
                       method="identical re-runs (no seed noise): the difference is exact", exact=True)
    if nc < 2:
        # One candidate run: its noise is unknown, so no interval can exclude zero.
        ci, method = (-math.inf, math.inf), "single candidate run (never a win)"
    else:
        cs = max(c_std, floor)
        if nb < 2:
            # One baseline run: assume it is as noisy as the candidate.
            se, df = cs * math.sqrt(1 / nb + 1 / nc), nc - 1
            method = f"t-test, baseline spread borrowed from the candidate, {level * 100:g}% CI"
        else:
            bs = max(b_std, floor)
            vb, vc = bs * bs / nb, cs * cs / nc
            se = math.sqrt(vb + vc)
            # Welch-Satterthwaite degrees of freedom.
            df = (vb + vc) ** 2 / (vb * vb / (nb - 1) + vc * vc / (nc - 1))
            method = f"Welch t-test, {level * 100:g}% CI"
        half = float(stats.t.ppf(0.5 + level / 2, df)) * se
        ci = (delta - half, delta + half)
    win = nc >= 2 and ci[0] > min_effect
    return Verdict(win=win, delta=delta, ci=ci, level=level, baseline_mean=b_mean, baseline_std=b_std,
                   n_baseline=nb, candidate_mean=c_mean, candidate_std=c_std, n_candidate=nc, method=method)


def _values(xs: Sequence[float], side: str) -> list[float]:
    values = [float(x) for x in xs]
    if not values:
        raise ValueError(f"the {side} has no runs")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"the {side} has a non-finite value: {values}")
    return values


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: list[float]) -> float:
    """Sample standard deviation (n - 1); 0 for one run."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"


def _spread(x: float) -> str:
    return f"{x:.2g}"


def _signed(x: float) -> str:
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x:+.3g}"


def _seeds(n: int, word: str = "seed") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
