"""The policy with projects, scavengers, deadlines and backfill: examples and hypothesis properties."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.queue.backfill import shadow
from orchestrator.queue.policy import Plan, Project, Running, Waiting, plan
from tests.orchestrator import legacy_plan
from tests.orchestrator.test_scheduling_props import scenarios

NOW = 100.0
SETTINGS = settings(max_examples=100, deadline=None)
DEVS = tuple(f"cpu:{i}" for i in range(8))


def run(job_id, project, devices, *, priority=0, started=0.0, preemptible=True, scavenger=False, ends_at=None):
    return Running(job_id, priority, tuple(devices), started, preemptible, False, project, scavenger, ends_at)


# ---- one default project is today's plan ----------------------------------------------------------------


@SETTINGS
@given(scenarios())
def test_one_default_project_plans_exactly_as_before(s):
    new = plan(s.waiting, s.running, s.devices, NOW, s.preempt_after)
    old = legacy_plan.plan([legacy_plan.Waiting(j.id, j.priority, j.submitted_at, j.gpus) for j in s.waiting],
                           [legacy_plan.Running(j.id, j.priority, j.devices, j.started_at, j.preemptible, j.releasing)
                            for j in s.running], s.devices, NOW, s.preempt_after)
    assert (new.starts, new.preempt, new.expired) == (old.starts, old.preempt, ())
    # Declaring the default project with any share and no quota changes nothing either.
    again = plan(s.waiting, s.running, s.devices, NOW, s.preempt_after, (Project("default", share=3.0),))
    assert again == new


# ---- between projects ---------------------------------------------------------------------------------------


def test_a_project_below_its_quota_goes_first_whatever_the_priorities():
    waiting = [Waiting(1, 50, 0.0, 1, "a"), Waiting(2, 0, 5.0, 1, "b")]
    p = plan(waiting, [], DEVS[:1], NOW, 60, (Project("a", quota=0), Project("b", quota=1)))
    assert p.starts == ((2, ("cpu:0",)),)


def test_above_quota_the_lowest_usage_per_share_goes_first():
    waiting = [Waiting(1, 10, 0.0, 1, "a"), Waiting(2, 10, 1.0, 1, "b")]
    # a used 3000 device-seconds with share 2 (1500 per share), b 2000 with share 1.
    p = plan(waiting, [], DEVS[:1], NOW, 60, (Project("a", share=2, usage=3000), Project("b", usage=2000)))
    assert p.starts == ((1, ("cpu:0",)),)
    p = plan(waiting, [], DEVS[:1], NOW, 60, (Project("a", share=1, usage=3000), Project("b", usage=2000)))
    assert p.starts == ((2, ("cpu:0",)),)


def test_one_pass_spreads_its_starts_over_projects_by_share():
    waiting = [Waiting(i, 10, float(i), 1, "a") for i in range(8)] + \
              [Waiting(100 + i, 10, float(i), 1, "b") for i in range(8)]
    p = plan(waiting, [], DEVS[:6], NOW, 60, (Project("a", share=2), Project("b", share=1)))
    started = [job_id for job_id, _ in p.starts]
    assert sum(1 for j in started if j < 100) == 4 and sum(1 for j in started if j >= 100) == 2


def test_the_owner_reclaims_its_quota_from_a_borrower_of_higher_priority():
    running = [run(10 + i, "a", [d], priority=100, started=0.0) for i, d in enumerate(DEVS[:4])]
    projects = (Project("a", quota=2), Project("b", quota=2))
    p = plan([Waiting(1, 0, 50.0, 2, "b")], running, DEVS[:4], NOW, 60, projects)
    assert len(p.preempt) == 2 and set(p.preempt) <= {10, 11, 12, 13} and p.why == ("reclaim", "reclaim")
    # Not before preempt_after (anti-thrash): the borrowers ran 40 s of 60.
    young = [run(10 + i, "a", [d], priority=100, started=60.0) for i, d in enumerate(DEVS[:4])]
    assert plan([Waiting(1, 0, 50.0, 2, "b")], young, DEVS[:4], NOW, 60, projects).preempt == ()
    # A job beyond its own quota reclaims nothing: priorities rule within a project only.
    assert plan([Waiting(1, 0, 50.0, 3, "b")], running, DEVS[:4], NOW, 60, projects).preempt == ()


def test_the_borrow_limit_caps_what_a_project_takes_beyond_its_quota():
    waiting = [Waiting(i, 10, float(i), 1, "a") for i in range(6)]
    p = plan(waiting, [], DEVS[:6], NOW, 60, (Project("a", quota=2, borrow_limit=1), Project("b", quota=2)))
    assert len(p.starts) == 3


def test_a_non_preemptible_job_does_not_borrow_what_cannot_be_reclaimed():
    projects = (Project("a", quota=0), Project("b", quota=2))
    assert plan([Waiting(1, 10, 0.0, 1, "a")], [], DEVS[:2], NOW, 60, projects).starts == ((1, ("cpu:0",)),)
    # The same job marked non-preemptible waits: it would sit on b's quota with no way to give it back.
    assert plan([Waiting(1, 10, 0.0, 1, "a", preemptible=False)], [], DEVS[:2], NOW, 60, projects).starts == ()
    # Within its own quota it starts.
    own = (Project("a", quota=1), Project("b", quota=1))
    assert plan([Waiting(1, 10, 0.0, 1, "a", preemptible=False)], [], DEVS[:2], NOW, 60, own).starts


@st.composite
def borrowed_boxes(draw):
    """A box full of project a's jobs beyond a's quota, any priorities and ages; b waits within its quota."""
    n = draw(st.integers(2, 8))
    quota_b = draw(st.integers(1, n - 1))
    devices = DEVS[:n]
    running, i = [], 0
    while i < n:
        size = draw(st.integers(1, n - i))
        running.append(run(100 + i, "a", devices[i:i + size], priority=draw(st.integers(-5, 50)),
                           started=draw(st.sampled_from([0.0, 30.0]))))
        i += size
    gpus = draw(st.integers(1, quota_b))
    waiting = [Waiting(1, draw(st.integers(-10, 0)), 90.0, gpus, "b")]
    return devices, tuple(running), waiting, (Project("a", quota=n - quota_b), Project("b", quota=quota_b))


@SETTINGS
@given(borrowed_boxes())
def test_reclaim_frees_the_owner_within_preempt_after_whatever_the_borrowers_priorities(box):
    devices, running, waiting, projects = box
    first = plan(waiting, running, devices, NOW, 60.0, projects)
    freed = sum(len(r.devices) for r in running if r.id in first.preempt)
    assert freed >= waiting[0].gpus  # every borrower is old enough (ran >= 60 s): reclaimed now
    assert first.why == ("reclaim",) * len(first.preempt)
    # Once the victims have released (their grace), the owner's job starts on the next pass.
    left = [r for r in running if r.id not in first.preempt]
    second = plan(waiting, left, devices, NOW + 30, 60.0, projects)
    assert [job_id for job_id, _ in second.starts] == [1]


# ---- scavengers -------------------------------------------------------------------------------------------


def test_a_scavenger_uses_only_devices_no_waiting_job_can_use():
    assert plan([Waiting(1, 0, 0.0, 1, scavenger=True)], [], DEVS[:2], NOW, 60).starts == ((1, ("cpu:0",)),)
    # A 2-device job waits on a non-preemptible job: the free device is held for it, not lent to the scavenger.
    blocker = [run(5, "default", ["cpu:1"], preemptible=False)]
    p = plan([Waiting(1, 0, 0.0, 1, scavenger=True), Waiting(2, -5, 9.0, 2)], blocker, DEVS[:2], NOW, 60)
    assert p.starts == ()


def test_a_scavenger_is_preempted_at_once_by_any_job_and_before_others():
    running = [run(5, "default", ["cpu:0"], priority=100, started=99.0, scavenger=True),
               run(6, "default", ["cpu:1"], priority=-50, started=0.0)]
    p = plan([Waiting(1, -10, 0.0, 1)], running, DEVS[:2], NOW, 60)
    assert p.preempt == (5,) and p.why == ("scavenger",)


@SETTINGS
@given(scenarios(), st.lists(st.integers(1, 3), max_size=3), st.data())
def test_waiting_scavengers_never_change_anyone_elses_plan(s, sizes, data):
    scav = [Waiting(500 + i, data.draw(st.integers(-5, 99)), 0.0, g, scavenger=True) for i, g in enumerate(sizes)]
    without = plan(s.waiting, s.running, s.devices, NOW, s.preempt_after)
    with_them = plan(tuple(s.waiting) + tuple(scav), s.running, s.devices, NOW, s.preempt_after)
    assert [st_ for st_ in with_them.starts if st_[0] < 500] == list(without.starts)
    assert with_them.preempt == without.preempt
    started = [job_id for job_id, _ in with_them.starts if job_id >= 500]
    if started:  # only on what nobody else could use: everyone else fitting the box started
        assert all(j.id in dict(with_them.starts) for j in s.line())


@SETTINGS
@given(scenarios(), st.data())
def test_running_scavengers_go_before_any_other_victim(s, data):
    running = [Running(r.id, r.priority, r.devices, r.started_at, r.preemptible, r.releasing,
                       scavenger=data.draw(st.booleans())) for r in s.running]
    p = plan(s.waiting, running, s.devices, NOW, s.preempt_after)
    scav = {r.id for r in running if r.scavenger and not r.releasing and set(r.devices) & set(s.devices)}
    others = [r.id for r in running if r.id in p.preempt and not r.scavenger]
    if others:
        assert scav <= set(p.preempt)


# ---- deadlines --------------------------------------------------------------------------------------------


def test_a_job_that_cannot_meet_its_deadline_is_expired_not_started():
    waiting = [Waiting(1, 10, 0.0, 1, deadline=NOW + 30, time_limit=60.0), Waiting(2, 10, 1.0, 1, deadline=NOW - 1),
               Waiting(3, 10, 2.0, 1, deadline=NOW + 90, time_limit=60.0)]
    p = plan(waiting, [], DEVS[:4], NOW, 60)
    assert p.expired == (1, 2) and p.starts == ((3, ("cpu:0",)),)


def test_among_equals_the_earlier_deadline_goes_first():
    waiting = [Waiting(1, 10, 0.0, 1), Waiting(2, 10, 5.0, 1, deadline=NOW + 900), Waiting(3, 10, 9.0, 1,
                                                                                         deadline=NOW + 500)]
    assert [j for j, _ in plan(waiting, [], DEVS[:3], NOW, 60).starts] == [3, 2, 1]


# ---- backfill ---------------------------------------------------------------------------------------------


def test_a_short_job_backfills_before_the_blocked_job_could_start():
    running = [run(5, "default", ["cpu:0"], preemptible=False, ends_at=NOW + 100)]
    line = [Waiting(1, 50, 0.0, 2), Waiting(2, 0, 1.0, 1, time_limit=60.0), Waiting(3, 0, 2.0, 1, time_limit=600.0)]
    assert plan(line, running, DEVS[:2], NOW, 60).starts == ((2, ("cpu:1",)),)
    assert plan(line, running, DEVS[:2], NOW, 60, backfill=False).starts == ()
    # Without the running job's time limit its end, and so the blocked job's start, is unknown: no backfill.
    unknown = [run(5, "default", ["cpu:0"], preemptible=False)]
    assert plan(line, unknown, DEVS[:2], NOW, 60).starts == ()


def earliest_start(need: int, free: int, ends: list[tuple[float, int]]) -> float:
    """When `need` devices are free at the latest, by brute force over the end times (inf: never known)."""
    for t in sorted({NOW, *(e for e, _ in ends)}):
        if free + sum(n for e, n in ends if e <= t) >= need:
            return t
    return float("inf")


@st.composite
def blocked_lines(draw):
    n = draw(st.integers(2, 8))
    devices = DEVS[:n]
    running, i = [], 0
    while i < n:
        if draw(st.booleans()):
            i += 1  # a free device
            continue
        size = draw(st.integers(1, n - i))
        running.append(run(100 + i, "default", devices[i:i + size], priority=99, preemptible=False,
                           ends_at=draw(st.sampled_from([None, NOW + 50, NOW + 100, NOW + 300]))))
        i += size
    free = n - sum(len(r.devices) for r in running)
    head = Waiting(1, 50, 0.0, draw(st.integers(free + 1, n)) if free < n else n + 0)
    behind = [Waiting(2 + k, draw(st.integers(0, 49)), float(k + 1), draw(st.integers(1, n)),
                      time_limit=draw(st.sampled_from([None, 30.0, 80.0, 200.0, 1000.0])))
              for k in range(draw(st.integers(0, 6)))]
    return devices, tuple(running), [head, *behind]


@SETTINGS
@given(blocked_lines())
def test_backfill_never_delays_the_blocked_job(case):
    devices, running, line = case
    head = line[0]
    free = len(devices) - sum(len(r.devices) for r in running)
    if head.gpus <= free:
        return  # not blocked
    inf = float("inf")
    before = earliest_start(head.gpus, free, [(r.ends_at or inf, len(r.devices)) for r in running])
    p = plan(line, running, devices, NOW, 60.0)
    assert head.id not in dict(p.starts)
    limits = {j.id: j.time_limit for j in line}
    used = sum(len(d) for _, d in p.starts)
    after = earliest_start(head.gpus, free - used, [(r.ends_at or inf, len(r.devices)) for r in running] +
                           [(NOW + limits[j] if limits[j] else inf, len(d)) for j, d in p.starts])
    assert after <= before
    if before == inf:
        assert p.starts == ()  # its start is unknown: nothing may pass it


def test_the_shadow_time_counts_jobs_ending_together():
    assert shadow(3, 1, [(10.0, 1), (10.0, 2), (20.0, 4)]) == (10.0, 1)
    assert shadow(3, 1, [(10.0, 1), (None, 4)]) is None


def test_plan_equality_ignores_the_reasons():
    assert Plan(preempt=(1,), why=("priority",)) == Plan(preempt=(1,))
