"""`submit --time-limit`: the service stops an attempt that runs past it (SIGTERM, SIGKILL after the grace) and
the job ends FAILED with its own reason, "time limit exceeded"; a job within its limit is untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.api import jobs as api
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_a_job_past_its_time_limit_is_stopped_and_fails_with_its_own_reason(make_service):
    service = make_service("cpu:2")
    polite = api.submit(JobSpec(argv=["sleep", "60"], time_limit=1.0, grace=5.0, max_attempts=3, track=False))[0]
    # Ignores SIGTERM: only the SIGKILL after its grace ends it.
    stubborn = api.submit(JobSpec(argv=["sh", "-c", "trap '' TERM; sleep 60"], time_limit=1.0, grace=1.0,
                                  track=False))[0]
    for job_id in (polite.id, stubborn.id):
        job = wait_for(lambda: (j := service.store.get(job_id)).state == "FAILED" and j, timeout=30,
                       what=f"job {job_id} stopped at its limit")
        assert job.reason.startswith("time limit exceeded") and job.finished_at - job.started_at < 15
        events = [(e.src, e.dst, e.reason) for e in service.store.events(job_id)]
        assert ("RUNNING", "CANCELLING", "time limit exceeded") in events
        assert job.attempts == 1  # a time-out is final: never retried, whatever --max-attempts says
    assert service.store.get(stubborn.id).exit_code in (-9, 137)
    within = api.submit(JobSpec(argv=["sleep", "0.2"], time_limit=30.0, track=False))[0]
    assert wait_for(lambda: service.store.get(within.id).state == "SUCCEEDED", what="a job within its limit")


def test_submit_time_limit_flag(home):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "orchestrator.faces.cli", "submit"]
    bad = subprocess.run([*cli, "--time-limit", "soon", "--", "true"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 2 and "--time-limit" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    good = subprocess.run([*cli, "--time-limit", "1.5m", "--json", "--", "true"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert good.returncode == 0 and '"time_limit": 90.0' in good.stdout
    assert api.open_store().count() == 1  # the bad one changed nothing
