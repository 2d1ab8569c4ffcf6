"""The warm pool with its default imports (torch, the runtime and MLflow's client): it forks with no thread of
its own (pyarrow's allocator thread is off in the pool), and a tracked job forked from it logs to MLflow as a
cold one does. (The executor contract suite runs the pool with a small import list, for speed.)"""

from __future__ import annotations

import subprocess
import sys

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.queue.models import JobSpec
from orchestrator.tracking.client import Tracker
from tests.orchestrator.helpers import started, wait_for

JOB = """from runtime.context import JobContext
import sys
with JobContext.from_env() as ctx:
    print("preloaded", "mlflow.tracking" in sys.modules)
    ctx.log_params({"lr": 0.5})
    ctx.log_metrics({"loss": 0.25}, step=3)
"""


def test_the_default_pool_preloads_mlflow_and_forks_with_no_thread_of_its_own(home, tmp_path, monkeypatch):
    from orchestrator.service.daemon import Service

    monkeypatch.delenv("AUTORESEARCH_WARM_PRELOAD", raising=False)
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")
    monkeypatch.setenv("AUTORESEARCH_WARM", "1")
    settings = Settings.load(devices="cpu:1")
    service = Service(settings, devices="cpu:1", preempt_after=0, tick=0.2).start()
    try:
        pool = service.executor.warm_pool
        assert pool.wait_ready(300)
        ready = pool._ready
        assert {"torch", "runtime", "mlflow", "pyarrow"} <= set(ready["modules"])
        # The threads a fresh interpreter has once numpy is loaded (BLAS's, fork-safe), and not one more.
        plain = subprocess.run([sys.executable, "-c", "import numpy, os; print(len(os.listdir('/proc/self/task')))"],
                               capture_output=True, text=True, check=True)
        assert "jemalloc_bg_thd" not in ready["threads"]
        assert len(ready["threads"]) == int(plain.stdout), ready["threads"]

        script = tmp_path / "job.py"
        script.write_text(JOB)
        job_id = api.submit(JobSpec(argv=[sys.executable, str(script)]))[0].id
        wait_for(lambda: service.store.get(job_id).final, timeout=240, what="the warm job")
        job = service.store.get(job_id)
        log = open(job.log_path).read()
        assert job.state == "SUCCEEDED", log
        assert "preloaded True" in log
        assert started(service.store, job_id)[0].endswith(", warm")
        tracker = Tracker(settings.tracking_uri, settings.artifacts_dir)
        assert tracker.history(job.mlflow_run_id, "loss") == [(3, 0.25)]
        assert tracker.params(job.mlflow_run_id)["lr"] == "0.5"
    finally:
        service.stop()
