"""The queue at scale, through a real service and real processes (correctness only, nothing timed): every job
runs exactly once, in line order, and a long line of jobs that cannot start does not hide one that can."""

from __future__ import annotations

import random
from pathlib import Path

from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import wait_for
from tests.support.dispatch import wait_for_dispatch


def _recorder(out: Path, **kw) -> JobSpec:
    """A no-op job that appends its id to `out` (O_APPEND: lines from concurrent jobs never interleave)."""
    return JobSpec(argv=["sh", "-c", f'echo "$AUTORESEARCH_JOB_ID" >> {out}'], track=False, **kw)


def test_a_thousand_jobs_each_run_exactly_once(make_service, tmp_path):
    service = make_service("cpu:8")
    out = tmp_path / "ran.txt"
    ids = [service.store.submit(_recorder(out, name=f"n{i}")).id for i in range(1000)]
    service.wake()
    wait_for(lambda: service.store.count_in("SUCCEEDED") == len(ids), timeout=240, what="1000 jobs to succeed")
    ran = [int(line) for line in out.read_text().split()]
    assert sorted(ran) == sorted(ids), "every job ran, and none twice"
    jobs = service.store.list()
    assert all(j.attempts == 1 and j.exit_code == 0 for j in jobs)
    assert service.store.unfinished() == []
    history: dict[int, list] = {}  # the transitions are written in batches: each job still has all of its own
    for event in reversed(service.store.recent_events(limit=5 * len(ids))):
        history.setdefault(event.job_id, []).append((event.src, event.dst))
    assert all(history[job_id] == [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"),
                                   ("RUNNING", "SUCCEEDED")] for job_id in ids)


def test_one_slot_starts_jobs_in_line_order(home, tmp_path):
    from orchestrator.core.config import Settings
    from orchestrator.queue.store import JobStore
    from orchestrator.service.daemon import Service

    store = JobStore(Settings.load().db_url)
    out = tmp_path / "ran.txt"
    rng = random.Random(7)
    jobs = [store.submit(_recorder(out, priority=rng.choice([0, 5, 10]))) for _ in range(200)]
    service = Service(Settings.load(), devices="cpu:1", preempt_after=0.0, tick=0.2).start()
    try:
        wait_for(lambda: store.count_in("SUCCEEDED") == len(jobs), timeout=120, what="200 jobs to succeed")
    finally:
        service.stop()
    expected = [j.id for j in sorted(jobs, key=lambda j: (-j.priority, j.submitted_at, j.id))]
    assert [int(line) for line in out.read_text().split()] == expected


def test_a_job_that_fits_starts_behind_300_that_cannot_run_here(make_service, tmp_path):
    """300 jobs needing 3 devices (another host of a shared queue could run them) stand in line before a
    1-device job on a 2-device host: the small one starts; the big ones keep waiting."""
    service = make_service("cpu:2")
    big = [service.store.submit(JobSpec(argv=["true"], track=False, gpus=3, priority=5)).id for _ in range(300)]
    small = service.store.submit(_recorder(tmp_path / "ran.txt", priority=0)).id
    service.wake()
    wait_for(lambda: service.store.get(small).state == "SUCCEEDED", what="the 1-device job to run")
    assert {j.state for j in service.store.get_many(big)} == {"QUEUED"}


def test_the_reservation_of_a_blocked_job_still_holds_behind_a_long_line(make_service, tmp_path):
    """Within the reservation rules: 300 jobs needing both devices wait on a job that may not be preempted; the
    first of them holds the free device, so the 1-device job behind them does not jump the line. Once the
    blocker ends, the first of them starts before it."""
    service = make_service("cpu:2")
    blocker = service.store.submit(JobSpec(argv=["sleep", "60"], track=False, priority=50, preemptible=False)).id
    wait_for(lambda: service.store.get(blocker).state == "RUNNING", what="the blocker to run")
    big = [service.store.submit(JobSpec(argv=["true"], track=False, gpus=2, priority=5)).id for _ in range(300)]
    small = service.store.submit(_recorder(tmp_path / "ran.txt", priority=0)).id
    wait_for_dispatch(service)
    wait_for_dispatch(service)
    assert service.store.get(small).state == "QUEUED"
    assert service.store.get(big[0]).state == "QUEUED"
    for job_id in big[1:]:  # each 2-device job starts through torchrun: seconds; the first one shows the order
        service.store.cancel(job_id)
    service.store.cancel(blocker)
    service.wake()
    wait_for(lambda: service.store.get(small).state == "SUCCEEDED", timeout=120, what="the line to drain")
    first = service.store.get(big[0])
    assert first.state == "SUCCEEDED" and first.started_at <= service.store.get(small).started_at


def query_plans(store, marker: str) -> list[str]:
    """SQLite's plans of the SELECTs `store` runs from now on whose text contains `marker` (filled as they run)."""
    from sqlalchemy import event

    plans: list[str] = []

    @event.listens_for(store.db.engine, "before_cursor_execute")
    def explain(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
        if marker in statement and statement.lstrip().startswith("SELECT"):
            raw = conn.connection.driver_connection
            plans.append(" ".join(str(row) for row in raw.execute("EXPLAIN QUERY PLAN " + statement, parameters)))

    return plans


def test_retries_are_found_without_reading_every_failed_job(tmp_path):
    """Among thousands of jobs that failed for good, housekeeping's read of the retries that are due (every
    second) and `queue`'s listing of the jobs awaiting a retry go through the partial index of retrying jobs,
    and still find exactly those, in line order."""

    from orchestrator.queue.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path / 'queue.db'}", retry_backoff=0.01)
    for _ in range(20):  # 2,000 failed for good (one attempt, spent), in batches as a service records them
        ids = [store.submit(JobSpec(argv=["false"], track=False)).id for _ in range(100)]
        store.claim([(job_id, ["cpu:0"]) for job_id in ids], "h")
        store.mark_running_many([(job_id, 1, None) for job_id in ids], "h")
        store.finish_many([(job_id, 1, 1, "exit code 1") for job_id in ids], "h")
    retrying = []
    for priority in (5, 20, 10):
        job = store.submit(JobSpec(argv=["false"], track=False, max_attempts=3, priority=priority))
        store.claim([(job.id, ["cpu:0"])], "h")
        store.mark_running(job.id, 1, None, "h")
        retrying.append(store.finish(job.id, 1, "h").id)
    plans = query_plans(store, "failures < max_attempts")
    listed = store.listing()
    assert [row["id"] for row in listed.jobs] == [retrying[1], retrying[2], retrying[0]]  # line order
    assert listed.counts == {"FAILED": 3}
    due = max(store.get(j).not_before for j in retrying)  # the moment their backoffs have all passed
    assert sorted(job.id for job in store.requeue_due(now=due)) == sorted(retrying)
    assert plans and all("ix_jobs_retrying" in plan for plan in plans), plans
    store.close()


def test_runs_to_end_are_found_without_reading_every_finished_job(tmp_path):
    """The service looks for runs to end every second: among thousands of finished jobs whose runs it already
    ended, the look goes through the partial index of open runs and finds exactly the ones still open."""
    from orchestrator.queue.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path / 'queue.db'}")
    for batch in range(10):  # 1,000 finished jobs with runs made and ended, as a service records them
        ids = [store.submit(JobSpec(argv=["true"])).id for _ in range(100)]
        store.runs.set_run_ids({job_id: f"run-{job_id}" for job_id in ids})
        store.claim([(job_id, ["cpu:0"]) for job_id in ids], "h")
        store.mark_running_many([(job_id, 1, None) for job_id in ids], "h")
        store.finish_many([(job_id, 1, 0, "exit code 0") for job_id in ids], "h")
        if batch < 9:
            store.runs.runs_closed(ids)
    plans = query_plans(store, "run_open_at IS NOT NULL")
    assert sorted(job_id for job_id, *_ in store.runs.runs_to_close(limit=1000)) == ids
    assert plans and all("ix_jobs_runs_open" in plan for plan in plans), plans
    store.close()
