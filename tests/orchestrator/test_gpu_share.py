"""Asking for a share of one GPU: the one parser behind `--gpus 0.25` and `--gpu-memory`, what a job's process
sees, and the requeue to run alone after running out of GPU memory beside other jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.api import jobs as api
from orchestrator.core.errors import BadInput
from orchestrator.core.gpushare import format_gpus, parse_gpus, parse_size
from orchestrator.queue.models import JobSpec
from runtime import protocol
from tests.orchestrator.helpers import wait_for


@pytest.mark.parametrize("text, expected", [
    ("1", (1, None)), ("4", (4, None)), ("2.0", (2, None)), ("0.5", (1, 0.5)), ("0.25", (1, 0.25)),
    ("0.33", (1, 1 / 3)), ("0.333", (1, 1 / 3)), ("0.0625", (1, 1 / 16)), (0.125, (1, 0.125)),
])
def test_gpus_are_whole_devices_or_one_kth_of_one(text, expected):
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "0.3", "0.05", "1.5", "abc", "nan", "inf", ""])
def test_other_gpu_requests_are_one_line_errors(text):
    with pytest.raises(BadInput) as err:
        parse_gpus(text)
    assert "\n" not in str(err.value) and "--gpus" in str(err.value)


def test_sizes():
    assert parse_size("10GiB") == 10 * 2**30
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("8GB") == 8 * 10**9 and parse_size("1.5g") == 1_500_000_000 and parse_size("4096") == 4096
    for bad in ("10XB", "-1GiB", "0", "GiB", ""):
        with pytest.raises(BadInput):
            parse_size(bad)
    assert format_gpus(1, 0.25) == "0.25" and format_gpus(1, 1 / 3) == "0.333" and format_gpus(2, None) == "2"


def test_a_jobspec_keeps_a_share_with_one_device():
    spec = JobSpec(argv=["true"], gpus=0.25, gpu_memory=2**30)
    assert (spec.gpus, spec.gpu_share, spec.gpu_memory) == (1, 0.25, 2**30)
    assert JobSpec(argv=["true"], gpus=1, gpu_share=0.5).gpu_share == 0.5
    with pytest.raises(BadInput, match="--gpu-memory goes with a share"):
        JobSpec(argv=["true"], gpus=1, gpu_memory=2**30)
    with pytest.raises(BadInput, match="gpus 1"):
        JobSpec(argv=["true"], gpus=2, gpu_share=0.5)


def test_submit_prints_the_share_in_json_and_show_agrees(home):
    exe = os.path.join(os.path.dirname(sys.executable), "autoresearch")
    out = subprocess.run([exe, "submit", "--gpus", "0.25", "--gpu-memory", "10GiB", "--json", "--", "true"],
                         capture_output=True, text=True, check=True)
    job = json.loads(out.stdout)
    assert job["gpus"] == 0.25 and job["gpu_memory"] == 10 * 2**30
    shown = json.loads(subprocess.run([exe, "show", str(job["id"]), "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    assert shown["gpus"] == 0.25
    bad = subprocess.run([exe, "submit", "--gpus", "0.3", "--", "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "1/k" in bad.stderr
    listed = json.loads(subprocess.run([exe, "queue", "--json"], capture_output=True, text=True).stdout)
    assert [(j["id"], j["gpus"], j["gpu_memory"]) for j in listed] == [(job["id"], 0.25, 10 * 2**30)]


DUMP = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))"


def test_a_sharing_job_sees_its_share_and_memory_limit_and_a_whole_job_sees_none(make_service, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv(protocol.GPU_SHARE, "0.5")  # a service started inside a sharing job: never inherited
    service = make_service("cpu:1")
    seen = {}
    for name, spec in (("shared", dict(gpus=0.25, gpu_memory=3 * 2**30)), ("whole", dict(gpus=1))):
        out = tmp_path / f"{name}.json"
        job_id = api.submit(JobSpec(argv=[sys.executable, "-c", DUMP, str(out)], track=False, **spec))[0].id
        wait_for(lambda: service.store.get(job_id).state in ("SUCCEEDED", "FAILED"), timeout=60, what=name)
        seen[name] = json.loads(out.read_text())
    assert seen["shared"][protocol.GPU_SHARE] == "0.25"
    assert seen["shared"][protocol.GPU_MEMORY] == str(3 * 2**30)
    assert protocol.GPU_SHARE not in seen["whole"] and protocol.GPU_MEMORY not in seen["whole"]


OOM_JOB = """
import json, os, sys, time
from runtime import protocol
d = os.environ[protocol.CHECKPOINT_DIR]
attempt = int(os.environ[protocol.ATTEMPT])
open(os.path.join(d, "attempts.txt"), "a").write(f"{attempt} {os.environ.get(protocol.GPU_SHARE, 'whole')}\\n")
if os.environ.get(protocol.GPU_SHARE):
    json.dump({"attempt": attempt, "at": time.time(), "error": "CUDA out of memory"},
              open(os.path.join(d, protocol.OOM_FILE), "w"))
    sys.exit(protocol.EX_TEMPFAIL)
"""


def test_a_shared_job_out_of_gpu_memory_runs_again_alone_without_spending_an_attempt(make_service):
    service = make_service("cpu:1")
    job_id = api.submit(JobSpec(argv=[sys.executable, "-c", OOM_JOB], gpus=0.5, max_attempts=1, track=False))[0].id
    wait_for(lambda: service.store.get(job_id).state in ("SUCCEEDED", "FAILED"), timeout=60, what="the job")
    job = service.store.get(job_id)
    assert job.state == "SUCCEEDED" and job.failures == 0 and job.attempts == 2
    assert job.gpu_share is None and job.gpu_memory is None  # it now asks for a whole device
    lines = open(os.path.join(job.checkpoint_dir, "attempts.txt")).read().split()
    assert lines == ["1", "0.5", "2", "whole"]
    requeue = [e for e in service.store.events(job_id) if e.dst == "QUEUED" and e.src == "RUNNING"]
    assert len(requeue) == 1 and requeue[0].reason.startswith("out of GPU memory on a shared GPU")
    assert "alone" in requeue[0].reason


def test_a_whole_gpu_job_out_of_memory_fails_as_any_job_does(make_service):
    """The marker matters only for a job that shares a GPU: alone already, a job on a whole GPU that runs out of
    memory has nothing more to be given, and fails (spending its attempt)."""
    service = make_service("cpu:1")
    script = OOM_JOB.replace("if os.environ.get(protocol.GPU_SHARE):", "if True:").replace(
        "sys.exit(protocol.EX_TEMPFAIL)", "sys.exit(1)")
    job_id = api.submit(JobSpec(argv=[sys.executable, "-c", script], gpus=1, max_attempts=1, track=False))[0].id
    wait_for(lambda: service.store.get(job_id).state == "FAILED", timeout=60, what="the job to fail")
    job = service.store.get(job_id)
    assert job.failures == 1 and job.attempts == 1 and "no attempts left" in job.reason


OOM_SCRIPT = '''
import os, sys
if os.environ.get("AUTORESEARCH_GPU_SHARE"):
    print("Traceback (most recent call last):", flush=True)
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
    sys.exit(1)
print("val_loss: 0.5", flush=True)
'''

OOM_TOML = '''
[experiment]
name = "oomer"
run = "python train.py {args}"
metric = "val_loss"
direction = "minimize"

[space]
lr = { type = "float", low = 1e-4, high = 1.0, log = true, default = 1e-3 }
'''


def test_a_config_file_script_out_of_gpu_memory_on_a_share_runs_again_alone(make_service, tmp_path):
    """A script that knows nothing of autoresearch: its wrapper reads torch's out-of-memory line, and the job is
    run again alone instead of failing (no attempt spent, one MLflow run, its metric found)."""
    from tests.support.own import folder

    service = make_service("cpu:1")
    root = folder(tmp_path, OOM_TOML, OOM_SCRIPT, name="oomer")
    spec = api.experiment_spec(str(root), {}, gpus=0.5, max_attempts=1)
    job_id = api.submit(spec)[0].id
    wait_for(lambda: service.store.get(job_id).state in ("SUCCEEDED", "FAILED"), timeout=90, what="the job")
    job = service.store.get(job_id)
    assert job.state == "SUCCEEDED" and job.failures == 0 and job.attempts == 2 and job.gpu_share is None
    log = open(job.log_path).read()
    assert "out of GPU memory on a shared GPU (share 0.5); asking to run alone" in log


def test_four_quarter_jobs_share_one_slot_a_fifth_waits_and_a_whole_job_preempts_all_four(make_service):
    """Four `--gpus 0.25` jobs run at once on one device while a fifth waits; a priority-50 job on the whole
    device preempts all four together; they go back in line, resume from their checkpoints and finish."""
    from tests.orchestrator.helpers import ckpt_job

    service = make_service("cpu:1", preempt_after=0.0)
    store = service.store
    quarters = [api.submit(ckpt_job(200 if i < 4 else 10, gpus=0.25, name=f"q{i}"))[0].id for i in range(5)]
    running = lambda: [j for j in quarters if store.get(j).state == "RUNNING"]  # noqa: E731
    wait_for(lambda: len(running()) == 4, timeout=60, what="four sharers running at once")
    assert {tuple(store.get(j).devices) for j in running()} == {("cpu:0",)}
    fifth = next(j for j in quarters if j not in running())
    assert store.get(fifth).state == "QUEUED"
    # Each has its SIGTERM handler (it prints its start after setting it): a preemption now checkpoints.
    started = lambda j: "attempt 1 starts at step 0" in open(store.get(j).log_path).read()  # noqa: E731
    wait_for(lambda: all(started(j) for j in running()), timeout=60, what="the four sharers' first steps")

    whole = api.submit(ckpt_job(20, priority=50, name="whole"))[0].id
    wait_for(lambda: store.get(whole).state == "SUCCEEDED", timeout=90, what="the whole-device job")
    preempted = [j for j in quarters if store.get(j).preemptions == 1]
    assert len(preempted) == 4, [store.get(j).reason for j in quarters]
    for j in preempted:  # all four yielded to the whole job together, each naming it
        reasons = [e.reason for e in store.events(j) if e.dst == "PREEMPTING"]
        assert len(reasons) == 1 and f"#{whole}" in reasons[0]
    wait_for(lambda: all(store.get(j).state == "SUCCEEDED" for j in quarters), timeout=120, what="all five")
    import re

    for j in preempted:  # each attempt 2 resumed where attempt 1 checkpointed
        log = open(store.get(j).log_path).read()
        saved = re.search(r"checkpointed at step (\d+)", log).group(1)
        assert re.search(r"attempt 2 starts at step (\d+)", log).group(1) == saved


def test_a_sharer_that_fails_leaves_its_neighbours_running(make_service):
    """Two halves of one device: one fails at once, the other is neither stopped nor preempted and finishes."""
    from tests.orchestrator.helpers import ckpt_job

    service = make_service("cpu:1")
    store = service.store
    steady = api.submit(ckpt_job(60, gpus=0.5, name="steady"))[0].id
    wait_for(lambda: store.get(steady).state == "RUNNING", timeout=60, what="the steady sharer")
    broken = api.submit(JobSpec(argv=[sys.executable, "-c", "import sys; sys.exit(3)"], gpus=0.5, track=False))[0].id
    wait_for(lambda: store.get(broken).state == "FAILED", timeout=60, what="the broken sharer to fail")
    assert store.get(broken).exit_code == 3 and store.get(steady).state == "RUNNING"
    assert store.get(broken).devices == store.get(steady).devices == ["cpu:0"]  # they shared the device
    wait_for(lambda: store.get(steady).state == "SUCCEEDED", timeout=60, what="the steady sharer")
    job = store.get(steady)
    assert job.attempts == 1 and job.preemptions == 0
    assert [e.dst for e in store.events(steady)] == ["QUEUED", "STARTING", "RUNNING", "SUCCEEDED"]


def test_more_gpu_memory_than_any_gpu_has_is_refused_at_submit(make_service):
    """Once the services have sampled their GPUs, a share asking for more memory than the largest has is a
    one-line error at submit (the policy would never place it); before that, nothing is known and it waits."""
    import time

    from orchestrator.queue.gpuuse import GpuUse, Sample

    service = make_service("cpu:1")
    spec = JobSpec(argv=["true"], gpus=0.5, gpu_memory=100 * 2**30, track=False)
    assert api.submit(spec)[0].state == "QUEUED"  # no GPU sampled: accepted
    GpuUse(service.store.db).record("gpu-host", {"0": Sample(at=time.time(), util=0.0, mem_total=80 * 2**30)}, {}, {})
    with pytest.raises(BadInput, match=r"^--gpu-memory 100.0GiB: no GPU here has that much \(the largest has 80.0GiB\)$"):
        api.submit(spec)
    assert api.submit(JobSpec(argv=["true"], gpus=0.5, gpu_memory=40 * 2**30, track=False))[0].state == "QUEUED"
