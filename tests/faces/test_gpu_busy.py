"""The GPU busy share in a running service (NVML faked at its edge): the sampler's figures reach `top`, `usage`
and the job's MLflow run."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.queue.gpuuse import MEMORY_USED_METRIC, GpuUse
from orchestrator.queue.models import JobSpec
from orchestrator.service.guard import DeviceGuard
from runtime.nvml import Nvml
from runtime.protocol import UTILIZATION_METRIC
from tests.orchestrator.helpers import wait_for
from tests.support.fake_nvml import FakeNvml

GiB = 2**30


def test_a_service_samples_its_gpus_and_every_face_shows_the_busy_share(make_service, monkeypatch, child_env):
    fake = FakeNvml(["GPU-aaaa", "GPU-bbbb"])
    fake.util.update({0: 70, 1: 70})
    fake.used.update({0: 30 * GiB, 1: 30 * GiB})
    # The service's one NVML session (the guard's, shared with the sampler) is the fake from the first call.
    monkeypatch.setattr(DeviceGuard, "_open_nvml", lambda self: Nvml(fake, timeout_s=2).open())
    monkeypatch.setenv("AUTORESEARCH_GPU_SAMPLE_INTERVAL", "0.2")
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")  # the GPU checks run in a child process: no fake there
    service = make_service("0,1")
    job = api.submit(JobSpec(argv=[sys.executable, "-c", "import time; time.sleep(60)"], name="trainer",
                             grace=1.0))[0]
    wait_for(lambda: service.store.get(job.id).state == "RUNNING", timeout=60, what="the job to run")
    device = service.store.get(job.id).devices[0]
    records = GpuUse(service.store.db)
    wait_for(lambda: (records.jobs([job.id]).get(job.id) or None) and records.jobs([job.id])[job.id].seconds > 0.5,
             timeout=30, what="the sampler to count the job's time")

    # top: the device's busy % and memory from the service's sample (no NVML in this process), and its job.
    from orchestrator.faces.views.snapshot import take
    from orchestrator.faces.views.top import render

    console = Console(file=io.StringIO(), width=80)
    console.print(render(take(Settings.load(), with_gpus=False)))
    lines = console.file.getvalue().splitlines()
    assert any(line.startswith(device) and f"#{job.id} trainer" in line and "70% 30/80G" in line for line in lines)
    assert max(map(len, lines)) <= 80

    fake.used[int(device)] = 50 * GiB  # a peak while it runs
    seen = service.gpuwatch.samples
    wait_for(lambda: service.gpuwatch.samples >= seen + 2, timeout=30, what="two more samples")
    api.cancel(job.id)
    wait_for(lambda: service.gpuwatch.logged >= 1, timeout=90, what="the figures on the job's MLflow run")

    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=Settings.load().tracking_uri).get_run(service.store.get(job.id).mlflow_run_id)
    assert run.data.metrics[UTILIZATION_METRIC] == pytest.approx(70.0)
    assert run.data.metrics[MEMORY_USED_METRIC] == pytest.approx(50 * GiB / 1e6, rel=1e-6)

    # usage: device-hours held and busy, and the share, from the same figures.
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "usage", "--json"], env=child_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    held = records.jobs([job.id])[job.id].held_seconds
    assert row["held_hours"] == pytest.approx(held / 3600, abs=1e-4) and row["held_hours"] > 0
    assert row["busy_hours"] == pytest.approx(0.7 * held / 3600, abs=1e-4)
    assert row["busy_share"] == pytest.approx(0.7, abs=1e-3)


def test_a_shared_gpu_row_shows_each_job_with_its_share_within_80_columns():
    from orchestrator.faces.views.snapshot import DeviceRow, Snapshot
    from orchestrator.faces.views.top import render
    from orchestrator.queue.models import Job, ServiceRecord

    now = 10_000.0

    def job(id, share=None, name="a-rather-long-trial-name"):
        return Job(id=id, name=name, argv=["true"], state="RUNNING", gpus=1, gpu_share=share, devices=["0"],
                   started_at=now - 90, submitted_at=now - 100, host="h")

    shared = [job(12, 0.25), job(13, 0.25), job(14, 0.5)]
    rows = [DeviceRow("h", "0", "available", "", shared[0], now - 1, 5, 97, 70 * GiB, 140 * GiB, jobs=shared),
            DeviceRow("h", "1", "available", "", job(15, 0.5, "alone"), now - 1, 5, 12, 3 * GiB, 140 * GiB),
            DeviceRow("h", "2", "available", "", job(16), now - 1, 5)]
    snap = Snapshot(at=now, home="/h", services=[ServiceRecord(host="h", pid=1, devices=["0", "1", "2"],
                                                               heartbeat_at=now)],
                    devices=rows, queue=[], victims={}, running=shared, events=[])
    console = Console(file=io.StringIO(), width=80, height=24)
    console.print(render(snap, height=24, live=True))
    lines = console.file.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    [gpu0] = [line for line in lines if line.startswith("0 ")]
    assert "#12 0.25 #13 0.25 #14 0.5" in gpu0 and "97% 70/140G" in gpu0
    [gpu1] = [line for line in lines if line.startswith("1 ")]
    assert "#15 0.5 alone" in gpu1 and "12% 3/140G" in gpu1
    [gpu2] = [line for line in lines if line.startswith("2 ")]
    assert "#16 a-rather" in gpu2  # a whole GPU: no share, and no sample yet: no figures
