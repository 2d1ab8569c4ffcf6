"""Packing a session's trials onto its GPUs: the first k from recorded measurements, and the controller that
checks it on the trials' throughput (pure: `orchestrator.agent.packing`)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.agent.packing import (K_MAX, Controller, Decision, Measurement, gpus_for, initial_k, is_oom,
                                        parse, power_below, trials_per_hour)
from orchestrator.core.errors import BadInput

# Recorded from baseline runs (MB as MLflow's system metrics log them; % of the device busy while alone).
H200 = 143_771.0
DIGITS_ON_H200 = [Measurement(2400.0, H200, 12.0), Measurement(2380.0, H200, 11.0), Measurement(2410.0, H200, 12.0)]
BIG_MODEL = [Measurement(61_000.0, H200, 35.0)]  # memory-bound: 1 fits at 80% headroom... of 115 GB: 1
BUSY = [Measurement(3000.0, H200, 92.0)]  # compute-bound: already fills the device


# -- gpus_for, parse ---------------------------------------------------------------------------------------------------

def test_gpus_for_is_a_whole_device_at_k_1_and_the_share_1_over_k_above():
    assert gpus_for(1) == 1 and isinstance(gpus_for(1), int)
    assert [gpus_for(k) for k in (2, 4, 8, 16)] == [0.5, 0.25, 0.125, 0.0625]
    assert gpus_for(0) == 1  # never less than one trial per device


@pytest.mark.parametrize("given_, expected", [("auto", "auto"), ("AUTO", "auto"), (" auto ", "auto"), ("1", 1),
                                              ("16", 16), (4, 4), (" 8 ", 8)])
def test_parse_accepts_auto_and_1_to_16(given_, expected):
    assert parse(given_) == expected


@pytest.mark.parametrize("bad", ["0", "17", 0, 17, -1, "-2", "two", "", "1.5", 1.5, True, None, "0.25"])
def test_parse_refuses_anything_else_in_one_line(bad):
    with pytest.raises(BadInput) as err:
        parse(bad)
    assert "--trials-per-gpu must be auto or an integer from 1 to 16" in str(err.value)
    assert "\n" not in str(err.value)


def test_power_below_and_oom_reason():
    assert [power_below(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 47)] == [1, 2, 2, 4, 4, 8, 8, 16, 32]
    assert is_oom("out of GPU memory while sharing its device: requeued to run alone")
    assert is_oom("Out of GPU memory") and not is_oom("exit code 1") and not is_oom("") and not is_oom(None)


# -- initial_k ---------------------------------------------------------------------------------------------------------

def test_small_trials_on_a_big_gpu_pack_by_how_busy_they_keep_it():
    d = initial_k(DIGITS_ON_H200)
    # fits floor(0.8 * 143.8 GB / 2.41 GB) = 47; busy 12% -> ceil(80 / 12) = 7; a power of two at most 7: 4.
    assert d.k == 4 and d.fit == 16
    assert d.evidence.startswith("k=4: 3 baseline run(s) peak 2.41 GB of 144 GB, busy 12% -> fits 47, busy target "
                                 "80% -> 7; chose 4")
    assert "\n" not in d.evidence


def test_memory_bound_trials_stay_alone():
    d = initial_k(BIG_MODEL)  # 0.8 * 143.8 / 61 = 1.88 -> 1
    assert (d.k, d.fit) == (1, 1) and "fits 1" in d.evidence


def test_a_trial_bigger_than_the_headroom_runs_alone_and_says_so():
    d = initial_k([Measurement(130_000.0, H200, 50.0)])
    assert d.k == 1 and d.fit == 1 and "fits 0" in d.evidence and "more than the headroom" in d.evidence


def test_a_busy_trial_stays_alone():
    d = initial_k(BUSY)
    assert d.k == 1 and "busy 92%" in d.evidence and "-> 1; chose 1" in d.evidence


def test_the_worst_run_decides():
    runs = [Measurement(1000.0, H200, 10.0), Measurement(20_000.0, 80_000.0, 30.0)]
    d = initial_k(runs)
    # largest peak, smallest device: 0.8 * 80000 / 20000 = 3 fit; largest busy: ceil(80 / 30) = 3 -> 2
    assert d.k == 2 and d.fit == 3 and "fits 3" in d.evidence and "-> 3; chose 2" in d.evidence


def test_idle_or_tiny_trials_are_capped_at_16():
    d = initial_k([Measurement(0.0, H200, 0.0)])
    assert d.k == 16 and d.fit == 16
    assert initial_k([Measurement(10.0, H200, 1.0)]).k == 16


def test_settings_change_the_answer():
    assert initial_k(DIGITS_ON_H200, target_busy=0.4).k == 4  # ceil(40 / 12) = 4
    assert initial_k(DIGITS_ON_H200, target_busy=1.0).k == 8  # ceil(100 / 12) = 9 -> 8
    assert initial_k(DIGITS_ON_H200, headroom=0.05).k == 2  # 0.05 * 143.8 / 2.41 = 2.98 -> 2 fit
    assert initial_k(DIGITS_ON_H200, k_max=2).k == 2


@pytest.mark.parametrize("runs, missing", [
    ([], "no baseline run to measure"),
    ([Measurement(None, H200, 10.0)], "peak memory"),
    ([Measurement(2000.0, None, 10.0)], "device memory"),
    ([Measurement(2000.0, H200, None)], "utilisation"),
    ([Measurement()], "peak memory, device memory, utilisation"),
    ([Measurement(2000.0, H200, 10.0), Measurement(2000.0, H200, None)], "utilisation"),
])
def test_missing_measurements_mean_one_per_gpu_and_say_why(runs, missing):
    d = initial_k(runs)
    assert d.k == 1 and d.fit is None and missing in d.evidence and d.evidence.startswith("k=1: ")


measurement = st.builds(Measurement, st.floats(0, 200_000), st.floats(1, 200_000), st.floats(0, 100))


@given(st.lists(measurement, min_size=1, max_size=5), st.floats(0.05, 1.0), st.floats(0.05, 1.0))
def test_k_is_always_a_power_of_two_that_fits(runs, target, headroom):
    d = initial_k(runs, target_busy=target, headroom=headroom)
    assert 1 <= d.k <= K_MAX and d.k & (d.k - 1) == 0
    peak, device = max(m.peak_memory_mb for m in runs), min(m.device_memory_mb for m in runs)
    if d.k > 1:
        assert d.k * peak <= headroom * device + 1e-6  # k of them fit in the headroom
        assert d.k <= d.fit


# -- Controller --------------------------------------------------------------------------------------------------------

def test_raises_while_throughput_pays_then_steps_back_and_holds():
    c = Controller(k=4, fit=16, prev_k=1, prev_tph=20.0)  # the baseline alone ran 20 trials/hour
    d = c.observe(41.0)  # k=4 over k=1: +105%
    assert d.k == 8 and d.evidence == "k 4 -> 8 (trials/hour 20 -> 41, +105%); trying 8"
    d = c.observe(77.0)  # k=8: +88%
    assert d.k == 16 and d.evidence == "k 8 -> 16 (trials/hour 41 -> 77, +88%); trying 16"
    d = c.observe(80.0)  # k=16: +4%, under +15%: back to 8, for good
    assert d.k == 8 and c.held and d.evidence == "k 16 -> 8 (trials/hour 77 -> 80, +4%, under +15%); holding 8"
    assert c.observe(500.0) is None and c.k == 8  # held: no more rounds
    assert c.rounds == [[4, 41.0], [8, 77.0], [16, 80.0]]


def test_a_drop_steps_back_at_once():
    c = Controller(k=2, fit=16, prev_k=1, prev_tph=30.0)
    d = c.observe(25.0)
    assert (d.k, c.held) == (1, True) and "-17%, under +15%" in d.evidence


def test_exactly_plus_15_percent_is_kept():
    c = Controller(k=2, fit=16, prev_k=1, prev_tph=100.0)
    assert c.observe(115.0).k == 4


def test_the_memory_fit_caps_the_raise():
    c = Controller(k=4, fit=6, prev_k=1, prev_tph=10.0)
    d = c.observe(40.0)
    assert d.k == 6 and "trying 6" in d.evidence  # k x 2 = 8 does not fit: the fit itself
    d = c.observe(60.0)
    assert d.k == 6 and c.held and d.evidence == "k 6 held (trials/hour 40 -> 60, +50%; 6 is the most that fit)"


def test_without_a_reference_the_first_round_is_the_reference():
    c = Controller(k=2, fit=16)
    d = c.observe(50.0)
    assert d.k == 4 and d.evidence == "k 2 -> 4 (trials/hour 50 at k=2); trying 4"
    assert (c.prev_k, c.prev_tph) == (2, 50.0)


def test_at_the_fit_from_the_start_it_holds():
    c = Controller(k=4, fit=4)
    d = c.observe(50.0)
    assert d.k == 4 and c.held and "4 is the most that fit" in d.evidence


def test_k_and_fit_are_clamped():
    c = Controller(k=40, fit=99)
    assert (c.k, c.fit) == (16, 16)
    c = Controller(k=8, fit=3)
    assert c.k == 3
    assert Controller(k=0, fit=0).k == 1


def test_zero_reference_throughput_counts_any_rate_as_a_rise():
    c = Controller(k=2, fit=16, prev_k=1, prev_tph=0.0)
    d = c.observe(5.0)
    assert d.k == 4 and "+inf%" in d.evidence


def test_an_oom_at_k_steps_back_to_the_previous_k_and_holds():
    c = Controller(k=4, fit=16, prev_k=1, prev_tph=20.0)
    c.observe(41.0)  # trying 8, previous 4
    d = c.oom(8, "trial 12 (job 40)")
    assert d.k == 4 and c.held and c.fit == 7
    assert d.evidence == "k 8 -> 4 (trial 12 (job 40) ran out of GPU memory at k=8); holding 4"
    assert c.observe(1000.0) is None  # held


def test_an_oom_steps_back_to_half_when_the_previous_k_is_further_below():
    c = Controller(k=4, fit=16, prev_k=1, prev_tph=20.0)  # the first packed round: 1 is the baseline alone
    d = c.oom(4)
    assert d.k == 2 and c.fit == 3
    c = Controller(k=6, fit=6, prev_k=4, prev_tph=20.0)  # 4 was kept, 6 (the fit) ran out: back to 4, not 3
    assert c.oom(6).k == 4


def test_an_oom_without_a_smaller_previous_k_halves():
    c = Controller(k=8, fit=16)
    d = c.oom(8)
    assert d.k == 4 and "a packed trial ran out of GPU memory at k=8" in d.evidence


def test_an_oom_of_an_older_larger_k_is_ignored_and_a_smaller_one_steps_below_it():
    c = Controller(k=4, fit=16, prev_k=2, prev_tph=10.0)
    assert c.oom(8) is None and c.k == 4 and not c.held  # we already left k=8
    assert c.oom(1) is None  # a trial alone: nothing to step back from
    d = Controller(k=8, fit=16, prev_k=4, prev_tph=10.0).oom(4)  # a trial of the k=4 round: 4 is too many too
    assert d.k == 2


def test_even_a_held_controller_steps_back_on_an_oom():
    c = Controller(k=8, fit=16, prev_k=4, prev_tph=10.0, held=True)
    assert c.oom(8).k == 4


def test_state_round_trips_through_json_and_continues_where_it_was():
    c = Controller(k=4, fit=12, prev_k=1, prev_tph=20.0)
    c.observe(41.0)
    saved = json.loads(json.dumps(c.to_dict()))
    resumed = Controller.from_dict({**saved, "from_a_later_version": 1})
    assert resumed == c
    assert resumed.observe(77.0) == c.observe(77.0)
    assert resumed.to_dict() == c.to_dict()


@given(st.integers(1, 16), st.integers(1, 16), st.lists(st.floats(0, 10_000), min_size=1, max_size=12),
       st.lists(st.integers(1, 16), max_size=3))
def test_k_stays_within_1_and_the_fit_and_ends_held(k, fit, rates, ooms):
    c = Controller(k=k, fit=fit)
    for tph in rates:
        d = c.observe(tph)
        assert 1 <= c.k <= c.fit <= 16
        assert d is None or (d.k == c.k and "\n" not in d.evidence)
    for at in ooms:
        c.oom(at)
        assert 1 <= c.k <= c.fit
    if len(rates) >= 5:  # k doubles at most 4 times (1 -> 16), then holds
        assert c.held


# -- trials_per_hour ---------------------------------------------------------------------------------------------------

def test_trials_per_hour_is_in_flight_over_the_median_time():
    assert trials_per_hour([60.0, 60.0, 60.0], 1) == 60.0
    assert trials_per_hour([100.0, 90.0, 3600.0, 110.0], 4) == 4 * 3600 / 110.0  # an outlier barely moves it
    assert trials_per_hour([], 2) is None and trials_per_hour([0.0], 2) is None and trials_per_hour([5.0], 0) is None


def test_decision_is_a_value():
    assert Decision(2, "why") == Decision(2, "why", None)
