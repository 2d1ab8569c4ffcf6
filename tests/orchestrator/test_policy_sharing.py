"""The policy when jobs share a GPU (`Waiting.share`, `Running.share`, `plan(device_memory=)`): examples per rule,
and hypothesis properties over random queues of whole and sharing jobs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from orchestrator.queue.models import Job
from orchestrator.queue.policy import SHARE_EPSILON, Project, Running, Waiting, plan

NOW = 1000.0
MIN_RUN = 60.0  # preempt_after in these examples
OLD = NOW - 2 * MIN_RUN  # started long enough ago to be a victim
GIB = 2**30


def w(job_id: int, share: float = 1.0, *, gpus: int = 1, priority: int = 0, memory: int | None = None,
      project: str = "default", time_limit: float | None = None, scavenger: bool = False) -> Waiting:
    return Waiting(job_id, priority, float(job_id), gpus, project, scavenger, None, time_limit, True, share, memory)


def r(job_id: int, *devices: str, share: float = 1.0, priority: int = 0, started: float = OLD,
      preemptible: bool = True, releasing: bool = False, project: str = "default", scavenger: bool = False,
      ends_at: float | None = None, memory: int | None = None) -> Running:
    return Running(job_id, priority, tuple(devices), started, preemptible, releasing, project, scavenger, ends_at,
                   share, memory)


def run(waiting=(), running=(), devices=("0", "1"), projects=(), memory=None, backfill=True):
    return plan(list(waiting), list(running), devices, NOW, MIN_RUN, projects, backfill, memory or {})


# ---- the views and their checks ------------------------------------------------------------------------------


def test_waiting_and_running_read_a_jobs_share_and_memory():
    job = Job(id=7, priority=3, gpus=1, submitted_at=5.0, gpu_share=0.25, gpu_memory=10 * GIB,
              started_at=900.0, devices=["cpu:1"], state="running")
    assert (Waiting.of(job).share, Waiting.of(job).memory) == (0.25, 10 * GIB)
    held = Running.of(job, NOW)
    assert (held.share, held.memory, held.devices) == (0.25, 10 * GIB, ("cpu:1",))
    whole = Job(id=8, priority=3, gpus=2, submitted_at=5.0, started_at=900.0, devices=["cpu:1", "cpu:2"],
                state="running")
    assert (Waiting.of(whole).share, Waiting.of(whole).memory) == (1.0, None)
    assert (Running.of(whole, NOW).share, Running.of(whole, NOW).memory) == (1.0, None)


def test_rows_without_the_sharing_columns_are_whole_device_jobs():
    row = SimpleNamespace(id=1, priority=0, submitted_at=0.0, gpus=2, project=None, scavenger=None, deadline=None,
                          time_limit=None, preemptible=True, started_at=None, devices=None, state="running")
    assert (Waiting.of(row).share, Waiting.of(row).memory) == (1.0, None)
    assert (Running.of(row, NOW).share, Running.of(row, NOW).memory) == (1.0, None)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, math.nan])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        w(1, share)
    with pytest.raises(ValueError, match="share"):
        r(1, "0", share=share)


def test_a_sharing_job_has_exactly_one_device():
    with pytest.raises(ValueError, match="one device"):
        w(1, 0.5, gpus=2)
    with pytest.raises(ValueError, match="one device"):
        r(1, "0", "1", share=0.5)
    assert w(1, 1.0, gpus=2).share == 1.0 and r(1, "0", "1").share == 1.0


# ---- packing -------------------------------------------------------------------------------------------------


def test_four_quarters_fill_one_device_and_a_fifth_waits():
    p = run([w(i, 0.25) for i in range(1, 6)], devices=("0",))
    assert p.starts == tuple((i, ("0",)) for i in range(1, 5))
    assert p.preempt == ()


def test_thirds_and_eighths_fill_a_device_exactly_despite_float_sums():
    assert len(run([w(i, 1 / 3) for i in range(1, 5)], devices=("0",)).starts) == 3
    assert len(run([w(i, 1 / 8) for i in range(1, 10)], devices=("0",)).starts) == 8


def test_the_next_sharing_jobs_pack_onto_the_device_the_first_one_opened():
    p = run([w(i, 0.25) for i in range(1, 7)])
    assert p.starts == tuple((i, ("0",)) for i in range(1, 5)) + ((5, ("1",)), (6, ("1",)))


def test_best_fit_keeps_the_empty_device_for_a_whole_device_job():
    # Device 1 has 0.5 left, device 0 is empty (and first in preference order).
    p = run([w(1, 0.5), w(2)], [r(10, "1", share=0.5)])
    assert p.starts == ((1, ("1",)), (2, ("0",)))


def test_best_fit_picks_the_fullest_device_that_still_fits():
    running = [r(10, "0", share=0.25), r(11, "1", share=0.5), r(12, "2", share=0.75)]
    assert run([w(1, 0.5)], running, devices=("0", "1", "2")).starts == ((1, ("1",)),)
    assert run([w(1, 0.25)], running, devices=("0", "1", "2")).starts == ((1, ("2",)),)
    # Equal room: preference order decides.
    running = [r(10, "0", share=0.5), r(11, "1", share=0.5)]
    assert run([w(1, 0.5)], running, devices=("1", "0")).starts == ((1, ("1",)),)


def test_a_whole_device_job_never_gets_a_partly_used_device():
    p = run([w(1)], [r(10, "0", share=0.25)], devices=("0",))
    assert p.starts == () and p.preempt == ()
    # Nor one a sharing job opened in the same pass.
    assert run([w(1, 0.25), w(2)], devices=("0",)).starts == ((1, ("0",)),)


def test_memory_limits_what_fits_even_with_share_left():
    memory = {"0": 80 * GIB}
    p = run([w(i, 0.25, memory=40 * GIB) for i in range(1, 4)], devices=("0",), memory=memory)
    assert p.starts == ((1, ("0",)), (2, ("0",)))
    # A sharer that asked no memory holds its share of the device's: 0.5 of 80 GiB leaves 40 GiB.
    p = run([w(1, 0.25, memory=40 * GIB), w(2, 0.25, memory=GIB)], [r(10, "0", share=0.5)], devices=("0",),
            memory=memory)
    assert p.starts == ((1, ("0",)),)
    # Where the total is unknown, only shares count.
    p = run([w(i, 0.25, memory=40 * GIB) for i in range(1, 4)], devices=("0",))
    assert len(p.starts) == 3


def test_a_sharing_job_goes_to_the_first_free_device_with_its_memory():
    memory = {"0": 16 * GIB, "1": 80 * GIB}
    assert run([w(1, 0.5, memory=40 * GIB)], memory=memory).starts == ((1, ("1",)),)
    # Asking more than any device has, it never fits here: it neither starts nor preempts.
    p = run([w(1, 0.5, memory=100 * GIB, priority=50), w(2, 0.5)], [r(10, "0", "1")], memory=memory)
    assert p.preempt == () and p.starts == ()
    p = run([w(1, 0.5, memory=100 * GIB, priority=50), w(2, 0.5)], memory=memory)
    assert p.starts == ((2, ("0",)),)


# ---- preemption ----------------------------------------------------------------------------------------------


def test_a_whole_device_job_preempts_all_the_sharers_of_a_device_together():
    sharers = [r(10 + i, "0", share=0.25) for i in range(4)]
    p = run([w(1, priority=50)], sharers, devices=("0",))
    assert p.preempt == (10, 11, 12, 13)
    assert p.preempt_for == tuple((10 + i, 1) for i in range(4)) and p.why == ("priority",) * 4
    assert p.starts == ()


def test_sharers_that_have_not_run_preempt_after_are_no_victims():
    young = [r(10 + i, "0", share=0.25, started=NOW - 10) for i in range(4)]
    assert run([w(1, priority=50)], young, devices=("0",)).preempt == ()
    # One young sharer protects the device.
    mixed = [r(10 + i, "0", share=0.25) for i in range(3)] + [r(13, "0", share=0.25, started=NOW - 10)]
    assert run([w(1, priority=50)], mixed, devices=("0",)).preempt == ()
    # So does one that is not preemptible, or one of higher priority.
    fixed = [r(10 + i, "0", share=0.25) for i in range(3)] + [r(13, "0", share=0.25, preemptible=False)]
    assert run([w(1, priority=50)], fixed, devices=("0",)).preempt == ()
    high = [r(10 + i, "0", share=0.25) for i in range(3)] + [r(13, "0", share=0.25, priority=60)]
    assert run([w(1, priority=50)], high, devices=("0",)).preempt == ()


def test_sharers_already_releasing_are_not_preempted_again():
    sharers = [r(10, "0", share=0.5, releasing=True), r(11, "0", share=0.25), r(12, "0", share=0.25)]
    assert run([w(1, priority=50)], sharers, devices=("0",)).preempt == (11, 12)


def test_a_device_whose_sharers_all_release_is_coming_once():
    releasing = [r(10 + i, "0", share=0.25, releasing=True) for i in range(4)]
    # One device is coming: a one-device job waits for it, a two-device job preempts the other one.
    assert run([w(1, priority=50)], releasing + [r(20, "1")]).preempt == ()
    assert run([w(1, gpus=2, priority=50)], releasing + [r(20, "1")]).preempt == (20,)
    # With only some sharers releasing, the device is not coming: the whole device job preempts the rest.
    some = [r(10, "0", share=0.5, releasing=True), r(11, "0", share=0.5)]
    assert run([w(1, priority=50)], some, devices=("0",)).preempt == (11,)


def test_the_victims_are_the_cheapest_candidate_whole_or_shared():
    # The sharers' candidate counts their highest priority (2): the whole job of priority 1 goes first.
    running = [r(10, "0", priority=1), r(11, "1", share=0.5, priority=0), r(12, "1", share=0.5, priority=2)]
    assert run([w(1, priority=50)], running).preempt == (10,)
    # ... and their latest start: of equal priority, the older whole job stays.
    running = [r(10, "0", started=OLD - 100), r(11, "1", share=0.5, started=OLD - 200),
               r(12, "1", share=0.5, started=OLD)]
    assert run([w(1, priority=50)], running).preempt == (11, 12)


def test_scavenger_sharers_go_first_at_once_whatever_their_priority():
    scav = [r(10 + i, "0", share=0.5, scavenger=True, priority=90, started=NOW) for i in range(2)]
    p = run([w(1, priority=50)], scav + [r(20, "1")])
    assert p.preempt == (10, 11) and p.why == ("scavenger", "scavenger")


def test_a_sharing_job_that_finds_no_room_preempts_one_device_for_it_and_the_next_ones():
    whole = [r(10, "0"), r(11, "1")]
    p = run([w(i, 0.25, priority=50) for i in range(1, 7)], whole)
    # The first claims device 0 (preempted), three more wait for room on it; the fifth claims device 1.
    assert p.preempt == (10, 11) and p.preempt_for == ((10, 1), (11, 5))
    assert p.starts == ()


def test_a_sharing_job_waits_for_the_room_releasing_sharers_give_back():
    sharers = [r(10, "0", share=0.25, releasing=True)] + [r(11 + i, "0", share=0.25) for i in range(3)]
    p = run([w(1, 0.25, priority=50), w(2, 0.25, priority=50)], sharers + [r(20, "1")])
    assert p.preempt == (20,) and p.preempt_for == ((20, 2),)  # the first one waits, the second needs a device


def test_nothing_starts_on_a_device_whose_sharers_are_preempted():
    sharers = [r(10 + i, "0", share=0.25) for i in range(3)]
    p = run([w(1, priority=50), w(2, 0.25)], sharers, devices=("0",))
    assert p.preempt == (10, 11, 12) and p.starts == ()


def test_a_device_someone_starts_on_is_no_victim_in_that_pass():
    sharers = [r(10, "0", share=0.5)]
    p = run([w(1, 0.5, priority=50), w(2, priority=40)], sharers, devices=("0",))
    assert p.starts == ((1, ("0",)),) and p.preempt == ()


# ---- projects, quotas and usage ------------------------------------------------------------------------------


def test_a_share_holds_its_fraction_of_the_projects_quota():
    projects = (Project("a", quota=1, borrow_limit=0), Project("b", quota=1))
    p = run([w(i, 0.25, project="a") for i in range(1, 6)], projects=projects)
    assert [job_id for job_id, _ in p.starts] == [1, 2, 3, 4]
    # Running shares count too: 0.75 held leaves room for one more quarter.
    running = [r(10 + i, "0", share=0.25, project="a") for i in range(3)]
    p = run([w(i, 0.25, project="a") for i in range(1, 3)], running, projects=projects)
    assert [job_id for job_id, _ in p.starts] == [1]


def test_a_start_adds_its_share_of_the_time_to_its_projects_usage():
    # a: 0.25 x 3600 = 900 device-seconds after its first start, still below b's 1000: a goes again.
    projects = (Project("a"), Project("b", usage=1000.0))
    waiting = [w(1, 0.25, project="a", time_limit=3600.0), w(2, project="a", time_limit=3600.0),
               w(3, project="b", time_limit=3600.0)]
    assert [job_id for job_id, _ in run(waiting, projects=projects).starts] == [1, 2]


def test_the_owner_reclaims_its_quota_from_a_device_of_borrowing_sharers():
    borrowers = [r(10 + i, "0", share=0.5, project="a", priority=90) for i in range(2)]
    projects = (Project("a", quota=0), Project("b", quota=1))
    p = run([w(1, project="b")], borrowers, devices=("0",), projects=projects)
    assert p.preempt == (10, 11) and p.why == ("reclaim", "reclaim")


# ---- backfill and scavengers ---------------------------------------------------------------------------------


def test_sharing_jobs_backfill_onto_a_partly_used_device_only_when_they_cannot_delay_the_blocked_job():
    # The two-device job waits for the whole job (ends at 1200) and device 1's sharer (ends at 1100).
    running = [r(10, "0", preemptible=False, ends_at=NOW + 200), r(11, "1", share=0.5, preemptible=False,
                                                                    ends_at=NOW + 100)]
    blocked = w(1, gpus=2, priority=50)
    short, long, endless = (w(2, 0.25, time_limit=150.0), w(3, 0.25, time_limit=1000.0), w(4, 0.25))
    p = run([blocked, short, long, endless], running)
    assert p.starts == ((2, ("1",)),)
    # A device the blocked job does not count on (its sharer has no time limit) takes any sharing job.
    running = [r(10, "0", preemptible=False, ends_at=NOW + 200), r(11, "1", share=0.5, preemptible=False),
               r(12, "2", preemptible=False, ends_at=NOW + 200)]
    p = run([blocked, long, endless], running, devices=("0", "1", "2"))
    assert p.starts == ((3, ("1",)), (4, ("1",)))
    assert run([blocked, long, endless], running, devices=("0", "1", "2"), backfill=False).starts == ()


def test_a_sharing_job_backfills_onto_a_free_device_within_the_surplus():
    # The three-device job waits for devices 0 and 1 (both end at 1200): one device of surplus then. The first
    # sharing job (no time limit) uses it up, opening device 2; the second packs beside it, which delays nothing.
    running = [r(10, "0", "1", preemptible=False, ends_at=NOW + 200)]
    p = run([w(1, gpus=3, priority=50), w(2, 0.5), w(3, 0.5), w(4), w(5, 0.5)], running,
            devices=("0", "1", "2", "3"))
    assert p.starts == ((2, ("2",)), (3, ("2",)))


def test_scavengers_share_what_is_left():
    p = run([w(1, 0.5), w(2, 0.25, scavenger=True), w(3, 0.5, scavenger=True)], devices=("0",))
    assert p.starts == ((1, ("0",)), (2, ("0",)))


def test_share_epsilon_is_small():
    assert 4 * 0.25 <= 1 + SHARE_EPSILON and SHARE_EPSILON < 1 / 16 / 1000
