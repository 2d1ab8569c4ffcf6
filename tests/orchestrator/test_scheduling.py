"""Unit tests for the scheduling policy: one test (or a few) per rule of orchestrator.queue.policy."""

from __future__ import annotations

import pytest

from orchestrator.queue.policy import Plan, Running, Waiting, plan

NOW = 1000.0
MIN_RUN = 60.0  # preempt_after in these tests
OLD = NOW - 2 * MIN_RUN  # started long enough ago to be preemptible
DEVS4 = ("0", "1", "2", "3")


def w(id: int, priority: int = 0, gpus: int = 1, submitted_at: float | None = None) -> Waiting:
    submitted = float(id) if submitted_at is None else submitted_at
    return Waiting(id=id, priority=priority, submitted_at=submitted, gpus=gpus)


def r(
    id: int,
    *devices: str,
    priority: int = 0,
    started_at: float = OLD,
    preemptible: bool = True,
    releasing: bool = False,
) -> Running:
    return Running(
        id=id, priority=priority, devices=tuple(devices), started_at=started_at,
        preemptible=preemptible, releasing=releasing,
    )


def run(waiting=(), running=(), devices=DEVS4, now=NOW, preempt_after=MIN_RUN) -> Plan:
    return plan(list(waiting), list(running), devices, now, preempt_after)


# --- basics and order ---------------------------------------------------------------------------


def test_nothing_to_do_gives_an_empty_plan():
    assert run() == Plan()
    assert run(running=[r(9, "0")]) == Plan()


def test_starts_on_the_first_free_devices_in_preference_order():
    p = run([w(1, gpus=2)], [r(9, "1")], devices=("3", "1", "0", "2"))
    assert p.starts == ((1, ("3", "0")),)


def test_order_is_priority_then_submit_time_then_id():
    jobs = [
        w(1, priority=0, submitted_at=0.0),
        w(2, priority=5, submitted_at=9.0),
        w(3, priority=5, submitted_at=3.0),
        w(5, priority=5, submitted_at=3.0),
        w(4, priority=5, submitted_at=3.0),
    ]
    p = run(jobs, devices=("a", "b", "c", "d", "e"))
    assert [job_id for job_id, _ in p.starts] == [3, 4, 5, 2, 1]
    assert p.starts[0] == (3, ("a",))


def test_only_the_best_job_starts_when_one_device_is_free():
    p = run([w(1, priority=1, submitted_at=0.0), w(2, priority=2, submitted_at=5.0)], devices=("0",))
    assert p.starts == ((2, ("0",)),)


def test_a_device_held_by_any_running_job_is_not_free():
    running = [r(8, "0", preemptible=False), r(9, "1", releasing=True), r(7, "x")]  # "x" is not usable
    p = run([w(1), w(2), w(3)], running, devices=("0", "1", "2"))
    assert p.starts == ((1, ("2",)),)


def test_duplicate_devices_are_counted_once():
    p = run([w(1, gpus=2)], devices=("0", "0"))
    assert p == Plan()


# --- all or nothing, oversize jobs ----------------------------------------------------------------


def test_a_multi_gpu_job_gets_all_its_devices_or_none():
    running = [r(9, "0", priority=9)]
    p = run([w(1, gpus=4)], running)
    assert p == Plan()
    p = run([w(1, gpus=3)], running)
    assert p.starts == ((1, ("1", "2", "3")),)


def test_a_job_bigger_than_the_host_is_skipped_and_blocks_nothing():
    p = run([w(1, priority=9, gpus=5), w(2, gpus=1)], [r(9, "0", priority=0)])
    assert p.starts == ((2, ("1",)),)
    assert p.preempt == ()


# --- reservations (no starvation) -----------------------------------------------------------------


def test_a_blocked_job_reserves_free_devices_against_smaller_jobs_behind_it():
    # Job 1 needs all four; one is held by a job that cannot be preempted. The three free devices
    # are held for job 1, so the small job 2 may not take one of them.
    running = [r(9, "0", priority=0, preemptible=False)]
    p = run([w(1, priority=5, gpus=4), w(2, priority=1)], running)
    assert p == Plan()


def test_smaller_jobs_may_start_on_free_devices_the_reservation_does_not_need():
    # Two devices are being released; job 1 (3 devices) counts them and holds one free device,
    # leaving the other free device to job 2.
    running = [r(8, "0", releasing=True), r(9, "1", releasing=True)]
    p = run([w(1, priority=5, gpus=3), w(2, priority=1)], running)
    assert p.starts == ((2, ("3",)),)
    assert p.preempt == ()


def test_a_blocked_job_counts_releasing_devices_before_free_ones():
    # Two devices are being released and cover job 1 completely, so the one free device ("3") is
    # not held for it and job 2 starts there.
    running = [r(8, "0", releasing=True), r(9, "1", releasing=True), r(7, "2", preemptible=False)]
    p = run([w(1, priority=5, gpus=2), w(2)], running)
    assert p.starts == ((2, ("3",)),)
    assert p.preempt == ()


def test_the_reservation_counts_devices_of_its_own_victims():
    # Job 1 (2 devices) preempts job 9 (2 devices, "0" and "1"); the free devices stay usable.
    running = [r(9, "0", "1", priority=0), r(8, "2", priority=9, preemptible=False)]
    p = run([w(1, priority=5, gpus=2), w(2, priority=0)], running, devices=("0", "1", "2", "3"))
    assert p.preempt == (9,)
    assert p.starts == ((2, ("3",)),)


def test_a_job_that_cannot_be_served_even_by_preemption_stops_the_line():
    # Job 1 needs all four devices but job 8 will never be preempted for it: it holds everything,
    # job 2 does not start, and job 3 does not preempt job 9 (whose device would go to job 1 anyway).
    running = [r(8, "0", priority=9, preemptible=False), r(9, "1", priority=0)]
    p = run([w(1, priority=5, gpus=4), w(2, priority=3), w(3, priority=3, gpus=3)], running)
    assert p == Plan()


def test_every_servable_blocked_job_gets_its_own_reservation():
    # Two high jobs each need a device held by a low job: both preempt in the same tick, each its
    # own victim.
    running = [r(8, "0", priority=0), r(9, "1", priority=0, started_at=OLD + 1)]
    p = run([w(1, priority=5), w(2, priority=5)], running, devices=("0", "1"))
    assert p.starts == ()
    assert p.preempt == (9, 8)  # youngest first


def test_a_later_blocked_job_uses_what_is_left_after_earlier_reservations():
    # One device is being released: it goes to job 1 (first in line); job 2 must preempt for itself.
    running = [r(7, "0", releasing=True), r(8, "1", priority=0)]
    p = run([w(1, priority=5), w(2, priority=4)], running, devices=("0", "1"))
    assert p.preempt == (8,)


# --- preemption -----------------------------------------------------------------------------------


def test_a_higher_priority_job_preempts_an_eligible_lower_priority_one():
    p = run([w(1, priority=5)], [r(9, "0", priority=0)], devices=("0",))
    assert p == Plan(starts=(), preempt=(9,))


def test_the_victims_devices_are_not_used_in_the_same_plan():
    p = run([w(1, priority=5), w(2, priority=0)], [r(9, "0", priority=0)], devices=("0",))
    assert p.starts == ()
    assert p.preempt == (9,)


def test_equal_priority_jobs_never_preempt_each_other():
    assert run([w(1, priority=3)], [r(9, "0", priority=3)], devices=("0",)) == Plan()


def test_a_lower_priority_job_never_preempts_a_higher_one():
    assert run([w(1, priority=1)], [r(9, "0", priority=3)], devices=("0",)) == Plan()


def test_non_preemptible_jobs_are_never_preempted():
    assert run([w(1, priority=5)], [r(9, "0", preemptible=False)], devices=("0",)) == Plan()


def test_a_job_younger_than_preempt_after_is_not_preempted():
    young = r(9, "0", started_at=NOW - MIN_RUN + 0.5)
    assert run([w(1, priority=5)], [young], devices=("0",)) == Plan()


def test_a_job_exactly_preempt_after_old_may_be_preempted():
    p = run([w(1, priority=5)], [r(9, "0", started_at=NOW - MIN_RUN)], devices=("0",))
    assert p.preempt == (9,)


def test_a_releasing_job_is_not_preempted_again_and_its_devices_count():
    # Job 8 is already being stopped: its device covers job 1, so job 9 is left alone.
    running = [r(8, "0", releasing=True), r(9, "1")]
    assert run([w(1, priority=5)], running, devices=("0", "1")) == Plan()


def test_releasing_devices_outside_the_usable_set_do_not_count():
    # Job 8 releases a disabled device; job 1 still needs a victim.
    running = [r(8, "x", releasing=True), r(9, "0")]
    p = run([w(1, priority=5)], running, devices=("0",))
    assert p.preempt == (9,)


def test_no_partial_preemption_when_the_job_could_not_fit_anyway():
    # Job 1 needs three devices; only two could ever be freed (job 8 is not preemptible).
    running = [r(7, "0"), r(8, "1", preemptible=False), r(9, "2")]
    p = run([w(1, priority=5, gpus=3)], running, devices=("0", "1", "2"))
    assert p == Plan()


def test_no_partial_preemption_while_a_needed_victim_is_too_young():
    running = [r(7, "0"), r(9, "1", started_at=NOW - 1)]
    assert run([w(1, priority=5, gpus=2)], running, devices=("0", "1")) == Plan()


def test_fewest_victims_win_over_lower_priority():
    # One 2-device job at priority 3 beats two 1-device jobs at priority 0.
    running = [r(7, "0", priority=0), r(8, "1", priority=0), r(9, "2", "3", priority=3)]
    p = run([w(1, priority=5, gpus=2)], running)
    assert p.preempt == (9,)


def test_among_equally_few_victims_the_lowest_priority_goes_first():
    running = [r(7, "0", priority=2), r(8, "1", priority=1), r(9, "2", priority=3)]
    p = run([w(1, priority=5)], running, devices=("0", "1", "2"))
    assert p.preempt == (8,)


def test_among_equal_priorities_the_youngest_goes_first_then_the_lowest_id():
    running = [r(7, "0", started_at=OLD), r(8, "1", started_at=OLD - 5), r(9, "2", started_at=OLD)]
    p = run([w(1, priority=5, gpus=2)], running, devices=("0", "1", "2"))
    assert p.preempt == (7, 9)


def test_victim_choice_prefers_cheap_victims_when_sizes_allow():
    # Shortfall 3: {2-dev prio 0, 1-dev prio 0} and {2-dev prio 0, 2-dev prio 4} both use two
    # victims; the cheaper set wins.
    running = [r(7, "0", "1", priority=0), r(8, "2", priority=0), r(9, "3", "4", priority=4)]
    p = run([w(1, priority=5, gpus=3)], running, devices=("0", "1", "2", "3", "4"))
    assert sorted(p.preempt) == [7, 8]


def test_only_the_shortfall_is_preempted():
    # One device is free; job 1 needs two, so one victim suffices.
    running = [r(7, "0"), r(8, "1"), r(9, "2")]
    p = run([w(1, priority=5, gpus=2)], running)
    assert len(p.preempt) == 1


def test_a_victims_spare_devices_serve_the_next_job_without_another_preemption():
    # Job 1 needs one device and preempts the 2-device job 9 (lowest priority); the spare device
    # covers job 2, so job 8 survives.
    running = [r(9, "0", "1", priority=0), r(8, "2", priority=1)]
    p = run([w(1, priority=5), w(2, priority=5)], running, devices=("0", "1", "2"))
    assert p.preempt == (9,)


def test_a_victim_is_not_counted_twice():
    running = [r(9, "0", priority=0)]
    p = run([w(1, priority=5), w(2, priority=5)], running, devices=("0",))
    # Job 2 cannot count job 9 a second time and has no victim of its own.
    assert p == Plan(starts=(), preempt=(9,))


def test_a_job_may_preempt_only_strictly_lower_priorities_even_behind_a_higher_job():
    # Job 2 (priority 3) may not preempt job 9 (priority 3); job 1 (priority 5) takes job 8.
    running = [r(8, "0", priority=1), r(9, "1", priority=3)]
    p = run([w(1, priority=5), w(2, priority=3)], running, devices=("0", "1"))
    assert p.preempt == (8,)


# --- purity and validation ------------------------------------------------------------------------


def test_the_plan_is_deterministic_and_independent_of_input_order():
    waiting = [w(1, priority=5, gpus=2), w(2, priority=1), w(3, priority=5), w(4, priority=0)]
    running = [r(7, "0"), r(8, "1", started_at=OLD + 3), r(9, "2", releasing=True)]
    first = run(waiting, running)
    assert run(waiting, running) == first
    assert run(waiting[::-1], running[::-1]) == first


def test_waiting_jobs_need_at_least_one_device():
    with pytest.raises(ValueError):
        Waiting(id=1, priority=0, submitted_at=0.0, gpus=0)


def test_the_plan_says_which_waiting_job_each_victim_is_preempted_for():
    p = plan([Waiting(1, 9, 0.0, 1), Waiting(2, 8, 1.0, 1)],
             [Running(7, 0, ("0",), 0.0, True), Running(8, 1, ("1",), 0.0, True)], ["0", "1"], 100.0, 60)
    assert p.preempt == (7, 8) and p.preempt_for == ((7, 1), (8, 2))
