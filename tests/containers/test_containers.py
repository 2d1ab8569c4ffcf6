"""Jobs in a container image, under a real podman: the container is the job's process.

Each test runs in a few seconds once the session's image exists (tests/containers/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import mlflow
import pytest

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from tests.containers.conftest import containers_of
from tests.orchestrator.helpers import wait_for

# Its tests share a session-wide image that one worker builds: under xdist they run on that one worker.
pytestmark = pytest.mark.xdist_group("podman-image")

# A checkpointing job that needs nothing but the image's python: a step every 0.1 s, its step saved on SIGTERM
# (the plain handler most scripts have: save, exit 0), resumed from the saved step.
STEPPER = textwrap.dedent("""
    import os, signal, sys, time
    ckpt = os.path.join(os.environ["AUTORESEARCH_CHECKPOINT_DIR"], "step")
    step = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    print("attempt", os.environ["AUTORESEARCH_ATTEMPT"], "from step", step, flush=True)
    def save(*_):
        open(ckpt, "w").write(str(step)); print("saved at step", step, flush=True); sys.exit(0)
    signal.signal(signal.SIGTERM, save)
    while step < int(sys.argv[1]):
        time.sleep(0.1); step += 1
        if step == 5: print("at step", step, flush=True)
    print("done at step", step, flush=True)
""")


def output(store, job_id) -> str:
    path = store.get(job_id).log_path
    return open(path).read() if path and os.path.exists(path) else ""


def finished(store, job_id):
    job = store.get(job_id)
    return job if job.final else None


def test_a_job_in_an_image_runs_the_images_python_with_its_env_and_workdir(make_service, image, tmp_path):
    service = make_service("cpu:1")
    work = tmp_path / "work"
    work.mkdir()
    (work / "env").write_text("GREETING='hello from a file'\n")
    probe = ("import importlib.util, os, sys; print('python', sys.executable);"
             "print('host python here', os.path.exists(sys.argv[1]), 'torch', bool(importlib.util.find_spec('torch')));"
             "print('host PATH', os.environ.get('PATH') == sys.argv[2]); print('cwd', os.getcwd());"
             "print('greeting', os.environ['GREETING']); open('out.txt', 'w').write('written inside')")
    job, _ = api.submit(JobSpec(argv=["python3", "-c", probe, sys.executable, os.environ["PATH"]], image=image,
                                cwd=str(work), env_file=str(work / "env")))
    assert job.image_id and job.image_id.startswith("sha256:")
    done = wait_for(lambda: finished(service.store, job.id), timeout=60, what="the container job")
    log = open(done.log_path).read()
    assert done.state == "SUCCEEDED", log
    lines = log.splitlines()
    # The image's python: not this venv's (absent inside), without the host's torch, under the image's PATH.
    assert "python /usr/bin/python3" in lines and "host python here False torch False" in lines
    assert "host PATH False" in lines
    assert f"cwd {work}" in lines and "greeting hello from a file" in lines
    assert (work / "out.txt").read_text() == "written inside"  # the workdir is the host's, bind-mounted
    assert "hello from a file" not in log.split("\n", 1)[0]  # the header shows names (-e KEY), not values
    tags = mlflow.MlflowClient().get_run(done.mlflow_run_id).data.tags
    assert tags["autoresearch.image"] == image and tags["autoresearch.image_digest"] == job.image_id
    assert containers_of(Settings.load().home) == []  # --rm: nothing left behind


def test_exit_75_requeues_a_container_job_without_spending_an_attempt(make_service, image, tmp_path):
    service = make_service("cpu:1")
    script = 'f=$AUTORESEARCH_CHECKPOINT_DIR/once; [ -e $f ] && exit 0; touch $f; exit 75'
    job, _ = api.submit(JobSpec(argv=["sh", "-c", script], image=image, track=False))
    done = wait_for(lambda: finished(service.store, job.id), timeout=60, what="the container job")
    assert (done.state, done.attempts, done.failures) == ("SUCCEEDED", 2, 0)
    assert any(e.reason.startswith("exit 75: requeued") for e in service.store.events(job.id))


def test_a_preempted_container_job_checkpoints_and_resumes(make_service, image, tmp_path):
    service = make_service("cpu:1", preempt_after=0)
    low, _ = api.submit(JobSpec(argv=["python3", "-c", STEPPER, "40"], image=image, priority=0, track=False,
                                grace=10))
    wait_for(lambda: "at step 5" in output(service.store, low.id).splitlines(), timeout=60,
             what="the low-priority job to start")
    high, _ = api.submit(JobSpec(argv=["true"], priority=50, track=False))
    done = wait_for(lambda: finished(service.store, low.id), timeout=90, what="the preempted job to finish")
    lines = output(service.store, low.id).splitlines()  # whole lines: the log's headers quote the script
    assert done.state == "SUCCEEDED" and done.preemptions == 1 and service.store.get(high.id).state == "SUCCEEDED"
    saved = [int(line.split()[-1]) for line in lines if line.startswith("saved at step ")]
    assert len(saved) == 1 and saved[0] >= 5, lines
    assert f"attempt 2 from step {saved[0]}" in lines and lines[-1] == "done at step 40"


def test_cancel_stops_and_removes_the_container(make_service, image, tmp_path):
    service = make_service("cpu:1")
    job, _ = api.submit(JobSpec(argv=["sleep", "300"], image=image, track=False, grace=2))
    wait_for(lambda: containers_of(Settings.load().home), timeout=60, what="the container to run")
    api.cancel(job.id)
    done = wait_for(lambda: finished(service.store, job.id), timeout=30, what="the cancel")
    assert done.state == "CANCELLED"
    wait_for(lambda: containers_of(Settings.load().home) == [], timeout=15, what="the container to be removed")


def test_kill_9_of_the_service_and_restart_adopts_the_running_container(home, image, tmp_path):
    store = JobStore(Settings.load().db_url)
    gate = tmp_path / "gate"
    serve = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--devices", "cpu:1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        job, _ = api.submit(JobSpec(argv=["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done; exit 3"],
                                    image=image, mounts=[f"{tmp_path}:{tmp_path}"], track=False))
        wait_for(lambda: store.get(job.id).state == "RUNNING" and containers_of(home), timeout=60,
                 what="the container job to run")
        pid = store.get(job.id).pid
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(timeout=10)
        assert containers_of(home), "the container outlives the service"
        serve = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--devices", "cpu:1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        mine = lambda: [s.heartbeat_at for s in api.live_services(store) if s.pid == serve.pid]  # noqa: E731
        first = wait_for(mine, timeout=60, what="the restarted service")[0]
        # Its second heartbeat comes after its reconcile: the job is adopted (watched), not found ended.
        wait_for(lambda: mine() and mine()[0] > first, timeout=60, what="the restarted service's reconcile")
        assert store.get(job.id).state == "RUNNING" and containers_of(home)
        gate.touch()
        done = wait_for(lambda: finished(store, job.id), timeout=60, what="the adopted job to end")
        assert (done.state, done.exit_code, done.attempts, done.pid) == ("FAILED", 3, 1, pid)
        wait_for(lambda: containers_of(home) == [], timeout=15, what="the container to be removed")
    finally:
        serve.kill()
        serve.wait(timeout=10)
        for name in containers_of(home):
            subprocess.run(["podman", "rm", "-f", name], capture_output=True)


def test_a_container_whose_client_died_with_the_service_is_reaped_removed_and_retried(home, image, tmp_path):
    store = JobStore(Settings.load().db_url)
    gate, passed = tmp_path / "gate", tmp_path / "first-attempt-passed"
    # The second attempt opens the gate the first waits on: a first attempt left running beside it (not reaped)
    # passes the gate and says so before its container ends.
    script = (f'[ "$AUTORESEARCH_ATTEMPT" = 2 ] && {{ touch {gate}; exit 0; }}; '
              f'while [ ! -e {gate} ]; do sleep 0.1; done; touch {passed}')
    serve = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--devices", "cpu:1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, "AUTORESEARCH_RETRY_BACKOFF": "0"})
    try:
        job, _ = api.submit(JobSpec(argv=["sh", "-c", script], image=image, track=False, max_attempts=2,
                                    mounts=[f"{tmp_path}:{tmp_path}"]))
        wait_for(lambda: store.get(job.id).state == "RUNNING" and containers_of(home), timeout=60,
                 what="the container job to run")
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(timeout=10)
        os.killpg(store.get(job.id).pid, signal.SIGKILL)  # the wrapper and the engine client, not the container
        assert containers_of(home), "the container runs on without its client"
        serve = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--devices", "cpu:1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, "AUTORESEARCH_RETRY_BACKOFF": "0"})
        done = wait_for(lambda: finished(store, job.id), timeout=90, what="the job to be retried")
        assert (done.state, done.attempts) == ("SUCCEEDED", 2)
        assert any("killed" in e.reason for e in store.events(job.id)), [e.reason for e in store.events(job.id)]
        wait_for(lambda: containers_of(home) == [], timeout=15, what="the first attempt's container to go")
        assert gate.exists() and not passed.exists()  # the first attempt was stopped, not left to finish
    finally:
        serve.kill()
        serve.wait(timeout=10)
        for name in containers_of(home):
            subprocess.run(["podman", "rm", "-f", name], capture_output=True)


def test_a_container_cancelled_while_its_engine_is_still_starting_it_gets_the_stop_once_it_runs(make_service, image,
                                                                                                 tmp_path):
    """The engine client is held before it creates the container (its containers.conf is a FIFO nobody writes
    yet) when the job is cancelled: the SIGTERM cannot reach a container that does not exist. Released, the
    engine creates it and the stop is delivered as soon as it runs: the job ends CANCELLED by that SIGTERM
    (exit 143), long before the SIGKILL at the end of its grace, and its container is removed."""
    from tests.containers.conftest import CONTAINERS_CONF
    from tests.orchestrator.test_spawner import in_fifo_open_pid

    held = tmp_path / "containers.conf"
    os.mkfifo(held)
    service = make_service("cpu:1")
    job, _ = api.submit(JobSpec(argv=["python3", "-c", STEPPER, "3000"], image=image, track=False, grace=30,
                                env={"CONTAINERS_CONF": str(held)}))  # the job's engine client reads it

    def held_client():
        pid = service.store.get(job.id).pid
        if not pid:
            return None
        import psutil

        try:
            tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return None
        return next((p for p in tree if in_fifo_open_pid(p.pid)), None)

    wait_for(held_client, timeout=60, what="the engine client to wait for its containers.conf")
    assert containers_of(Settings.load().home) == []  # still starting: no container yet
    api.cancel(job.id)
    wait_for(lambda: service.store.get(job.id).state == "CANCELLING", what="the cancel")
    feed = os.open(held, os.O_WRONLY)  # lets the client's open through ...
    real = tmp_path / "containers.conf.real"
    real.write_text(CONTAINERS_CONF)
    os.replace(real, held)  # ... and any later look at the setting finds a plain file
    os.write(feed, CONTAINERS_CONF.encode())
    os.close(feed)
    released = time.monotonic()
    done = wait_for(lambda: finished(service.store, job.id), timeout=60, what="the cancelled job to end")
    lines = output(service.store, job.id).splitlines()
    # Ended by the SIGTERM, never the grace's SIGKILL (137, at 30 s): by its default action (143) when it came
    # before the job's handler was set, else by the handler, which saves and exits 0.
    handled = any(line.startswith("saved at step ") for line in lines)
    assert done.state == "CANCELLED" and done.exit_code == (0 if handled else 143), (done.reason, lines[-5:])
    assert time.monotonic() - released < 25
    assert "done at step 3000" not in lines
    wait_for(lambda: containers_of(Settings.load().home) == [], timeout=15, what="the container to be removed")
