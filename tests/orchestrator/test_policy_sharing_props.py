"""Property tests (hypothesis) for the policy when jobs share a GPU: random queues of whole-device and sharing
jobs, with projects, quotas, scavengers, time limits and device memory; and, with whole-device jobs only, the
same plans as the policy before sharing (tests/orchestrator/whole_plan.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.queue.policy import SHARE_EPSILON, Plan, Project, Running, Waiting, plan
from tests.orchestrator import whole_plan

NOW = 1000.0
GIB = 2**30
SETTINGS = settings(max_examples=200, deadline=None)
SHARES = (1 / 2, 1 / 3, 1 / 4, 1 / 8, 1 / 16)


@dataclass(frozen=True)
class Scenario:
    waiting: tuple[Waiting, ...]
    running: tuple[Running, ...]
    devices: tuple[str, ...]
    preempt_after: float
    projects: tuple[Project, ...]
    backfill: bool
    memory: dict

    def plan(self, waiting=None, running=None) -> Plan:
        return plan(self.waiting if waiting is None else waiting, self.running if running is None else running,
                    self.devices, NOW, self.preempt_after, self.projects, self.backfill, self.memory)


def demand(job, total: Optional[int]) -> float:
    if job.memory is not None:
        return job.memory
    return job.share * total if total is not None else 0.0


@st.composite
def scenarios(draw, sharing: bool = True, victims: bool = False) -> Scenario:
    """A pool of devices, some usable (in a random preference order); each free, held by one whole-device job
    (which may hold others too) or by sharers whose shares and memory fit; waiting jobs of both kinds. With
    `victims`, running jobs are mostly eligible victims and waiting jobs of higher priority, to exercise
    preemption (of the sharers of a device together) rather than eligibility."""
    pool = [str(i) for i in range(draw(st.integers(1, 5)))]
    order = draw(st.permutations(pool))
    devices = tuple(order[: draw(st.integers(1, len(pool)))])
    memory = {d: draw(st.sampled_from([16, 40, 80])) * GIB for d in pool if sharing and draw(st.booleans())}
    projects_named = draw(st.sampled_from([("default",), ("a", "b")]))
    starts = [0.0, NOW - 100, NOW - 50, NOW]
    running: list[Running] = []
    next_id = iter(range(100, 10_000))

    def attrs():
        if victims:
            return dict(priority=draw(st.integers(0, 3)), started_at=draw(st.sampled_from(starts[:2])),
                        preemptible=True, releasing=draw(st.sampled_from([False, False, False, True])),
                        project=draw(st.sampled_from(projects_named)),
                        scavenger=draw(st.sampled_from([False, False, False, True])), ends_at=None)
        return dict(priority=draw(st.integers(0, 3)), started_at=draw(st.sampled_from(starts)),
                    preemptible=draw(st.booleans()), releasing=draw(st.booleans()),
                    project=draw(st.sampled_from(projects_named)), scavenger=draw(st.booleans()),
                    ends_at=draw(st.sampled_from([None, NOW + 100, NOW + 300])))

    held: set[str] = set()
    for device in pool:
        if device in held:
            continue
        kinds = ["whole", "shared"] if victims else ["free", "whole", "shared"]
        kind = draw(st.sampled_from(kinds if sharing else [k for k in kinds if k != "shared"] or ["free"]))
        if kind == "whole":
            others = [d for d in pool if d not in held and d != device]
            extra = draw(st.lists(st.sampled_from(others), max_size=1, unique=True)) if others else []
            devs = (device, *extra)
            held.update(devs)
            running.append(Running(next(next_id), devices=devs, **attrs()))
        elif kind == "shared":
            held.add(device)
            total = memory.get(device)
            left_share, left_memory = 1.0, total
            for _ in range(draw(st.integers(1, 4))):
                share = draw(st.sampled_from(SHARES))
                asked = draw(st.sampled_from([None, 4 * GIB, 10 * GIB]))
                need = asked if asked is not None else (share * total if total is not None else 0.0)
                if share > left_share + SHARE_EPSILON or (left_memory is not None and need > left_memory):
                    continue
                left_share -= share
                if left_memory is not None:
                    left_memory -= need
                running.append(Running(next(next_id), devices=(device,), share=share, memory=asked, **attrs()))
    waiting = []
    for i in range(draw(st.integers(0, 7))):
        share = draw(st.sampled_from((1.0,) + (SHARES if sharing else ()))) if sharing else 1.0
        gpus = 1 if share < 1 else draw(st.integers(1, len(pool)))
        waiting.append(Waiting(
            i, draw(st.integers(4, 5) if victims else st.integers(0, 4)), float(draw(st.integers(0, 3))), gpus,
            draw(st.sampled_from(projects_named)), not victims and draw(st.booleans()) and draw(st.booleans()),
            draw(st.sampled_from([None, None, NOW + 50, NOW + 1000])),
            draw(st.sampled_from([None, 50.0, 200.0, 1000.0])), draw(st.booleans()), share,
            draw(st.sampled_from([None, 8 * GIB, 30 * GIB, 60 * GIB])) if share < 1 else None))
    projects = ()
    if draw(st.booleans()):
        projects = tuple(Project(name, share=draw(st.sampled_from([1.0, 2.0])), quota=draw(st.integers(0, 2)),
                                 borrow_limit=draw(st.sampled_from([None, 0, 1])),
                                 usage=draw(st.sampled_from([0.0, 500.0])))
                         for name in projects_named)
    return Scenario(tuple(waiting), tuple(running), devices, draw(st.sampled_from([0.0, 60.0])), projects,
                    draw(st.booleans()), memory)


any_scenario = st.one_of(scenarios(), scenarios(victims=True))


@SETTINGS
@given(any_scenario)
def test_no_device_is_over_committed_in_share_or_memory(s: Scenario):
    p = s.plan()
    by_id = {job.id: job for job in s.waiting}
    on: dict[str, list] = {}
    for job in s.running:  # victims still hold their devices: a start never uses them
        for d in job.devices:
            on.setdefault(d, []).append(job)
    for job_id, devs in p.starts:
        for d in devs:
            on.setdefault(d, []).append(by_id[job_id])
    for device, jobs in on.items():
        assert sum(job.share for job in jobs) <= 1 + SHARE_EPSILON, f"device {device} over-committed"
        total = s.memory.get(device)
        sharers = [job for job in jobs if job.share < 1]
        if total is not None and len(sharers) == len(jobs):
            assert sum(demand(job, total) for job in sharers) <= total + 1, f"device {device} out of memory"


@SETTINGS
@given(any_scenario)
def test_starts_are_whole_on_usable_devices_and_never_split(s: Scenario):
    p = s.plan()
    by_id = {job.id: job for job in s.waiting}
    shared_now = {d for job in s.running if job.share < 1 for d in job.devices}
    shared_started = {devs[0] for job_id, devs in p.starts if by_id[job_id].share < 1}
    started = [job_id for job_id, _ in p.starts]
    assert len(started) == len(set(started))
    for job_id, devs in p.starts:
        job = by_id[job_id]
        assert set(devs) <= set(s.devices), "a start on a device that is not usable"
        assert len(devs) == len(set(devs)) == job.gpus, "all or nothing, never split"
        if job.share == 1:
            assert not set(devs) & (shared_now | shared_started), "a whole-device job on a shared device"
            assert not set(devs) & {d for r in s.running for d in r.devices}, "a whole-device job on a held device"


@SETTINGS
@given(any_scenario)
def test_the_sharers_of_a_device_are_preempted_together_and_only_when_all_are_eligible(s: Scenario):
    p = s.plan()
    assert len(p.preempt) == len(set(p.preempt)) == len(p.why) == len(p.preempt_for)
    preempted = set(p.preempt)
    started_on = {d for _, devs in p.starts for d in devs}
    for job in s.running:
        if job.id not in preempted:
            continue
        assert not job.releasing and job.preemptible
        assert job.scavenger or NOW - job.started_at >= s.preempt_after
        if job.share < 1:
            device = job.devices[0]
            assert device not in started_on, "a start on a device whose sharers are preempted"
            mates = [m for m in s.running if m.devices == job.devices and m.share < 1 and not m.releasing]
            assert {m.id for m in mates} <= preempted, "the sharers of a device are victims together"
    waiting = {job.id: job for job in s.waiting}
    for victim_id, job_id in p.preempt_for:
        victim = next(job for job in s.running if job.id == victim_id)
        assert victim.scavenger or victim.project != waiting[job_id].project \
            or victim.priority < waiting[job_id].priority


@SETTINGS
@given(any_scenario, st.randoms(use_true_random=False))
def test_the_plan_is_deterministic_and_independent_of_input_order(s: Scenario, rng):
    first = s.plan()
    assert s.plan() == first
    waiting, running = list(s.waiting), list(s.running)
    rng.shuffle(waiting)
    rng.shuffle(running)
    again = s.plan(waiting=waiting, running=running)
    assert again == first and (again.why, again.preempt_for) == (first.why, first.preempt_for)


@settings(max_examples=300, deadline=None)
@given(st.one_of(scenarios(sharing=False), scenarios(sharing=False, victims=True)))
def test_whole_device_jobs_plan_exactly_as_before_sharing(s: Scenario):
    new = s.plan()
    old = whole_plan.plan(
        [whole_plan.Waiting(j.id, j.priority, j.submitted_at, j.gpus, j.project, j.scavenger, j.deadline,
                            j.time_limit, j.preemptible) for j in s.waiting],
        [whole_plan.Running(j.id, j.priority, j.devices, j.started_at, j.preemptible, j.releasing, j.project,
                            j.scavenger, j.ends_at) for j in s.running],
        s.devices, NOW, s.preempt_after,
        tuple(whole_plan.Project(p.name, p.share, p.quota, p.borrow_limit, p.usage) for p in s.projects),
        s.backfill)
    assert (new.starts, new.preempt, new.expired, new.why, new.preempt_for) == \
        (old.starts, old.preempt, old.expired, old.why, old.preempt_for)
