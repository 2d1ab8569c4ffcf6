"""Several services on one PostgreSQL queue: LISTEN/NOTIFY wake-ups, reaping a crashed host exactly once, and
two real `autoresearch serve` processes (different homes and node names) sharing 200 jobs, one of them
killed with SIGKILL mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from orchestrator.api import jobs as api
from orchestrator.service.reaper import reap_dead_hosts
from orchestrator.executors.local.executor import EXIT_FILE_VAR, WRAPPER, LocalExecutor
from orchestrator.executors.local.procs import start_time
from orchestrator.core.layout import Layout
from orchestrator.queue.models import JobSpec
from orchestrator.queue.states import HOLDING
from orchestrator.queue.store import JobStore
from orchestrator.core.wakeup import PgListener
from tests.orchestrator.helpers import kill_leftovers, wait_for


def test_pg_listener_wakes_on_notify_and_survives_a_dropped_connection(pg_url):
    store = JobStore(pg_url)
    woken = threading.Event()
    listener = PgListener(pg_url, woken.set)
    try:
        assert listener.connected.wait(10)
        store.submit(JobSpec(argv=["true"]))
        assert woken.wait(5), "no wake-up on NOTIFY"
        woken.clear()
        backend = listener._conn.get_backend_pid()
        with store.db.engine.connect() as conn:  # kill the listener's backend, as a server restart would
            from sqlalchemy import text

            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": backend})
        wait_for(lambda: not listener.connected.is_set() or woken.is_set(), timeout=40, what="the drop")
        assert listener.connected.wait(20), "no reconnect"
        woken.clear()
        store.submit(JobSpec(argv=["true"]))
        assert woken.wait(5), "no wake-up after reconnecting"
    finally:
        listener.close()


def _dead_host(store: JobStore, host: str, home: Path) -> None:
    store.hosts.heartbeat(host, 999999, str(home), ["cpu:0", "cpu:1", "cpu:2"], time.time() - 60)
    from sqlmodel import Session

    from orchestrator.queue.models import ServiceRecord

    with Session(store.db.engine) as session:  # its last heartbeat was a minute ago
        rec = session.get(ServiceRecord, host)
        rec.heartbeat_at = time.time() - 60
        session.add(rec)
        session.commit()


def test_reaper_settles_a_dead_hosts_jobs_exactly_once(pg_url, tmp_path):
    store = JobStore(pg_url)
    dead_home = tmp_path / "dead"
    (dead_home / "run").mkdir(parents=True)
    _dead_host(store, "dead", dead_home)
    ids = [store.submit(JobSpec(argv=["x"], track=False)).id for _ in range(3)]
    store.claim([(ids[0], ["cpu:0"]), (ids[1], ["cpu:1"]), (ids[2], ["cpu:2"])], "dead")
    # ids[0]: ended on its own with exit 0 while its service was dead (its wrapper recorded the code).
    gone = subprocess.Popen(["true"])
    gone.wait()
    store.mark_running(ids[0], gone.pid, None, "dead")
    (dead_home / "run" / f"{ids[0]}.1.exit").write_text("0")
    # ids[1]: no trace here (another machine went down): requeued.
    store.mark_running(ids[1], gone.pid, None, "dead")
    # ids[2]: still running on this machine: stopped first (SIGTERM), settled once it is gone.
    env = dict(os.environ, **{EXIT_FILE_VAR: str(dead_home / "run" / f"{ids[2]}.1.exit")})
    orphan = subprocess.Popen(["/bin/sh", "-c", WRAPPER, "autoresearch-job", str(tmp_path), "sleep", "60"],
                              env=env, start_new_session=True)
    # Each reaper is a service of its own on this machine, asking its own executor.
    executors = [LocalExecutor(Layout(tmp_path / f"live{i}"), lambda _exit: None) for i in range(4)]
    executor = executors[0]
    try:
        store.mark_running(ids[2], orphan.pid, start_time(orphan.pid), "dead")
        results: list = []
        reapers = [threading.Thread(target=lambda i=i: results.extend(reap_dead_hosts(store, f"live{i}", 10,
                                                                                      executors[i])))
                   for i in range(4)]
        for t in reapers:
            t.start()
        for t in reapers:
            t.join()
        assert sorted(j.id for j in results) == ids[:2]  # each settled by one reaper only
        assert store.get(ids[0]).state == "SUCCEEDED"
        assert store.get(ids[1]).state == "QUEUED" and "host dead lost" in store.get(ids[1]).reason
        assert store.get(ids[2]).state == "RUNNING"  # not requeued while its process lives
        assert orphan.wait(timeout=10) == 143  # it got SIGTERM
        assert [j.id for j in reap_dead_hosts(store, "live0", 10, executor)] == [ids[2]]
        job = store.get(ids[2])
        assert job.state == "QUEUED" and job.attempts == 1 and job.failures == 0  # no attempt spent
        assert reap_dead_hosts(store, "live0", 10, executor) == []
        assert [s.host for s in store.hosts.services()] == []  # the dead host's row is gone once settled
        for job_id in ids:
            assert sum(e.reason.startswith("host dead lost") or "recorded after host dead lost" in e.reason
                       for e in store.events(job_id)) == 1
    finally:
        for each in executors:
            each.close()
        if orphan.poll() is None:
            os.killpg(orphan.pid, signal.SIGKILL)


def _serve(home: Path, node: str, db_url: str, log: Path, devices: str = "cpu:4") -> subprocess.Popen:
    env = dict(os.environ, AUTORESEARCH_HOME=str(home), AUTORESEARCH_DB_URL=db_url, AUTORESEARCH_NODE=node,
               TEST_HOST=node, MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}",
               AUTORESEARCH_PREFLIGHT="off")  # device preflight is the health suite's; it costs a torch import
    home.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).with_name("autoresearch")
    return subprocess.Popen([str(exe), "serve", "--devices", devices, "--preempt-after", "0"], env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def _running(pid: int) -> bool:
    """Whether `pid` still runs: a killed orphan can linger as a zombie until init reaps it, which here is slow."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_hosts_share_200_jobs_and_survive_kill_9(pg_url, tmp_path, home):
    store = JobStore(pg_url)
    out = tmp_path / "ran.txt"
    line = f'echo "$AUTORESEARCH_JOB_ID $TEST_HOST" >> {out}'
    services: dict[str, subprocess.Popen] = {}
    try:
        services["A"] = _serve(tmp_path / "homeA", "A", pg_url, tmp_path / "A.log")
        wait_for(lambda: {s.host for s in store.hosts.services(max_age=5)} == {"A"}, timeout=60, what="host A")
        # Two long jobs land on A first (only A runs); killed with A, they must finish on B.
        long_ids = [api.submit(JobSpec(argv=["sh", "-c", f'[ "$AUTORESEARCH_ATTEMPT" = 1 ] && sleep 300; {line}'],
                                       priority=20, track=False), store=store)[0].id for _ in range(2)]
        wait_for(lambda: all(store.get(j).state == "RUNNING" for j in long_ids), timeout=30)
        long_pids = [store.get(j).pid for j in long_ids]
        services["B"] = _serve(tmp_path / "homeB", "B", pg_url, tmp_path / "B.log")
        wait_for(lambda: {s.host for s in store.hosts.services(max_age=5)} == {"A", "B"}, timeout=60, what="host B")
        short = JobSpec(argv=["sh", "-c", f"sleep 0.2; {line}"], track=False)
        short_ids = [api.submit(short, store=store)[0].id for _ in range(200)]

        def ran_on(host):
            return sum(1 for ln in out.read_text().splitlines() if ln.endswith(f" {host}")) if out.exists() else 0

        wait_for(lambda: ran_on("A") >= 15 and ran_on("B") >= 15, timeout=60, what="both hosts to run jobs")
        services["A"].send_signal(signal.SIGKILL)
        services["A"].wait()
        # A's orphans live on until B reaps A (heartbeat stale for 10 s): no job runs twice meanwhile.
        assert all(store.get(j).state == "RUNNING" and store.get(j).host == "A" for j in long_ids)
        every = long_ids + short_ids
        wait_for(lambda: store.count_in("SUCCEEDED") == len(every), timeout=150, interval=0.5,
                 what="every job to succeed")
        counts = Counter(int(ln.split()[0]) for ln in out.read_text().splitlines())
        twice = {j: [(round(e.at, 2), e.src, e.dst, e.reason, e.host) for e in store.events(j)]
                 for j, n in counts.items() if n > 1}
        assert not twice, f"ran more than once: {twice} {[ln for ln in out.read_text().splitlines() if int(ln.split()[0]) in twice]}"
        assert sorted(counts) == sorted(every)  # each ran exactly once
        for job_id, pid in zip(long_ids, long_pids):
            job = store.get(job_id)
            assert job.host == "B" and job.attempts == 2 and job.failures == 0
            assert any("host A lost" in e.reason for e in store.events(job_id))
            assert not _running(pid)  # the orphan was stopped before the job ran again
        assert {s.host for s in store.hosts.services()} == {"B"}
    finally:
        _stop(services, store)


def test_reaper_on_sqlite(tmp_path):
    """The reaper also works on SQLite (services of one machine sharing a file): a lease elects one."""
    store = JobStore(f"sqlite:///{tmp_path / 'q.db'}")
    _dead_host(store, "dead", tmp_path)
    job_id = store.submit(JobSpec(argv=["x"], track=False)).id
    store.claim([(job_id, ["cpu:0"])], "dead")
    executor = LocalExecutor(Layout(tmp_path / "live"), lambda _exit: None)
    assert [j.id for j in reap_dead_hosts(store, "live", 10, executor)] == [job_id]
    assert store.get(job_id).state == "QUEUED" and reap_dead_hosts(store, "live", 10, executor) == []
    assert not [j for j in store.list(HOLDING)]
    executor.close()


def test_reaper_waits_on_a_job_it_cannot_judge(tmp_path):
    """A lost host's job whose handle belongs to another executor (a Ray job, asked about by a local one):
    the reaper neither requeues it (it might still run: it would run twice) nor forgets the host."""
    store = JobStore(f"sqlite:///{tmp_path / 'q.db'}")
    _dead_host(store, "dead", tmp_path)
    job_id = store.submit(JobSpec(argv=["x"], track=False)).id
    store.claim([(job_id, ["cpu:0"])], "dead")
    store.mark_running(job_id, 0, "ray:autoresearch-1-1-abc@http://127.0.0.1:9", "dead")
    executor = LocalExecutor(Layout(tmp_path / "live"), lambda _exit: None)
    try:
        assert reap_dead_hosts(store, "live", 10, executor) == []
        assert store.get(job_id).state == "RUNNING"
        assert [s.host for s in store.hosts.services()] == ["dead"]  # tried again on a later pass
    finally:
        executor.close()


def test_a_projects_quota_holds_across_two_hosts(pg_url, tmp_path, home):
    """Two `serve` processes (2 slots each) on one PostgreSQL queue: a flood at a high priority borrows all four
    devices; the owner of a quota of 2 submits two jobs and both run within preempt_after + grace, wherever the
    borrowers ran, and the flood keeps exactly its own quota of 2 across the two hosts meanwhile."""
    from orchestrator.api import sharing
    from orchestrator.core.config import Settings
    from tests.orchestrator.helpers import ckpt_job

    grace = 2.0
    store = JobStore(pg_url)
    services: dict[str, subprocess.Popen] = {}
    try:
        for host in ("A", "B"):
            services[host] = _serve(tmp_path / f"home{host}", host, pg_url, tmp_path / f"{host}.log", "cpu:2")
        wait_for(lambda: {s.host for s in store.hosts.services(max_age=5)} == {"A", "B"}, timeout=90, what="both hosts")
        settings = Settings.load()
        for name in ("owner", "flood"):  # 2 + 2: the devices of both hosts together, not of either
            sharing.set_project(settings, name, share=1, quota=2, store=store)
        flood = [api.submit(ckpt_job(4000, priority=90, project="flood", grace=grace, name=f"flood{i}"),
                            store=store)[0].id for i in range(6)]

        def running(ids):
            return [store.get(j) for j in ids if store.get(j).state == "RUNNING"]

        wait_for(lambda: {j.host for j in running(flood)} == {"A", "B"} and len(running(flood)) == 4, timeout=60,
                 what="the flood on both hosts")
        submitted = time.time()
        owner = [api.submit(ckpt_job(400, priority=0, project="owner", grace=grace, name=f"owner{i}"),
                            store=store)[0].id for i in range(2)]
        wait_for(lambda: len(running(owner)) == 2, timeout=60, what="the owner's jobs to run")
        started = max(next(e.at for e in store.events(j) if e.dst == "STARTING") for j in owner)
        # preempt_after is 0 here; the rest is grace, the services' passes and their 5 s look at the other host.
        assert started - submitted <= grace + 10.0
        wait_for(lambda: len(running(flood)) == 2 and not [j for j in flood if store.get(j).state == "PREEMPTING"],
                 timeout=30, what="the flood back at its quota")
        assert len(running(owner)) == 2  # both still run: nothing took their devices back
        victims = [j for j in flood if store.get(j).preemptions]
        assert 2 <= len(victims) and all(any("reclaim" in e.reason for e in store.events(j) if e.dst == "PREEMPTING")
                                         for j in victims)
    finally:
        _stop(services, store)


def _stop(services: dict, store) -> None:
    """Stop the test's services (SIGTERM, then kill after 15 s) and whatever jobs they left running."""
    for proc in services.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    kill_leftovers(store)
    store.close()


def test_two_services_requeueing_one_failed_job_requeue_it_once(pg_url):
    """Every service requeues the retries that are due each second; on a shared queue, while one service's
    requeue holds a failed job, another's skips it: before, both moved it (two FAILED -> QUEUED events, and the
    later write could put a job the first service had meanwhile claimed back in line)."""
    from sqlalchemy import text

    a, b = JobStore(pg_url), JobStore(pg_url)
    job = a.submit(JobSpec(argv=["true"], max_attempts=3))
    a.claim([(job.id, ["cpu:0"])], "A")
    a.mark_running(job.id, 4242, None, "A")
    failed = a.finish(job.id, 1, "A")
    assert failed.retrying
    with a.db.engine.connect() as held:  # service A's requeue of this job, in flight: it holds the job's row
        me = held.execute(text("SELECT pg_backend_pid()")).scalar()
        held.execute(text("SELECT id FROM jobs WHERE id = :id FOR UPDATE"), {"id": job.id})
        moved = []
        other = threading.Thread(target=lambda: moved.extend(b.requeue_due(now=failed.not_before + 1)))
        other.start()

        def waits_on_a() -> bool:
            with a.db.engine.connect() as conn:
                return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE "
                                              ":me = ANY(pg_blocking_pids(pid))"), {"me": me}).scalar())

        wait_for(lambda: not other.is_alive() or waits_on_a(), timeout=30, what="service B's requeue pass")
        held.execute(text("UPDATE jobs SET state = 'QUEUED', not_before = NULL WHERE id = :id"), {"id": job.id})
        held.execute(text("INSERT INTO job_events (job_id, at, src, dst, reason, host) "
                          "VALUES (:id, :at, 'FAILED', 'QUEUED', 'retry 2/3', 'A')"), {"id": job.id, "at": time.time()})
        held.commit()
    other.join(30)
    assert moved == []
    assert [(e.src, e.dst) for e in a.events(job.id)].count(("FAILED", "QUEUED")) == 1
    assert a.get(job.id).state == "QUEUED"
