"""The noise gate: noise is never a win, a clear improvement is, in either metric direction."""

from __future__ import annotations

import math

import pytest

from orchestrator.core.gate import NOISE_FLOOR_REL, Verdict, gate

BASELINE = [0.9611, 0.9583, 0.9639]  # digits defaults over 3 seeds: mean 0.9611, std 0.0028


def test_candidate_within_noise_is_not_a_win():
    v = gate(BASELINE, [0.9639, 0.9611, 0.9667])  # +0.0028, one std of seed noise
    assert not v.win
    assert v.ci[0] < 0 < v.ci[1]
    assert v.describe().startswith("no improvement over the baseline")


def test_clearly_better_candidate_is_a_win_with_its_interval():
    v = gate(BASELINE, [0.9805, 0.9778, 0.9833])
    assert v.win
    assert v.delta == pytest.approx(0.0194, abs=1e-4)
    assert 0 < v.ci[0] < v.delta < v.ci[1]
    assert (v.n_baseline, v.n_candidate, v.level) == (3, 3, 0.95)
    assert v.baseline_mean == pytest.approx(0.9611)
    assert "Welch" in v.method
    text = v.describe()
    assert text.startswith("improvement +0.0194 (95% CI +")
    assert "over baseline 0.9611 ± 0.0028, 3 seeds" in text


def test_a_worse_candidate_has_a_negative_delta():
    v = gate(BASELINE, [0.90, 0.91, 0.905])
    assert not v.win and v.delta < 0 and v.ci[1] < 0


def test_minimize_flips_the_sign_so_positive_is_better():
    loss_base, loss_cand = [0.30, 0.31, 0.29], [0.20, 0.21, 0.19]
    v = gate(loss_base, loss_cand, direction="minimize")
    assert v.win and v.delta == pytest.approx(0.10)
    assert v.candidate_mean == pytest.approx(0.20)  # means stay in the metric's own units
    assert not gate(loss_base, loss_cand, direction="maximize").win


def test_a_single_candidate_run_is_never_a_win():
    v = gate(BASELINE, [0.999])
    assert not v.win
    assert v.ci == (-math.inf, math.inf)
    assert "no improvement" in v.describe()


def test_a_single_baseline_run_borrows_the_candidate_spread():
    import statistics

    v = gate([0.90], [0.98, 0.981, 0.979])
    assert v.win and "baseline spread borrowed from the candidate" in v.method
    # The half-width is t(0.975, df = 3 - 1) times the candidate's spread over both sides, 1 and 3 runs; a gate
    # that ignored the borrowed spread (zero baseline noise, or Welch on one run) gives another width.
    spread = max(statistics.stdev([0.98, 0.981, 0.979]), NOISE_FLOOR_REL * 0.98)
    assert (v.ci[1] - v.ci[0]) / 2 == pytest.approx(4.302652729749464 * spread * math.sqrt(1 + 1 / 3), rel=1e-9)
    wide = gate([0.90], [0.85, 0.99, 0.92])
    assert not wide.win  # the candidate's own spread swamps its lead
    assert (wide.ci[1] - wide.ci[0]) / 2 == pytest.approx(
        4.302652729749464 * statistics.stdev([0.85, 0.99, 0.92]) * math.sqrt(1 + 1 / 3), rel=1e-9)


def test_identical_values_use_the_noise_floor_not_zero_noise():
    same = [0.96, 0.96, 0.96]
    v = gate(same, same)
    assert not v.win and v.delta == 0
    assert v.ci[0] < 0 < v.ci[1] and math.isfinite(v.ci[0])
    # A difference below the floor stays noise; one many floors away is a win.
    assert not gate(same, [0.96 + NOISE_FLOOR_REL * 0.96 * 0.5] * 3).win
    assert gate(same, [0.97] * 3).win


def test_min_effect_raises_the_bar():
    cand = [0.9705, 0.9678, 0.9733]  # about +0.0094
    assert gate(BASELINE, cand).win
    assert not gate(BASELINE, cand, min_effect=0.01).win


def test_a_higher_level_widens_the_interval():
    cand = [0.9700, 0.9672, 0.9728]
    narrow, wide = gate(BASELINE, cand, level=0.8), gate(BASELINE, cand, level=0.99)
    assert wide.ci[0] < narrow.ci[0] and wide.ci[1] > narrow.ci[1]
    assert "99% CI" in wide.describe() or "99% CI" in wide.method


@pytest.mark.parametrize("kwargs,match", [
    ({"direction": "up"}, "direction"),
    ({"level": 1.0}, "level"),
    ({"min_effect": -0.1}, "min_effect"),
])
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gate(BASELINE, BASELINE, **kwargs)


def test_empty_or_non_finite_sides_are_refused():
    with pytest.raises(ValueError, match="baseline has no runs"):
        gate([], BASELINE)
    with pytest.raises(ValueError, match="non-finite"):
        gate(BASELINE, [0.9, float("nan")])


def test_verdict_is_frozen():
    v = gate(BASELINE, BASELINE)
    assert isinstance(v, Verdict)
    with pytest.raises(AttributeError):
        v.win = True  # type: ignore[misc]
