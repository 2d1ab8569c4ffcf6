"""Property tests (hypothesis) for the scheduling policy over random devices, running and waiting jobs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.queue.policy import Plan, Running, Waiting, plan

NOW = 100.0
SETTINGS = settings(max_examples=300, deadline=None)


@dataclass(frozen=True)
class Scenario:
    waiting: tuple[Waiting, ...]
    running: tuple[Running, ...]
    devices: tuple[str, ...]
    preempt_after: float

    def plan(self, waiting=None, running=None) -> Plan:
        return plan(
            self.waiting if waiting is None else waiting,
            self.running if running is None else running,
            self.devices, NOW, self.preempt_after,
        )

    def usable(self, job: Running) -> int:
        return len(set(job.devices) & set(self.devices))

    def eligible(self, job: Running) -> bool:
        return (
            job.preemptible and not job.releasing and NOW - job.started_at >= self.preempt_after
            and self.usable(job) > 0
        )

    def free(self) -> list[str]:
        held = {d for job in self.running for d in job.devices}
        return [d for d in self.devices if d not in held]

    def releasing(self) -> int:
        return sum(self.usable(job) for job in self.running if job.releasing)

    def line(self) -> list[Waiting]:
        """Waiting jobs that could ever run here, in line order."""
        fitting = [job for job in self.waiting if job.gpus <= len(self.devices)]
        return sorted(fitting, key=lambda job: (-job.priority, job.submitted_at, job.id))


@st.composite
def scenarios(draw, min_waiting: int = 0, max_waiting: int = 6, victims_only: bool = False) -> Scenario:
    """Random queue states.

    A pool of devices, some usable (in a random preference order), the rest disabled; each device is
    free or held by one running job, so running jobs may also hold disabled devices. With
    ``victims_only`` every device is held and every running job holding a usable device is an
    eligible victim of every waiting job, to exercise the choice of victims rather than eligibility.
    """
    pool = [str(i) for i in range(draw(st.integers(1, 7)))]
    start_times = [0.0, 40.0] if victims_only else [0.0, 40.0, 70.0, 95.0, 100.0]
    order = draw(st.permutations(pool))
    devices = tuple(order[: draw(st.integers(1, len(pool)))])
    n_running = draw(st.integers(1 if victims_only else 0, len(pool)))
    owner_of = st.integers(0 if victims_only else -1, n_running - 1)  # -1: free
    owners = draw(st.lists(owner_of, min_size=len(pool), max_size=len(pool)))
    priorities = st.integers(0, 3)
    running = []
    for j in range(n_running):
        held = tuple(d for d, owner in zip(pool, owners) if owner == j)
        if held:
            running.append(Running(
                id=100 + j, priority=draw(priorities), devices=held,
                started_at=draw(st.sampled_from(start_times)),
                preemptible=victims_only or draw(st.booleans()),
                releasing=not victims_only and draw(st.booleans()),
            ))
    waiting = tuple(
        Waiting(id=i, priority=4 if victims_only else draw(priorities),
                submitted_at=float(draw(st.integers(0, 3))),
                gpus=draw(st.integers(1, len(pool) + 1)))
        for i in range(draw(st.integers(min_waiting, max_waiting)))
    )
    preempt_after = 30.0 if victims_only else draw(st.sampled_from([0.0, 30.0, 60.0]))
    return Scenario(waiting, tuple(running), devices, preempt_after)


any_scenario = st.one_of(scenarios(), scenarios(victims_only=True))


@SETTINGS
@given(any_scenario)
def test_starts_use_only_free_devices_each_once_and_all_or_nothing(s: Scenario):
    p = s.plan()
    by_id = {job.id: job for job in s.waiting}
    free = set(s.free())
    used = [d for _, devs in p.starts for d in devs]
    assert len(used) == len(set(used)), "a device got two jobs"
    assert set(used) <= free, "a start used a device that is held (by a victim or anyone else) or unusable"
    held_usable = sum(1 for d in s.devices if d not in free)
    assert held_usable + len(used) <= len(s.devices), "capacity exceeded"
    started = [job_id for job_id, _ in p.starts]
    assert len(started) == len(set(started))
    for job_id, devs in p.starts:
        assert len(devs) == by_id[job_id].gpus, "all or nothing"
        # First free devices in preference order among those still free at that point.
        assert list(devs) == sorted(devs, key=s.devices.index)


@SETTINGS
@given(any_scenario)
def test_victims_are_lower_priority_preemptible_old_enough_and_not_releasing(s: Scenario):
    p = s.plan()
    running = {job.id: job for job in s.running}
    assert len(p.preempt) == len(set(p.preempt))
    started = {job_id for job_id, _ in p.starts}
    blocked = [job for job in s.line() if job.id not in started]
    for victim_id in p.preempt:
        victim = running[victim_id]
        assert s.eligible(victim)
        assert any(victim.priority < job.priority for job in blocked), "preempted for no higher job"


@SETTINGS
@given(any_scenario)
def test_the_first_blocked_job_is_not_kept_waiting_by_eligible_victims(s: Scenario):
    p = s.plan()
    line = s.line()
    started = [job_id for job_id, _ in p.starts]
    first_blocked = next((i for i, job in enumerate(line) if job.id not in started), None)
    if first_blocked is None:
        assert p.preempt == ()
        return
    job = line[first_blocked]
    ahead = line[:first_blocked]
    assert started[: len(ahead)] == [j.id for j in ahead], "jobs ahead of it start first, in order"
    free_at_job = len(s.free()) - sum(j.gpus for j in ahead)
    coming = s.releasing()
    victims_possible = sum(
        s.usable(v) for v in s.running if s.eligible(v) and v.priority < job.priority
    )
    if free_at_job + coming + victims_possible < job.gpus:
        # Cannot be served yet: it holds everything, and nothing behind it starts or preempts.
        assert started == [j.id for j in ahead]
        assert p.preempt == ()
        return
    if free_at_job + coming < job.gpus:
        assert p.preempt, "an eligible lower-priority job keeps a higher-priority job waiting"
    # No starvation: once releases and preemptions land, enough devices reach it (it is first in line).
    free_left = len(s.free()) - sum(len(devs) for _, devs in p.starts)
    victims = sum(s.usable(v) for v in s.running if v.id in p.preempt)
    assert free_left + coming + victims >= job.gpus


@SETTINGS
@given(any_scenario)
def test_nothing_is_preempted_when_releases_under_way_cover_all_demand(s: Scenario):
    if len(s.free()) + s.releasing() >= sum(job.gpus for job in s.line()):
        assert s.plan().preempt == ()


@SETTINGS
@given(st.one_of(scenarios(1, 1), scenarios(1, 1, victims_only=True)))
def test_a_single_job_preempts_the_fewest_cheapest_victims(s: Scenario):
    p = s.plan()
    if not s.waiting or s.waiting[0].gpus > len(s.devices):
        assert p == Plan()
        return
    job = s.waiting[0]
    shortfall = job.gpus - len(s.free()) - s.releasing()
    pool = [v for v in s.running if s.eligible(v) and v.priority < job.priority]
    key = lambda v: (v.priority, -v.started_at, v.id)  # noqa: E731
    best = None
    if shortfall > 0:
        # Brute force: the smallest sets that cover the shortfall, cheapest (lexicographically) first.
        for k in range(1, len(pool) + 1):
            sets = [
                sorted(c, key=key) for c in itertools.combinations(pool, k)
                if sum(s.usable(v) for v in c) >= shortfall
            ]
            if sets:
                best = min(sets, key=lambda c: [key(v) for v in c])
                break
    expected = () if best is None else tuple(v.id for v in best)
    assert sorted(p.preempt) == sorted(expected)


@SETTINGS
@given(any_scenario, st.randoms(use_true_random=False))
def test_the_plan_is_deterministic_and_independent_of_input_order(s: Scenario, rng):
    first = s.plan()
    assert s.plan() == first
    waiting, running = list(s.waiting), list(s.running)
    rng.shuffle(waiting)
    rng.shuffle(running)
    assert s.plan(waiting=waiting, running=running) == first
