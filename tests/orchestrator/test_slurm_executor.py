"""The Slurm executor on a real one-host Slurm cluster (`.ci/slurm-setup.sh`): what Slurm itself does to a job
(requeue, a drained node), a service killed with -9, an attempt the service never recorded, a pending Slurm
job cancelled, and the start-up checks. The executor contract suite (test_executor_contract.py) runs on Slurm
too; this file holds what only Slurm has. Without a cluster these tests skip with the reason (fail under CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.executors.slurm import jobs as sj
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import ckpt_job, wait_for
from tests.support import slurm as cluster

pytestmark = pytest.mark.usefixtures("slurm_exclusive")  # the shared cluster, one test at a time

FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")


@pytest.fixture(scope="module")
def node():
    return cluster.slurm_node()


@pytest.fixture
def service(home, node, monkeypatch):
    """service(devices="cpu:2"): an in-process service on Slurm, on this test's home."""
    from orchestrator.service.daemon import Service

    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")
    started = []

    def start(devices="cpu:2"):
        svc = Service(Settings.load(devices=devices, executor="slurm"), preempt_after=0, tick=0.2).start()
        started.append(svc)
        return svc

    yield start
    cluster.stop_services(started)


def log_of(svc, job_id) -> str:
    path = svc.store.get(job_id).log_path
    return Path(path).read_text(errors="replace") if path and os.path.exists(path) else ""


def slurm_id(svc, job_id) -> str:
    return sj.parse_handle(svc.store.get(job_id).proc_start) or ""


def slurm_state(sid: str) -> str:
    row = sj.queue([sid]).get(sid)
    return f"{row.state}|{row.reason}" if row else ""


def gate_job(gate: Path, word: str = "up") -> JobSpec:
    """A job that prints `word` (split in its command line, so only its output has it whole), then waits for
    the test to create `gate`."""
    half = len(word) // 2
    return JobSpec(argv=["sh", "-c", f"printf '{word[:half]}%s\\n' {word[half:]}; "
                                     f"while [ ! -e {gate} ]; do sleep 0.05; done; echo finished"], track=False)


def test_slurm_requeue_of_a_running_job_gives_it_a_new_attempt_from_its_checkpoint(service):
    svc = service("cpu:1")
    job_id = api.submit(ckpt_job(2000))[0].id
    wait_for(lambda: "starts at step 0" in log_of(svc, job_id), timeout=60, what="the job to start")
    sid = slurm_id(svc, job_id)
    assert svc.store.record(job_id)["cluster_job"] == f"slurm:{sid}"  # what `show` prints
    cluster.scontrol("requeue", sid)  # Slurm kills it (SIGTERM first) and would run it again later
    wait_for(lambda: "attempt 2 starts" in log_of(svc, job_id), timeout=60, what="our second attempt")
    job = svc.store.get(job_id)
    assert job.state == "RUNNING" and job.failures == 0
    reasons = [e.reason for e in svc.store.events(job_id) if e.dst == "QUEUED"]
    assert any(f"slurm requeued job {sid}" in r for r in reasons), reasons
    text = log_of(svc, job_id)
    assert "checkpointed at step" in text.split("attempt 2 starts")[0]
    assert int(text.split("attempt 2 starts at step ")[1].split()[0]) > 0  # resumed, not from scratch
    assert slurm_id(svc, job_id) != sid  # a new Slurm job; the requeued one is cancelled, never run twice
    wait_for(lambda: slurm_state(sid).startswith("CANCELLED"), timeout=30, what="the requeued Slurm job to end")
    api.cancel(job_id)
    wait_for(lambda: svc.store.get(job_id).state == "CANCELLED", timeout=30)


def test_drained_node_lets_a_running_job_finish_and_a_pending_job_can_be_cancelled(service, node, tmp_path):
    svc = service("cpu:3")
    gate = tmp_path / "gate"
    running = api.submit(gate_job(gate))[0].id
    wait_for(lambda: "up" in log_of(svc, running).split("\n", 1)[-1], timeout=60, what="the job to start")
    try:
        cluster.scontrol("update", f"nodename={node}", "state=drain", "reason=autoresearch-test")
        wait_for(lambda: cluster.node_state(node).startswith(("drain", "drng")), timeout=30, what="the drain")
        pending = api.submit(gate_job(gate))[0].id
        waiting = api.submit(JobSpec(argv=["sh", "-c", "echo later"], track=False))[0].id
        # Our queue gave both a slot; Slurm holds them while the node drains.
        wait_for(lambda: slurm_state(slurm_id(svc, pending)).startswith("PENDING")
                 and slurm_state(slurm_id(svc, waiting)).startswith("PENDING"), timeout=30, what="Slurm to hold them")
        pending_sid = slurm_id(svc, pending)
        assert api.cancel(pending).state == "CANCELLING"
        wait_for(lambda: svc.store.get(pending).state == "CANCELLED", timeout=30, what="the pending job's cancel")
        assert slurm_state(pending_sid).startswith("CANCELLED")
        gate.touch()
        wait_for(lambda: svc.store.get(running).state == "SUCCEEDED", timeout=30, what="the drained node's job")
        assert "finished" in log_of(svc, running)
        assert slurm_state(slurm_id(svc, waiting)).startswith("PENDING")  # still held: the node is drained
    finally:
        cluster.resume(node)
    wait_for(lambda: svc.store.get(waiting).state == "SUCCEEDED", timeout=60, what="the held job after resume")
    assert "later" in log_of(svc, waiting)


def test_a_node_that_goes_down_under_a_job_puts_it_back_in_line(service, node):
    """A failed node (set DOWN): Slurm kills and requeues its jobs; ours goes back in our line with the reason,
    without spending an attempt, and runs again once the node is back."""
    svc = service("cpu:1")
    job_id = api.submit(ckpt_job(100))[0].id
    wait_for(lambda: "starts at step 0" in log_of(svc, job_id), timeout=60, what="the job to start")
    sid = slurm_id(svc, job_id)
    try:
        cluster.scontrol("update", f"nodename={node}", "state=down", "reason=autoresearch-test")
        wait_for(lambda: any(e.dst == "QUEUED" and sid in e.reason for e in svc.store.events(job_id)),
                 timeout=60, what="the job back in our line")
    finally:
        cluster.resume(node)
    wait_for(lambda: svc.store.get(job_id).state == "SUCCEEDED", timeout=90, what="the job after the node is back")
    job = svc.store.get(job_id)
    assert job.attempts == 2 and job.failures == 0
    assert int(log_of(svc, job_id).split("attempt 2 starts at step ")[1].split()[0]) > 0  # from its checkpoint


def serve(home: Path) -> subprocess.Popen:
    env = dict(os.environ, AUTORESEARCH_HOME=str(home), AUTORESEARCH_PREFLIGHT="off",
               PYTHONPATH=os.environ.get("PYTHONPATH", str(Path(__file__).resolve().parents[2])))
    return subprocess.Popen([sys.executable, "-m", "orchestrator.faces.fastcli", "serve", "--executor", "slurm",
                             "--devices", "cpu:2", "--preempt-after", "0"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_kill_9_of_the_service_and_adoption(home, node, tmp_path):
    from orchestrator.queue.store import JobStore

    store = JobStore(f"sqlite:///{home / 'queue.db'}")
    gate, short_gate = tmp_path / "gate", tmp_path / "short-gate"
    first = serve(home)
    try:
        long_id = api.submit(gate_job(gate, "waiting"))[0].id
        short = JobSpec(argv=["sh", "-c", f"printf 'q7z%s\\n' x4k; while [ ! -e {short_gate} ]; do sleep 0.05; "
                                          "done; exit 4"], track=False)
        short_id = api.submit(short)[0].id

        def output(job_id):
            path = store.get(job_id).log_path
            return Path(path).read_text().split("\n", 1)[-1] if path and os.path.exists(path) else ""

        wait_for(lambda: "waiting" in output(long_id) and "q7zx4k" in output(short_id), timeout=90,
                 what="both jobs to start")
        first.kill()  # SIGKILL: no clean stop, nothing recorded on the way out
        first.wait()
        short_gate.touch()  # it ends while no service runs; Slurm and its exit file keep the code
        short_sid = sj.parse_handle(store.get(short_id).proc_start)
        wait_for(lambda: (sj.queue([short_sid]).get(short_sid) or sj.Row("", 0, "COMPLETED", "", "")).terminal,
                 timeout=30, what="the short job to end in Slurm")
        assert store.get(short_id).state == "RUNNING"
        second = serve(home)
        try:
            wait_for(lambda: store.get(short_id).state == "FAILED", timeout=60, what="the ended job's record")
            assert store.get(short_id).exit_code == 4
            assert store.get(long_id).state == "RUNNING"
            gate.touch()
            wait_for(lambda: store.get(long_id).state == "SUCCEEDED", timeout=60, what="the adopted job")
            job = store.get(long_id)
            assert job.attempts == 1 and output(long_id).count("finished") == 1
        finally:
            second.terminate()
            second.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
        cluster.cancel_jobs(store)


def test_an_attempt_never_recorded_is_found_by_its_name(service, home):
    """The service died between sbatch and recording the Slurm job id: the next one finds it by its name."""
    from orchestrator.executors.base import job_env
    from orchestrator.executors.slurm.executor import SlurmExecutor
    from orchestrator.core.layout import Layout
    from orchestrator.queue.store import JobStore
    from orchestrator.core.layout import node_name

    settings = Settings.load(devices="cpu:2", executor="slurm")
    store = JobStore.from_settings(settings)
    job = store.submit(JobSpec(argv=["sh", "-c", "sleep 1; echo unrecorded"], track=False))
    store.claim([(job.id, ["cpu:0"])], node_name(home))  # STARTING on this host, as the dead service left it
    job = store.get(job.id)
    executor = SlurmExecutor(settings, Layout(home), lambda _exit: None)
    try:
        executor.launch(job, job_env(job, base=dict(os.environ), layout=Layout(home),
                                     tracking_uri=settings.tracking_uri))
    finally:
        executor.close()
    assert store.get(job.id).pid is None and store.get(job.id).state == "STARTING"  # nobody recorded it
    svc = service("cpu:2")
    wait_for(lambda: svc.store.get(job.id).state == "SUCCEEDED", timeout=60, what="the found attempt to finish")
    found = svc.store.get(job.id)
    assert found.attempts == 1 and (found.proc_start or "").startswith("slurm:")
    assert "unrecorded" in Path(found.log_path or Layout(home).log_path(job.id)).read_text()


def test_a_partition_whose_gpus_change_is_seen_without_a_restart(service, node):
    """--devices auto: the slots are the partition's GPUs, read again while the service runs; a job of the
    grown partition's size then runs, and a shrunk partition's slots go."""
    def slots(svc):
        return [d.name for d in svc.store.hosts.devices(svc.host)]

    try:
        cluster.scontrol("update", f"nodename={node}", "gres=gpu:2")  # count-only gres: no device files needed
        svc = service("auto")
        svc.executor.inventory_every = 0.2
        assert slots(svc) == ["slurm:0", "slurm:1"]
        cluster.scontrol("update", f"nodename={node}", "gres=gpu:3")
        wait_for(lambda: slots(svc) == ["slurm:0", "slurm:1", "slurm:2"], timeout=30, what="the grown partition")
        job_id = api.submit(JobSpec(argv=["sh", "-c", "echo three"], gpus=3, max_attempts=1, track=False))[0].id
        wait_for(lambda: svc.store.get(job_id).state in FINISHED, timeout=60, what="the three-GPU job")
        assert svc.store.get(job_id).state == "SUCCEEDED", svc.store.get(job_id).reason
        cluster.scontrol("update", f"nodename={node}", "gres=gpu:1")
        wait_for(lambda: slots(svc) == ["slurm:0"], timeout=30, what="the shrunk partition")
        wait_for(lambda: [r.devices for r in svc.store.hosts.services()] == [["slurm:0"]], timeout=30,
                 what="the heartbeat's devices")  # what `gpus` and a submit's capacity check read
    finally:
        cluster.scontrol("update", f"nodename={node}", "gres=")  # no GPUs again, as the other tests expect


def test_an_account_slurmdbd_knows_runs_jobs_under_that_account(service, node, monkeypatch):
    from tests.support.requires import require

    require("Slurm accounting (slurmdbd)", cluster.accounting())
    monkeypatch.setenv("AUTORESEARCH_SLURM_PARTITION", "lab")
    monkeypatch.setenv("AUTORESEARCH_SLURM_ACCOUNT", "ml")
    svc = service("cpu:1")
    job_id = api.submit(JobSpec(argv=["sh", "-c", "echo ok"], max_attempts=1, track=False))[0].id
    wait_for(lambda: svc.store.get(job_id).state in FINISHED, timeout=60, what="the job")
    assert svc.store.get(job_id).state == "SUCCEEDED"
    fields = sj.show(slurm_id(svc, job_id))
    assert (fields.get("Account"), fields.get("Partition")) == ("ml", "lab")


def test_a_job_larger_than_a_node_is_refused_in_one_line(service):
    svc = service("cpu:6")  # six slots, but the node has 4 Slurm CPUs
    job_id = api.submit(JobSpec(argv=["true"], gpus=5, max_attempts=1, track=False))[0].id
    wait_for(lambda: svc.store.get(job_id).state in FINISHED, timeout=30, what="the refusal")
    job = svc.store.get(job_id)
    assert job.state == "FAILED" and "needs 5 CPUs on one node" in job.reason and "--nodes" in job.reason
    assert "\n" not in job.reason


@pytest.mark.parametrize("flags, words", [
    (["--partition", "nope"], "no partition 'nope'"),
    (["--partition", "lab", "--account", "nope"], "account nope"),
    (["--devices", "auto"], "has no GPUs"),
    (["--account", "ghost"], "account ghost"),  # an account slurmdbd does not know, on the default partition
    (["--account", "general", "--qos", "ghost"], "qos ghost"),
])
def test_bad_partition_account_or_devices_at_start(home, node, flags, words):
    if "ghost" in flags:
        from tests.support.requires import require

        require("Slurm accounting (slurmdbd)", cluster.accounting())
    env = dict(os.environ, AUTORESEARCH_HOME=str(home))
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.fastcli", "serve", "--executor", "slurm", *flags],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], out.stderr
