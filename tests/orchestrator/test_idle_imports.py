"""The service process stays small: after its warm-ups (a preflight of every device) and after running a
tracked job it has imported neither torch, MLflow nor Ray; the job's MLflow run was made by its tracking
worker, a child process that stops when it has had nothing to do for its idle time."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Its own interpreter: the test process has imported MLflow and torch for other tests.
SERVICE = """
import json, sys, threading, time
from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.service.health import HealthConfig
from orchestrator.queue.models import JobSpec
from orchestrator.service.daemon import Service

HEAVY = ("torch", "mlflow", "ray")
def heavy():
    return sorted({name.split(".")[0] for name in sys.modules} & set(HEAVY))
def wait(predicate, what):
    deadline = time.monotonic() + 90
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)

service = Service(Settings.load(), devices="cpu:2", tick=0.2, health=HealthConfig(preflight="quick")).start()
wait(lambda: not any(t.name == "warm-up" for t in threading.enumerate()), "the warm-up")
checked = [d.name for d in service.store.hosts.devices(service.host) if d.last_check]
after_warm_up = heavy()
job = api.submit(JobSpec(argv=["true"], params={"lr": 0.1}))[0]
wait(lambda: service.store.get(job.id).state == "SUCCEEDED", "the tracked job")
worker = service.tracking.pid
after_job = heavy()
service.tracking.idle_exit = 0.0  # the preparer stops an idle worker on its next look at the queue
wait(lambda: service.tracking.pid is None, "the idle worker to stop")
service.stop()
print(json.dumps({"checked": checked, "after_warm_up": after_warm_up, "after_job": after_job, "worker": worker,
                  "run": service.store.get(job.id).mlflow_run_id}))
"""


def test_the_service_imports_no_torch_mlflow_or_ray_and_makes_runs_in_its_tracking_worker(home):
    proc = subprocess.run([sys.executable, "-c", SERVICE], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["checked"] == ["cpu:0", "cpu:1"]  # the warm-up's preflight ran on every device
    assert seen["after_warm_up"] == [] and seen["after_job"] == []
    assert seen["worker"]  # the run came from the worker, which was alive then

    # MLflow's own tables, read without importing MLflow here (seconds in a process that has not yet)
    with sqlite3.connect(home / "mlflow.db") as db:
        tags = dict(db.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (seen["run"],)))
        params = dict(db.execute("SELECT key, value FROM params WHERE run_uuid = ?", (seen["run"],)))
    assert tags["autoresearch.job_id"] == "1" and params == {"lr": "0.1"}
