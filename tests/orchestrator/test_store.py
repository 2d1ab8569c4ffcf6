"""JobStore contract: every backend (SQLite, PostgreSQL) enforces the job states the same way."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from orchestrator.core.errors import BadInput, InvalidTransition, JobNotFound, StoreUnavailable
from orchestrator.queue.models import JobSpec
from orchestrator.queue.states import ALLOWED, JobState
from orchestrator.queue.store import JobStore, backoff

S = JobState


@pytest.fixture
def store(db_url):
    s = JobStore(db_url)
    yield s
    s.close()


def spec(**kw):
    return JobSpec(argv=kw.pop("argv", ["true"]), **kw)


def states(store, job_id):
    return [(e.src, e.dst) for e in store.events(job_id)]


def run(store, job_id, devices=("cpu:0",)):
    store.claim([(job_id, list(devices))], "h1")
    return store.mark_running(job_id, 4242, None, "h1")


def test_submit_records_an_event_and_defaults(store):
    job = store.submit(spec(name="a"))
    assert (job.state, job.priority, job.attempts, job.preemptions) == ("QUEUED", 10, 0, 0)
    assert states(store, job.id) == [(None, "QUEUED")]
    assert store.get(job.id).argv == ["true"]


def test_happy_path_is_one_event_per_transition(store):
    job = store.submit(spec())
    run(store, job.id)
    done = store.finish(job.id, 0, "h1")
    assert done.state == "SUCCEEDED" and done.exit_code == 0 and done.finished_at
    assert states(store, job.id) == [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"),
                                     ("RUNNING", "SUCCEEDED")]
    assert store.get(job.id).attempts == 1


def test_finished_jobs_never_change(store):
    job = store.submit(spec())
    run(store, job.id)
    store.finish(job.id, 0, "h1")
    with pytest.raises(BadInput):
        store.cancel(job.id)
    assert store.claim([(job.id, ["cpu:0"])], "h1") == []
    assert store.finish(job.id, 1).state == "SUCCEEDED"  # a late duplicate report changes nothing
    with pytest.raises(InvalidTransition):
        with store.db.tx() as session:
            store.transitions._move(session, store.transitions._lock(session, job.id), S.QUEUED, "x", None, 0.0)


def test_preemption_goes_back_in_line_keeping_priority_and_submit_time(store):
    job = store.submit(spec(priority=3))
    run(store, job.id)
    [pre] = store.preempt([job.id], "for a higher job")
    assert pre.state == "PREEMPTING"
    back = store.finish(job.id, 143)
    assert back.state == "QUEUED" and back.preemptions == 1 and back.priority == 3
    assert back.submitted_at == job.submitted_at and back.devices == []
    assert back.failures == 0  # a preemption is not a failure


def test_a_preempted_job_goes_back_in_line_whatever_its_exit_code(store, tmp_path):
    # Slurm PreemptMode=REQUEUE: a SIGTERM handler that saves and exits 0 has not finished its training.
    job = store.submit(spec())
    store.claim([(job.id, ["cpu:0"])], "h1", checkpoint_root=str(tmp_path))
    store.mark_running(job.id, 4242, None, "h1")
    store.preempt([job.id], "for a higher job")
    back = store.finish(job.id, 0, "h1")
    assert (back.state, back.preemptions, back.failures, back.exit_code) == ("QUEUED", 1, 0, 0)


def preempted_attempt(store, job_id, root, marker_attempt=None):
    """Claim, run and preempt `job_id`; with `marker_attempt`, the job's completion marker names that attempt
    (what runtime.context.JobContext.complete writes)."""
    store.claim([(job_id, ["cpu:0"])], "h1", checkpoint_root=str(root))
    store.mark_running(job_id, 4242, None, "h1")
    store.preempt([job_id], "for a higher job")
    if marker_attempt is not None:
        (root / str(job_id)).mkdir(exist_ok=True)
        (root / str(job_id) / "autoresearch-complete.json").write_text(json.dumps({"attempt": marker_attempt}))


def test_only_a_job_that_marked_this_attempt_complete_ends_succeeded_while_preempted(store, tmp_path):
    done = store.submit(spec())
    preempted_attempt(store, done.id, tmp_path, marker_attempt=1)
    ended = store.finish(done.id, 0, "h1")
    assert ended.state == "SUCCEEDED" and "finished its last step" in ended.reason and ended.preemptions == 0
    stale = store.submit(spec())
    preempted_attempt(store, stale.id, tmp_path, marker_attempt=0)  # a marker of another attempt
    assert store.finish(stale.id, 0, "h1").state == "QUEUED"
    preempted_attempt(store, stale.id, tmp_path, marker_attempt=2)
    back = store.finish(stale.id, 143, "h1")  # complete, but did not exit cleanly: resume, lose nothing
    assert back.state == "QUEUED" and back.preemptions == 2


def test_attempt_numbers_never_go_down_or_repeat(store):
    job = store.submit(spec())
    store.claim([(job.id, ["cpu:0"])], "h1")
    back = store.requeue(job.id, "preflight failed on cpu:0")  # given back before it ran
    assert back.state == "QUEUED" and back.attempts == 1 and back.failures == 0
    [again] = store.claim([(job.id, ["cpu:1"])], "h1")
    assert again.attempts == 2
    # A late report about attempt 1 cannot end attempt 2.
    assert store.finish_many([(job.id, 1, 1, "old")], "h1") == []
    assert store.get(job.id).state == "STARTING"


def test_the_job_decides_whether_it_is_final(store):
    job = store.submit(spec(max_attempts=2))
    assert not job.final and not job.retrying
    run(store, job.id)
    first = store.finish(job.id, 1)
    assert first.state == "FAILED" and first.retrying and not first.final
    assert [j.id for j in store.unfinished()] == [job.id]
    store.requeue_due(now=1e12)
    run(store, job.id)
    last = store.finish(job.id, 1)
    assert last.final and not last.retrying and store.unfinished() == []
    with pytest.raises(BadInput):
        store.demote(job.id, 0)


def test_retry_backoff_is_the_stores_setting_read_when_a_job_fails(db_url):
    store = JobStore(db_url, retry_backoff=0.5, retry_backoff_cap=0.75)
    job = store.submit(spec(max_attempts=4))
    for failures, wait in ((1, 0.5), (2, 0.75)):
        run(store, job.id)
        failed = store.finish(job.id, 1)
        assert failed.not_before - failed.finished_at == pytest.approx(wait)
        store.requeue_due(now=1e12)
    store.transitions.retry_backoff = 2.0  # changed by whoever holds the store: the next failure uses it
    store.transitions.retry_backoff_cap = 100.0
    run(store, job.id)
    failed = store.finish(job.id, 1)
    assert failed.not_before - failed.finished_at == pytest.approx(backoff(3, 2.0, 100.0)) == 8.0
    store.close()


def test_priority_is_bounded(store):
    with pytest.raises(BadInput, match="--priority must be an integer from"):
        spec(priority=99999999999999999999)
    job = store.submit(spec(priority=1_000_000))
    with pytest.raises(BadInput):
        store.demote(job.id, -10**12)
    assert store.get(job.id).priority == 1_000_000


def test_waiting_jobs_carry_a_reason_without_a_transition(store):
    small, big = store.submit(spec()), store.submit(spec(gpus=8))
    assert [j.id for j in store.waiting_with(gpus_over=2, reason_prefix="no live")] == [big.id]
    store.note({big.id: "no live service has 8 devices; largest has 2", small.id: "x"})
    assert store.get(big.id).reason.startswith("no live") and store.get(big.id).state == "QUEUED"
    assert [j.id for j in store.waiting_with(gpus_over=8, reason_prefix="no live")] == [big.id]
    assert len(store.events(big.id)) == 1  # a reason, not a transition
    run(store, small.id)
    store.note({small.id: "ignored"})  # only waiting jobs carry such reasons
    assert store.get(small.id).reason == "pid 4242"


def test_exit_75_requeues_without_spending_an_attempt(store):
    job = store.submit(spec(max_attempts=1))
    run(store, job.id)
    back = store.finish(job.id, 75)
    assert back.state == "QUEUED" and back.failures == 0
    run(store, job.id)
    assert store.get(job.id).attempts == 2
    assert store.finish(job.id, 0).state == "SUCCEEDED"


def test_failures_retry_with_doubling_backoff_until_attempts_run_out(store):
    job = store.submit(spec(max_attempts=3))
    run(store, job.id)
    failed = store.finish(job.id, 1)
    assert failed.state == "FAILED" and failed.not_before is not None
    assert store.requeue_due(now=failed.not_before - 0.01) == []
    [again] = store.requeue_due(now=failed.not_before + 0.01)
    assert again.state == "QUEUED"
    run(store, job.id)
    second = store.finish(job.id, 1)
    assert second.not_before - second.finished_at == pytest.approx(backoff(2))
    store.requeue_due(now=second.not_before + 1)
    run(store, job.id)
    last = store.finish(job.id, 1)
    assert last.state == "FAILED" and last.failures == 3 and last.not_before is None
    assert store.requeue_due(now=1e12) == []
    assert backoff(1) * 2 == backoff(2) and backoff(50) == backoff(51)  # doubles, then a cap


def test_cancel_queued_running_and_retrying_jobs(store):
    queued = store.submit(spec())
    assert store.cancel(queued.id).state == "CANCELLED"
    running = store.submit(spec())
    run(store, running.id)
    assert store.cancel(running.id).state == "CANCELLING"
    assert store.finish(running.id, 143).state == "CANCELLED"
    retrying = store.submit(spec(max_attempts=2))
    run(store, retrying.id)
    store.finish(retrying.id, 1)
    stopped = store.cancel(retrying.id)
    assert stopped.state == "FAILED"
    assert store.requeue_due(now=1e12) == []  # no retry after a cancel


def test_cancel_while_starting_stops_the_process_once_it_exists(store):
    job = store.submit(spec())
    store.claim([(job.id, ["cpu:0"])], "h1")
    assert store.cancel(job.id).state == "CANCELLING"
    kept = store.mark_running(job.id, 99, None, "h1")
    assert kept.state == "CANCELLING" and kept.pid == 99


def test_claim_is_all_or_nothing_per_job_and_skips_taken_jobs(store):
    a, b = store.submit(spec()), store.submit(spec(gpus=2))
    first = store.claim([(a.id, ["cpu:0"]), (b.id, ["cpu:1", "cpu:2"])], "h1")
    assert [j.id for j in first] == [a.id, b.id]
    assert store.get(b.id).devices == ["cpu:1", "cpu:2"]
    assert store.claim([(a.id, ["cpu:3"])], "h2") == []  # already taken by h1


def test_claim_skips_a_device_disabled_or_quarantined_since_the_pass_read_it(store):
    """A pass plans from the devices it read; a person (or a check) may take one away before the claim
    commits. The claim re-reads them under its lock: the job stays QUEUED, with no attempt spent."""
    store.hosts.sync_devices("h1", ["cpu:0", "cpu:1", "cpu:2"])
    a, b, c = store.submit(spec()), store.submit(spec()), store.submit(spec(gpus=2))
    store.hosts.set_device_state("h1", "cpu:1", "disabled", "maintenance")
    store.hosts.set_device_state("h1", "cpu:2", "quarantined", "preflight failed")
    claimed = store.claim([(a.id, ["cpu:0"]), (b.id, ["cpu:1"]), (c.id, ["cpu:0", "cpu:2"])], "h1")
    assert [j.id for j in claimed] == [a.id]
    for job_id in (b.id, c.id):
        job = store.get(job_id)
        assert (job.state, job.attempts, job.devices) == ("QUEUED", 0, [])
    store.hosts.set_device_state("h1", "cpu:1", "available")
    assert [j.id for j in store.claim([(b.id, ["cpu:1"])], "h1")] == [b.id]


def test_idempotency_key_returns_the_same_job(store):
    a = store.submit(spec(idempotency_key="session-1:0"))
    b = store.submit(spec(idempotency_key="session-1:0", name="other"))
    assert a.id == b.id and store.count() == 1


def test_demote_preempts_a_running_job(store):
    job = store.submit(spec(priority=0))
    run(store, job.id)
    demoted = store.demote(job.id, -5, "ASHA")
    assert demoted.state == "PREEMPTING" and demoted.priority == -5


def test_unknown_job_is_bad_input(store):
    with pytest.raises(JobNotFound):
        store.get(12345)
    with pytest.raises(BadInput):
        store.cancel(12345)


def test_requeue_after_lost_host(store):
    job = store.submit(spec())
    run(store, job.id)
    back = store.requeue(job.id, "host lost")
    assert back.state == "QUEUED" and back.attempts == 1


def test_devices_keep_their_state_across_syncs(store):
    store.hosts.sync_devices("h1", ["cpu:0", "cpu:1"])
    store.hosts.set_device_state("h1", "cpu:1", "disabled", "maintenance")
    devs = store.hosts.sync_devices("h1", ["cpu:0", "cpu:1", "cpu:2"])
    assert [(d.name, d.state) for d in devs] == [("cpu:0", "available"), ("cpu:1", "disabled"),
                                                 ("cpu:2", "available")]
    with pytest.raises(BadInput):
        store.hosts.set_device_state("h1", "cpu:9", "disabled")


def test_every_contract_transition_is_known():
    # The job states' named edges must all be allowed (extensions may add more, never remove these).
    required = {(S.QUEUED, S.STARTING), (S.STARTING, S.RUNNING), (S.RUNNING, S.SUCCEEDED), (S.RUNNING, S.FAILED),
                (S.RUNNING, S.CANCELLED), (S.RUNNING, S.PREEMPTING), (S.PREEMPTING, S.QUEUED),
                (S.RUNNING, S.CANCELLING), (S.CANCELLING, S.CANCELLED), (S.FAILED, S.QUEUED)}
    assert all(dst in ALLOWED[src] for src, dst in required)
    assert ALLOWED[S.SUCCEEDED] == ALLOWED[S.CANCELLED] == frozenset()


def _submit_many(url, n, out):
    store = JobStore(url)
    out.put([store.submit(JobSpec(argv=["true"])).id for _ in range(n)])


def test_concurrent_submitters_lose_nothing(db_url):
    JobStore(db_url).close()
    out = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=_submit_many, args=(db_url, 25, out)) for _ in range(4)]
    for p in procs:
        p.start()
    ids = [i for _ in procs for i in out.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
    assert len(ids) == 100 and len(set(ids)) == 100
    assert JobStore(db_url).count() == 100


def test_unreachable_database_is_a_clear_error(tmp_path):
    with pytest.raises(StoreUnavailable, match="cannot"):
        JobStore(f"sqlite:///{tmp_path}/missing/dir/queue.db")
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        JobStore("postgresql+psycopg2://nobody:secret@127.0.0.1:1/none?connect_timeout=1")


def test_a_database_from_an_older_release_is_upgraded_in_place(db_url):
    """Columns added since a queue database was made (time_limit, ...) are added on open; its jobs stay."""
    from sqlalchemy import text

    old = JobStore(db_url)
    kept = old.submit(spec(name="from before")).id
    with old.db.engine.connect() as conn:  # what an older release left: no time_limit (nor job environment) column
        for column in ("time_limit", "image", "image_id", "mounts", "env_file"):
            conn.execute(text(f'ALTER TABLE "jobs" DROP COLUMN "{column}"'))
        conn.commit()
    old.close()
    store = JobStore(db_url)
    try:
        assert store.get(kept).name == "from before" and store.get(kept).time_limit is None
        assert store.get(store.submit(spec(time_limit=30.0)).id).time_limit == 30.0
        boxed = store.get(store.submit(spec(image="img:1", image_id="sha256:ab", mounts=["/a:/b:ro"])).id)
        assert (boxed.image, boxed.image_id, boxed.mounts) == ("img:1", "sha256:ab", ["/a:/b:ro"])
    finally:
        store.close()
    again = JobStore(db_url)  # a second open finds nothing to add
    again.close()


def test_a_batch_of_mixed_ends_gives_each_job_its_own_checked_transition_and_event(store):
    """The batch transitions (claim, mark_running_many, finish_many) write rows together: jobs whose ends
    change different columns (a success, a failure to retry, exit 75, a preemption, a cancel) still each get
    exactly their state, columns and one event per transition, and a stale report changes nothing."""
    ids = [store.submit(spec(max_attempts=2 if i == 1 else 1)).id for i in range(6)]
    claimed = store.claim([(job_id, [f"cpu:{i}"]) for i, job_id in enumerate(ids)], "h1")
    assert [j.attempts for j in claimed] == [1] * 6 and {j.state for j in claimed} == {"STARTING"}
    assert store.mark_running_many([(job_id, 1000 + i, f"{i}.00") for i, job_id in enumerate(ids)], "h1") == ids
    store.preempt([ids[3]], "make room", "h1")
    store.cancel(ids[4])
    ended = store.finish_many([(ids[0], 1, 0, ""), (ids[1], 1, 1, ""), (ids[2], 1, 75, ""), (ids[3], 1, 0, ""),
                               (ids[4], 1, -15, ""), (ids[5], 2, 0, "a stale attempt")], "h1")
    assert [(j.id, j.state) for j in ended] == [(ids[0], "SUCCEEDED"), (ids[1], "FAILED"), (ids[2], "QUEUED"),
                                                (ids[3], "QUEUED"), (ids[4], "CANCELLED")]
    jobs = {j.id: j for j in store.get_many(ids)}
    assert (jobs[ids[0]].exit_code, jobs[ids[0]].pid, jobs[ids[0]].proc_start) == (0, 1000, "0.00")
    assert jobs[ids[0]].finished_at and jobs[ids[0]].started_at and jobs[ids[0]].devices == ["cpu:0"]
    assert (jobs[ids[1]].failures, jobs[ids[1]].retrying, jobs[ids[1]].not_before is not None) == (1, True, True)
    assert (jobs[ids[2]].devices, jobs[ids[2]].failures, jobs[ids[2]].exit_code) == ([], 0, 75)
    assert (jobs[ids[3]].preemptions, jobs[ids[3]].devices) == (1, [])
    assert jobs[ids[5]].state == "RUNNING"  # the report named another attempt
    head = [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING")]
    assert states(store, ids[0]) == head + [("RUNNING", "SUCCEEDED")]
    assert states(store, ids[1]) == head + [("RUNNING", "FAILED")]
    assert states(store, ids[2]) == head + [("RUNNING", "QUEUED")]
    assert states(store, ids[3]) == head + [("RUNNING", "PREEMPTING"), ("PREEMPTING", "QUEUED")]
    assert states(store, ids[4]) == head + [("RUNNING", "CANCELLING"), ("CANCELLING", "CANCELLED")]
    assert states(store, ids[5]) == head


def test_reads_neither_take_nor_wait_for_the_sqlite_write_lock(tmp_path):
    """`show`, `queue`, `top` and the MCP reads go on while a writer (the service committing a pass, a
    submit) holds SQLite's write lock: a read never waits for it, nor blocks writers by taking it."""
    import sqlite3
    import threading

    path = tmp_path / "queue.db"
    store = JobStore(f"sqlite:///{path}")
    job = store.submit(spec(name="visible"))
    store.claim([(job.id, ["cpu:0"])], "h1")
    writer = sqlite3.connect(path, isolation_level=None, timeout=0.1)
    writer.execute("BEGIN IMMEDIATE")  # held for the whole read below
    answers: dict = {}

    def read() -> None:
        answers["get"] = store.get(job.id).name
        answers["events"] = len(store.events(job.id))
        answers["count"] = (store.count(), store.count_in(JobState.STARTING))
        answers["list"] = [j.id for j in store.list([JobState.STARTING])]
        answers["listing"] = [row["id"] for row in store.listing().jobs]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)  # the busy timeout is 30 s: a read that waits for the lock is still waiting
    writer.execute("ROLLBACK")
    writer.close()
    assert not reader.is_alive(), "a read waited for the write lock"
    assert answers == {"get": "visible", "events": 2, "count": (1, 1), "list": [job.id], "listing": [job.id]}
    store.close()
