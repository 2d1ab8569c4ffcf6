"""The spawner processes start attempts as the service used to start them itself: in a session of their own,
stdin from /dev/null, output appended to the log after its header, the environment given and signals at their
defaults. Answers come back in order; a spawner that dies costs no job and is replaced."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import psutil
import pytest

from orchestrator.api import jobs as api
from orchestrator.executors.local import procs
from orchestrator.executors.local.spawner import SPAWNERS, Spawner, SpawnerGone
from orchestrator.queue.models import JobSpec
from orchestrator.queue.states import JobState
from tests.orchestrator.helpers import wait_for

# Reports what a started process sees of itself, then stays a moment so its start time can be compared.
REPORT = r"""
import json, os, sys
print(json.dumps({"index": int(sys.argv[1]), "pid": os.getpid(), "sid": os.getsid(0),
                  "stdin": os.readlink("/proc/self/fd/0"), "var": os.environ.get("SPAWN_TEST_VAR")}), flush=True)
"""


def spawner_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children()
            if "orchestrator.executors.local.spawner" in " ".join(p.cmdline())]


def in_fifo_open_pid(pid: int) -> bool:
    """Whether process `pid` is blocked opening a FIFO (the kernel's `wait_for_partner`)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return any(open(f"/proc/{pid}/task/{t}/wchan").read() == "wait_for_partner" for t in tasks)
    except OSError:  # it ended meanwhile
        return False


def waiting_for_requests(pid: int) -> bool:
    """Whether spawner `pid` is idle in its select, waiting for requests (it has started up)."""
    try:
        return open(f"/proc/{pid}/wchan").read() in ("do_epoll_wait", "ep_poll")
    except OSError:
        return False


def in_fifo_open() -> bool:
    """Whether a spawner process is blocked opening a FIFO: it has taken the request and cannot answer until
    someone reads the FIFO."""
    return any(in_fifo_open_pid(proc.pid) for proc in spawner_processes())


@pytest.fixture
def spawner():
    spawner = Spawner()
    yield spawner
    spawner.close()


def request(tmp_path, argv: list[str], index: int = 0) -> dict:
    return {"argv": argv, "env": {**os.environ, "SPAWN_TEST_VAR": f"value {index}"},
            "log": str(tmp_path / f"{index}.log"), "header": f"=== header {index}\n"}


def test_each_request_starts_as_asked_and_answers_come_in_order(spawner, tmp_path):
    n = 2 * SPAWNERS + 1  # every spawner process gets a share, in turn
    answers = spawner.spawn_many([request(tmp_path, [sys.executable, "-c", REPORT, str(i)], i) for i in range(n)])
    assert len(answers) == n
    for i, (pid, start) in enumerate(answers):
        log = tmp_path / f"{i}.log"
        wait_for(lambda: log.read_text().count("\n") >= 2, what=f"the report of request {i}")
        header, line = log.read_text().splitlines()[:2]
        seen = json.loads(line)
        assert header == f"=== header {i}"
        assert seen["index"] == i and seen["pid"] == pid  # the i-th answer is the i-th request's process
        assert seen["sid"] == pid  # a session of its own
        assert seen["stdin"] == os.devnull
        assert seen["var"] == f"value {i}"
        assert start is not None and isinstance(start, str)
    # Signals at their defaults, as Popen left them (the spawner, like any Python, ignores SIGPIPE and SIGXFSZ,
    # and it ignores SIGINT): a job's pipes and file size limits behave as in a shell.
    spawner.spawn_many([request(tmp_path, ["/bin/cat", "/proc/self/status"], 98)])
    status = tmp_path / "98.log"
    wait_for(lambda: "SigIgn" in status.read_text(), what="cat's status")
    ignored = int(next(line for line in status.read_text().splitlines() if line.startswith("SigIgn")).split()[1], 16)
    assert [n for n in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ) if ignored & (1 << (n - 1))] == []
    pid, start = spawner.spawn_many([request(tmp_path, ["/bin/sleep", "5"], 99)])[0]
    try:
        assert procs.start_time(pid) == start  # the same start time the service records and compares
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_request_that_cannot_start_gets_its_error_and_the_others_start(spawner, tmp_path):
    answers = spawner.spawn_many([request(tmp_path, ["/bin/true"], 0),
                                  request(tmp_path, [str(tmp_path / "no-such-program")], 1),
                                  request(tmp_path, ["/bin/true"], 2)])
    assert isinstance(answers[1], OSError) and "no-such-program" in str(answers[1])
    assert all(isinstance(a, tuple) and a[0] > 0 for a in (answers[0], answers[2]))


def test_a_batch_that_cannot_be_sent_starts_nothing_and_the_next_one_is_answered_right(spawner, tmp_path):
    bad = dict(request(tmp_path, ["/bin/true"], 1), env={"NOT_TEXT": object()})
    marks = [tmp_path / f"mark{i}" for i in range(4)]
    with pytest.raises(TypeError):
        spawner.spawn_many([request(tmp_path, ["/bin/sh", "-c", f"touch {marks[0]}"], 0), bad,
                            request(tmp_path, ["/bin/sh", "-c", f"touch {marks[1]}"], 2)])
    answers = spawner.spawn_many([request(tmp_path, ["/bin/sh", "-c", f"touch {marks[i]}; sleep 1"], i)
                                  for i in (2, 3)])
    for (pid, start), mark in zip(answers, marks[2:]):  # each answer is its own request's process
        wait_for(mark.exists, what=f"{mark.name}")
        assert procs.same_process(pid, start) is not None
    assert not marks[0].exists() and not marks[1].exists()  # nothing of the refused batch started


def test_a_spawner_killed_before_it_answers_is_reported_and_replaced(spawner, tmp_path):
    fifo = tmp_path / "0.log"
    os.mkfifo(fifo)  # opening it for writing blocks the spawner until someone reads: it cannot answer
    spawner.start()
    answers = []
    waiting = threading.Thread(target=lambda: answers.extend(spawner.spawn_many([request(tmp_path, ["/bin/true"])])))
    waiting.start()
    wait_for(in_fifo_open, what="the spawner to block in the FIFO's open")
    assert not answers
    killed = {proc.pid for proc in spawner_processes()}
    for proc in spawner_processes():
        proc.kill()
    waiting.join(timeout=10)
    assert len(answers) == 1 and isinstance(answers[0], SpawnerGone)
    fifo.unlink()
    pid, _ = spawner.spawn_many([request(tmp_path, ["/bin/true"])])[0]  # new processes, and it starts
    assert pid > 0 and spawner_processes() and not killed & {p.pid for p in spawner_processes()}


def test_a_spawner_that_does_not_answer_in_time_is_stopped_and_replaced(spawner, tmp_path, monkeypatch):
    from orchestrator.executors.local import spawner as spawning

    spawner.start()
    # Up and waiting for requests before the short deadline runs: on a loaded machine an interpreter's start
    # alone can take longer, and then the deadline would stop a slow spawner, not one that hangs.
    [asked] = wait_for(lambda: [p for p in spawner_processes() if waiting_for_requests(p.pid)] or None,
                       what="the spawner to wait for requests")
    monkeypatch.setattr(spawning, "ANSWER_WITHIN", 0.5)
    os.mkfifo(tmp_path / "0.log")  # its open blocks until someone reads the FIFO, which nobody does
    started = time.monotonic()
    [answer] = spawner.spawn_many([request(tmp_path, ["/bin/true"])])
    assert isinstance(answer, SpawnerGone) and answer.hung and time.monotonic() - started < 10
    assert not psutil.pid_exists(asked.pid)  # stopped (and collected)
    monkeypatch.setattr(spawning, "ANSWER_WITHIN", 60.0)  # the new spawner's start-up is not what is tested
    pid, _ = spawner.spawn_many([request(tmp_path, ["/bin/true"], 1)])[0]  # a new spawner answers
    assert pid > 0 and asked.pid not in {p.pid for p in spawner_processes()}


def test_a_batch_larger_than_the_pipes_is_answered_in_full(tmp_path):
    """1,500 starts on one spawner process: more requests than its input pipe holds, and more answers than its
    output pipe holds. Writing them all before reading any answer would leave both sides waiting for ever."""
    one = Spawner(processes=1)
    try:
        env = {"PATH": os.environ["PATH"], "PADDING": "x" * 300}  # 1,500 requests: about 700 KB
        log = str(tmp_path / "all.log")
        answers = one.spawn_many([{"argv": ["/bin/true"], "env": env, "log": log, "header": ""}
                                  for _ in range(1500)])
        assert len(answers) == 1500
        failed = [a for a in answers if not isinstance(a, tuple)]
        assert not failed and all(pid > 0 for pid, _ in answers), failed[:3]
        assert len({pid for pid, _ in answers}) == 1500
    finally:
        one.close()


def test_closing_while_a_batch_hangs_stops_its_spawner_soon(tmp_path, monkeypatch):
    """The service stops while a start is blocked on its log (a volume that hangs): `close` waits a moment,
    then kills the spawner, and the batch gets SpawnerGone for it instead of waiting out ANSWER_WITHIN."""
    from orchestrator.executors.local import spawner as spawning

    monkeypatch.setattr(spawning, "CLOSE_WAIT", 0.5)
    one = Spawner(processes=1)
    os.mkfifo(tmp_path / "0.log")
    answers = []
    waiting = threading.Thread(target=lambda: answers.extend(one.spawn_many([request(tmp_path, ["/bin/true"])])))
    waiting.start()
    wait_for(in_fifo_open, what="the spawner to block in the FIFO's open")
    started = time.monotonic()
    one.close()
    waiting.join(timeout=10)
    assert time.monotonic() - started < 10 and not waiting.is_alive()
    assert len(answers) == 1 and isinstance(answers[0], SpawnerGone)
    assert not spawner_processes()


def test_what_a_spawner_started_outlives_it(spawner, tmp_path):
    pid, start = spawner.spawn_many([request(tmp_path, ["/bin/sleep", "30"])])[0]
    try:
        spawner.close()
        assert not spawner_processes()
        assert procs.same_process(pid, start) is not None
    finally:
        os.kill(pid, signal.SIGKILL)


def test_the_service_starts_jobs_after_its_spawners_were_killed(make_service, home, monkeypatch):
    """kill -9 of every spawner: a job whose start was lost with them is not lost and runs once; later jobs
    start on new spawners."""
    monkeypatch.setenv("AUTORESEARCH_RETRY_BACKOFF", "0")
    service = make_service(devices="cpu:2")
    marks = home / "marks"
    logs = service.layout.logs_dir
    logs.mkdir(parents=True, exist_ok=True)
    os.mkfifo(logs / "1.log")  # job 1's log: its spawner blocks opening it
    first, _ = api.submit(JobSpec(argv=["sh", "-c", f"echo ran >> {marks}"], track=False, max_attempts=3),
                          store=service.store)
    assert first.id == 1
    wait_for(lambda: service.store.get(1).job_state is JobState.STARTING, what="job 1 claimed")
    wait_for(in_fifo_open, what="job 1's spawner to block in the open() of its log")  # nothing answered
    killed = spawner_processes()
    for proc in killed:
        proc.kill()
    wait_for(lambda: not any(in_fifo_open_pid(p.pid) for p in killed), what="the killed spawners to leave the open()")
    reader = os.open(logs / "1.log", os.O_RDONLY | os.O_NONBLOCK)  # its log no longer blocks the next start
    try:
        later = [api.submit(JobSpec(argv=["sh", "-c", f"echo ran >> {marks}"], track=False), store=service.store)[0]
                 for _ in range(3)]
        for job in [first, *later]:
            wait_for(lambda: service.store.get(job.id).job_state is JobState.SUCCEEDED,
                     what=f"job {job.id} succeeded")
    finally:
        os.close(reader)
    assert marks.read_text().count("ran") == 4  # each job ran once
    assert service.store.get(1).failures == 0  # the lost start spent no attempt
    events = [e.reason for e in service.store.events(1)]
    assert any("could not start" in reason and "spawner stopped" in reason for reason in events), events


@pytest.mark.parametrize("ends", [False, True], ids=["still-running", "ended"])
def test_a_start_whose_answer_was_lost_is_found_and_watched(home, tmp_path, ends):
    """The spawner started the attempt and stopped before it answered: the executor finds the attempt by its
    wrapper's environment (or, when it has ended, by its exit record) and reports its end exactly once."""
    import queue

    from orchestrator.core.config import Settings
    from orchestrator.executors.base import job_env
    from orchestrator.executors.local.executor import LocalExecutor
    from orchestrator.core.layout import Layout
    from orchestrator.queue.store import JobStore

    store = JobStore(Settings.load().db_url)
    argv = ["sh", "-c", "exit 3"] if ends else ["sh", "-c", "sleep 1; exit 3"]
    job = api.submit(JobSpec(argv=argv, track=False), store=store)[0]
    [job] = store.claim([(job.id, ["cpu:0"])], "h", log_root=str(tmp_path), checkpoint_root=str(tmp_path))
    seen: queue.Queue = queue.Queue()
    executor = LocalExecutor(Layout(tmp_path), seen.put)
    real, spawned = executor._spawner.spawn_many, []

    def answer_lost(requests):
        started = real(requests)
        spawned.extend(started)
        if ends:  # it has ended (and been reaped) before anyone looks for it
            wait_for(lambda: procs.same_process(*started[0]) is None, what="the attempt to end")
        return [SpawnerGone("the spawner stopped: killed") for _ in started]

    executor._spawner.spawn_many = answer_lost
    try:
        [outcome] = executor.launch_many([(job, job_env(job, base=dict(os.environ), layout=Layout(tmp_path),
                                                       tracking_uri=""))])
        assert not isinstance(outcome, Exception), outcome
        assert outcome.pid == (0 if ends else spawned[0][0])  # a running one is watched by its own pid
        ended = seen.get(timeout=30)
        assert (ended.job_id, ended.attempt, ended.code) == (job.id, job.attempts, 3)
        # Once: reports come only from watched attempts, and the watcher has none left (no pidfd in its
        # selector but its wake-up pipe, none pending) that could report this attempt again.
        watcher = executor._watcher
        wait_for(lambda: len(watcher._sel.get_map()) == 1 and not watcher._pending and not watcher._watches,
                 what="the watcher to hold no attempt")
        assert seen.empty()
    finally:
        executor.close()


def test_a_spawner_dying_mid_share_loses_no_job_and_starts_none_twice(make_service, home):
    """Four jobs in one pass share two spawner processes, two each. One of them starts its first job and blocks
    opening the second's log (a FIFO), and is killed there. The job it started (its answer lost) is found and
    watched, not started again; the job it never started goes back in line without spending an attempt (it has
    one) and another spawner starts it; the other spawner's jobs are not disturbed. Each job runs once."""
    from orchestrator.core.config import Settings
    from orchestrator.core.layout import Layout
    from orchestrator.queue.store import JobStore

    settings = Settings.load()
    store = JobStore(settings.db_url)
    marks = home / "marks"
    logs = Layout(settings.home).logs_dir
    logs.mkdir(parents=True, exist_ok=True)
    fifo = logs / "3.log"  # job 3's log: the third request of the batch, the first spawner's second
    os.mkfifo(fifo)
    jobs = [api.submit(JobSpec(argv=["sh", "-c", f"echo ran {i} >> {marks}"], track=False), store=store)[0]
            for i in range(1, 5)]
    assert [job.id for job in jobs] == [1, 2, 3, 4]
    service = make_service(devices="cpu:4")  # its first pass claims all four: one batch
    blocked = wait_for(lambda: next((p for p in spawner_processes() if in_fifo_open_pid(p.pid)), None),
                       what="a spawner to block in the open() of job 3's log")
    others = {p.pid for p in spawner_processes()} - {blocked.pid}
    blocked.kill()  # (not reaped here: its parent, the service's Spawner, collects its exit code)
    wait_for(lambda: not in_fifo_open_pid(blocked.pid), what="the killed spawner to leave the open()")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # from now on opening job 3's log does not block
    try:
        for job in jobs:
            wait_for(lambda: store.get(job.id).job_state is JobState.SUCCEEDED, what=f"job {job.id} succeeded")
        ran = sorted(marks.read_text().split("\n")[:-1])
        assert ran == [f"ran {i}" for i in range(1, 5)]  # each job ran, once
        third = store.get(3)
        assert third.failures == 0 and third.attempts == 2  # the lost start spent no attempt
        assert [store.get(i).attempts for i in (1, 2, 4)] == [1, 1, 1]
        reasons = [e.reason for e in store.events(3)]
        assert any("spawner stopped" in r and "without spending an attempt" in r for r in reasons), reasons
        assert others <= {p.pid for p in spawner_processes()}  # the spawner that answered was not replaced
        assert os.read(reader, 1 << 16).decode().startswith("=== autoresearch: attempt 2 of job 3")
    finally:
        os.close(reader)
