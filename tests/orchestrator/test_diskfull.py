"""Full disks, for real: the home on a small tmpfs that a ballast file fills (real ENOSPC, no mock).

The disk preflight (retention first, then the wait with its reason, a banner, a notification, and the queue
resuming when space returns), the queue database refusing a write with nothing half-written, a checkpoint
save that hits ENOSPC leaving the previous checkpoint loadable, and a job whose writes fail never SUCCEEDED;
the same for the MLflow store alone on the small filesystem. Skipped with the reason where mounting is
impossible (not root); under CI=true that fails instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from orchestrator.core.config import Settings
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from tests.orchestrator.helpers import wait_for
from tests.support.requires import require

MB = 1024 * 1024


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MB tmpfs mounted for this test (unmounted after it)."""
    mnt = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        require("a small mounted filesystem", f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def home(small_fs, monkeypatch, mlflow_template):
    """This module's AUTORESEARCH_HOME: on the small filesystem (`make_service` then serves it)."""
    from tests.support.home import prepare_home

    return prepare_home(small_fs / "home", monkeypatch, mlflow_template)


def fill(directory: Path, leave: int) -> Path:
    """A ballast file that leaves about `leave` bytes free on the filesystem of `directory`."""
    ballast = directory / f"ballast-{uuid.uuid4().hex[:6]}"
    st = os.statvfs(directory)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    with open(ballast, "wb") as fh:
        chunk = b"\0" * MB
        while size > 0:
            try:
                size -= fh.write(chunk[:min(size, MB)])
            except OSError:
                break
    return ballast


def test_preflight_runs_retention_then_waits_with_the_reason_and_resumes(home, make_service, tmp_path,
                                                                        monkeypatch):
    got = tmp_path / "notified.jsonl"
    (home / "config.toml").write_text(
        f'disk_min_free_mb = 4\n\n[[notify]]\ncommand = "cat >> {got}; echo >> {got}"\nevents = ["disk.low"]\n')
    monkeypatch.setenv("AUTORESEARCH_GC_EVERY", "0")  # retention here runs only because the disk is short
    service = make_service(devices="cpu:1")
    store = service.store
    # A finished job that keeps nothing, with a 3 MB checkpoint: retention frees it before any wait.
    old = store.submit(JobSpec(argv=[sys.executable, "-c", "import os; open(os.environ['AUTORESEARCH_CHECKPOINT_DIR']"
                                     "+'/w','wb').write(b'x'*3*1024*1024)"], keep_checkpoint="none", track=False))
    wait_for(lambda: store.get(old.id).state == "SUCCEEDED", what="the first job")
    wait_for(lambda: store.get(old.id).checkpoint_gc is None and Path(store.get(old.id).checkpoint_dir).exists())
    ballast = fill(home, 2 * MB)  # below 4 MB free, but 5 MB once the old checkpoint goes
    first = store.submit(JobSpec(argv=["true"], track=False))
    wait_for(lambda: store.get(first.id).state == "SUCCEEDED", timeout=60, what="retention to make room")
    assert store.get(old.id).checkpoint_gc == "removed"
    assert not got.exists() or not got.read_text().strip()  # retention sufficed: no wait was declared

    more = fill(home, 2 * MB)  # now nothing is left to collect
    waiting = store.submit(JobSpec(argv=["true"], track=False))
    wait_for(lambda: "low disk space" in store.get(waiting.id).reason, timeout=30, what="the reason")
    assert store.get(waiting.id).state == "QUEUED" and store.get(waiting.id).attempts == 0
    record = wait_for(lambda: [s for s in store.hosts.services() if s.disk], what="the service record's disk line")[0]
    assert "MB free on" in record.disk
    from orchestrator.faces.views.snapshot import take
    from orchestrator.faces.views.top import banners

    assert "low disk space" in banners(take(Settings.load(), with_gpus=False))[0].plain
    note = wait_for(lambda: got.exists() and got.read_text().strip() and json.loads(got.read_text().split("\n")[0]),
                    what="the disk.low notification")
    assert note["event"] == "disk.low" and note["free_bytes"] < 4 * MB

    ballast.unlink()
    more.unlink()  # space returns: the queue goes on, no restart
    wait_for(lambda: store.get(waiting.id).state == "SUCCEEDED", timeout=60, what="the queue to resume")
    wait_for(lambda: not [s for s in store.hosts.services() if s.disk], what="the banner to clear")


def test_a_full_disk_refuses_writes_whole_and_the_service_stays_up(home, make_service, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTORESEARCH_DISK_MIN_FREE_MB", "0")  # no preflight: the writes themselves fail
    service = make_service(devices="cpu:1")
    store = service.store
    ok = store.submit(JobSpec(argv=["true"], track=False))
    wait_for(lambda: store.get(ok.id).state == "SUCCEEDED", what="a job before the disk fills")
    before = store.count()
    # A job that writes its output and a checkpoint file once the disk is full (told by a file outside the small
    # filesystem), then would succeed: its writes fail on the full disk.
    go = tmp_path / "disk-is-full"
    writer = store.submit(JobSpec(argv=[sys.executable, "-c",
                                        f"import os,time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
                                        "open(os.environ['AUTORESEARCH_CHECKPOINT_DIR']+'/w','wb').write(b'x'*4*2**20)"],
                                  track=False))
    wait_for(lambda: store.get(writer.id).state == "RUNNING", what="the writer to start")
    pid = store.get(writer.id).pid
    ballast = fill(home, 0)
    with pytest.raises(Exception) as refused:  # a submit on the full disk fails whole
        for _ in range(200):  # the WAL may have a little room left: keep writing until it has none
            store.submit(JobSpec(argv=["echo", "x" * 4000], track=False))
    assert "full" in str(refused.value).lower()
    go.touch()
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
             timeout=60, what="the writer's process to end")
    assert service._dispatcher.is_alive()
    ballast.unlink()
    # The service could not record the end while the disk was full; it does now, as the job earned it.
    wait_for(lambda: store.get(writer.id).final, timeout=60, what="the writer's end recorded")
    assert store.get(writer.id).state == "FAILED"  # never SUCCEEDED with its checkpoint unwritten
    # Nothing half-written: every row is whole, and the queue resumes without a restart.
    fresh = JobStore(Settings.load().db_url)
    assert all(j.argv and j.state for j in fresh.list())
    late = store.submit(JobSpec(argv=["true"], track=False))
    wait_for(lambda: store.get(late.id).state == "SUCCEEDED", timeout=60, what="the queue after space returned")
    assert fresh.count() >= before + 1


def test_a_checkpoint_save_hitting_enospc_keeps_the_previous_loadable(small_fs):
    torch = pytest.importorskip("torch")
    from runtime.checkpoint.manager import CheckpointManager, TrainState
    from runtime.errors import CheckpointError

    def state():
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        return TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.1))

    directory = small_fs / "ck"
    first = state()
    mgr = CheckpointManager(directory, keep_last=1, interval_steps=1)
    mgr.save_now(1, first)
    mgr.wait()
    ballast = fill(small_fs, 64 * 1024)
    with torch.no_grad():
        first.model.weight.add_(1.0)
    with pytest.raises(CheckpointError) as failed:
        mgr.save_now(2, first)
        mgr.wait()
    assert "No space left on device" in str(failed.value)
    assert not mgr.path_for(2).exists()  # the torn save is gone: its space is free again
    ballast.unlink()
    fresh = state()
    assert CheckpointManager(directory).load_latest(fresh) == 1
    assert torch.equal(fresh.model.weight, state().model.weight)  # step 1's weights, not step 2's


METRIC_JOB = '''import os, sys, time
from runtime.context import JobContext

with JobContext.from_env() as ctx:
    ctx.log_metrics({"train_loss": 1.0}, step=1)
    while not os.path.exists(sys.argv[1]):  # the test fills the store's disk meanwhile
        time.sleep(0.05)
    ctx.log_metrics({"val_loss": 0.25}, step=2)
print("logged", flush=True)
'''


@pytest.mark.slow  # two attempts of a job importing MLflow, and a tracking worker
def test_a_full_mlflow_disk_loses_no_result_says_why_and_recovers(small_fs, tmp_path, monkeypatch, mlflow_template,
                                                                  caplog):
    """The MLflow store alone on the small filesystem (the queue and the home elsewhere): runs cannot be made
    while it is full, so tracked jobs wait with the reason and no attempt spent while untracked ones run; a job
    whose metric write failed is not SUCCEEDED and runs again; when space returns every result is in MLflow."""
    import logging
    import shutil

    from mlflow import MlflowClient

    from orchestrator.service.daemon import Service
    from tests.orchestrator.helpers import kill_leftovers
    from tests.support.home import prepare_home

    prepare_home(tmp_path / "home", monkeypatch, mlflow_template)
    (small_fs / "mlflow").mkdir()
    shutil.copy(mlflow_template, small_fs / "mlflow" / "mlflow.db")
    uri = f"sqlite:///{small_fs / 'mlflow' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("AUTORESEARCH_RETRY_BACKOFF", "2")
    script = tmp_path / "metric_job.py"
    script.write_text(METRIC_JOB)
    go = tmp_path / "go"
    caplog.set_level(logging.WARNING, logger="orchestrator.tracking.preparer")
    service = Service(Settings.load(), devices="cpu:2", preempt_after=0.0, tick=0.2).start()
    store = service.store
    client = MlflowClient(uri)
    ballast = None
    try:
        writer = store.submit(JobSpec(argv=[sys.executable, str(script), str(go)], max_attempts=5, name="writer"))
        wait_for(lambda: store.get(writer.id).mlflow_run_id and "train_loss" in client.get_run(
            store.get(writer.id).mlflow_run_id).data.metrics, timeout=90, what="a metric logged before")
        ballast = fill(small_fs, 0)
        go.write_text("")  # the writer logs its metric now, onto the full disk
        wait_for(lambda: store.get(writer.id).failures >= 1, timeout=90, what="the writer's failed write")
        assert store.get(writer.id).state != "SUCCEEDED"
        assert "full" in open(store.get(writer.id).log_path).read().lower()  # its log says why
        # While the store is full: a tracked job waits for its run, with the reason; an untracked one runs.
        waiting = store.submit(JobSpec(argv=["true"], name="waiting"))
        plain = store.submit(JobSpec(argv=["true"], track=False, name="plain"))
        wait_for(lambda: "MLflow tracking store not usable" in (store.get(waiting.id).reason or ""), timeout=60,
                 what="the waiting reason")
        job = store.get(waiting.id)
        assert "full" in job.reason.lower() and job.state == "QUEUED" and job.attempts == 0
        wait_for(lambda: store.get(plain.id).state == "SUCCEEDED", timeout=60, what="an untracked job meanwhile")
        assert any("not usable" in r.getMessage() and "full" in r.getMessage().lower() for r in caplog.records)
        assert service._dispatcher.is_alive()

        ballast.unlink()
        ballast = None  # space returns: no restart
        for j in (writer, waiting):
            wait_for(lambda: store.get(j.id).state == "SUCCEEDED", timeout=120, what=f"{j.name} to succeed")
        wait_for(lambda: all(client.get_run(store.get(j.id).mlflow_run_id).info.status == "FINISHED"
                             for j in (writer, waiting)), timeout=60, what="every run ended")
        # What was logged before the disk filled is still there, and what failed on it was logged again.
        assert client.get_run(store.get(writer.id).mlflow_run_id).data.metrics == {"train_loss": 1.0,
                                                                                   "val_loss": 0.25}
    finally:
        if ballast is not None:
            ballast.unlink()
        kill_leftovers(store)
        service.stop()


def test_a_service_started_on_a_full_disk_comes_up_once_space_returns(home, make_service, monkeypatch):
    import threading

    from orchestrator.service.daemon import Service

    monkeypatch.setenv("AUTORESEARCH_DISK_MIN_FREE_MB", "0")  # no preflight: the writes themselves fail
    first = make_service(devices="cpu:1")
    store = first.store
    done = store.submit(JobSpec(argv=["true"], track=False))
    wait_for(lambda: store.get(done.id).state == "SUCCEEDED", what="a job before the disk fills")
    first.stop()
    ballast = fill(home, 0)
    with pytest.raises(Exception):  # the WAL may have a little room left: write until it has none
        for _ in range(200):
            store.submit(JobSpec(argv=["echo", "x" * 4000], track=False))
    service = Service(Settings.load(), devices="cpu:1", preempt_after=0.0, tick=0.2)
    failed: list[BaseException] = []

    def start() -> None:
        try:
            service.start()
        except BaseException as exc:  # reported by the test below
            failed.append(exc)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    wait_for(lambda: service.disk.full_error or failed, timeout=30, what="the start meeting the full disk")
    assert not failed, failed
    assert starter.is_alive()  # waiting for space, not gone
    ballast.unlink()
    starter.join(timeout=60)
    assert not starter.is_alive() and not failed, failed
    try:
        late = store.submit(JobSpec(argv=["true"], track=False))
        wait_for(lambda: store.get(late.id).state == "SUCCEEDED", timeout=60, what="a job once space returned")
    finally:
        service.stop()


def test_a_service_stopped_on_a_full_disk_says_so_in_one_line_and_the_next_one_goes_on(home, make_service,
                                                                                     monkeypatch, caplog):
    monkeypatch.setenv("AUTORESEARCH_DISK_MIN_FREE_MB", "0")  # no preflight: the writes themselves fail
    service = make_service(devices="cpu:1")
    store = service.store
    done = store.submit(JobSpec(argv=["true"], track=False))
    wait_for(lambda: store.get(done.id).state == "SUCCEEDED", what="a job before the disk fills")
    ballast = fill(home, 0)
    with pytest.raises(Exception):  # the WAL may have a little room left: write until it has none
        for _ in range(200):
            store.submit(JobSpec(argv=["echo", "x" * 4000], track=False))
    caplog.clear()
    with caplog.at_level("WARNING", logger="orchestrator"):
        service.stop()  # its service record cannot be removed: the disk is full
    said = [r for r in caplog.records if r.name.startswith("orchestrator")]
    assert any("the disk is full" in r.getMessage() for r in said), [r.getMessage() for r in said]
    assert not [r for r in said if r.exc_info], "a full disk is one line, not a traceback"
    ballast.unlink()
    again = make_service(devices="cpu:1")
    late = again.store.submit(JobSpec(argv=["true"], track=False))
    wait_for(lambda: again.store.get(late.id).state == "SUCCEEDED", timeout=60, what="the next service's job")
