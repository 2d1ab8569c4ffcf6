"""A real `mlflow server` with a PostgreSQL backend store on loopback: MLFLOW_TRACKING_URI=http://... flows
through the queue to jobs (their metrics land on the server) and to an agent session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from orchestrator.core.config import Settings
from orchestrator.queue.models import JobSpec
from tests.conftest import PG_DSN, pg_connect
from tests.orchestrator.helpers import wait_for


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def pg_database():
    """A fresh PostgreSQL database of its own for MLflow's schema (MLflow migrates the whole database)."""
    from sqlalchemy.engine import make_url

    url = make_url(PG_DSN)
    admin = pg_connect()  # skips, or fails under CI, where no server answers
    name = f"mlflow_t_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    yield url.set(drivername="postgresql+psycopg2", database=name).render_as_string(hide_password=False)
    with admin.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.close()


@pytest.fixture
def mlflow_server(pg_database, tmp_path):
    """`mlflow server` on a free loopback port with the PostgreSQL backend store; yields its URL."""
    port = _free_port()
    exe = Path(sys.executable).with_name("mlflow")
    log = open(tmp_path / "mlflow-server.log", "wb")
    proc = subprocess.Popen([str(exe), "server", "--backend-store-uri", pg_database, "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1",
                             "--artifacts-destination", str(tmp_path / "server-artifacts")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        if proc.poll() is not None:
            raise RuntimeError((tmp_path / "mlflow-server.log").read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, timeout=90, interval=0.3, what="mlflow server")
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn/gunicorn workers
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        log.close()


def test_job_metrics_and_an_agent_session_land_on_the_mlflow_server(mlflow_server, home, monkeypatch):
    from mlflow.tracking import MlflowClient

    from orchestrator.api import jobs as api
    from orchestrator.service.daemon import Service

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")  # device checks are not what this test is about
    settings = Settings.load()
    assert settings.tracking_uri == mlflow_server
    service = Service(settings, devices="cpu:2", preempt_after=0, tick=0.2).start()
    try:
        code = ("import os\nfrom runtime.context import JobContext\n"
                "with JobContext.from_env() as ctx:\n"
                "    assert os.environ['MLFLOW_TRACKING_URI'].startswith('http://')\n"
                "    for step in range(3):\n"
                "        ctx.log_metrics({'loss': 1.0 / (step + 1)}, step=step)\n")
        job_id = api.submit(JobSpec(argv=[sys.executable, "-c", code], name="tracked"))[0].id

        # An agent session (Optuna TPE on the synthetic bowl) reads its trials' metrics from the same server;
        # it starts while the tracked job runs (they share the two slots).
        from orchestrator.agent import runner
        from orchestrator.agent.session import SessionConfig

        config = SessionConfig(goal="minimise the synthetic loss", experiment="tests.agent.synthetic:SPEC",
                               proposer="tpe", trials=2, parallel=2, poll=0.2, confirm_seeds=0, baseline_seeds=1)
        summary = runner.start(config, settings=settings)

        wait_for(lambda: service.store.get(job_id).job_state.finished, timeout=90, what="the tracked job")
        job = service.store.get(job_id)
        assert job.state == "SUCCEEDED", Path(job.log_path).read_text()
        client = MlflowClient(mlflow_server)
        history = client.get_metric_history(job.mlflow_run_id, "loss")
        assert [(m.step, round(m.value, 3)) for m in history] == [(0, 1.0), (1, 0.5), (2, 0.333)]
        assert client.get_run(job.mlflow_run_id).data.tags["autoresearch.job_id"] == str(job_id)
        # The service ends the run it made with its job, over the server's REST API too.
        wait_for(lambda: client.get_run(job.mlflow_run_id).info.status == "FINISHED", timeout=30,
                 what="the job's run to end")
        assert client.get_run(job.mlflow_run_id).info.end_time == int(job.finished_at * 1000)

        assert summary["trials"] == 1 + 2 and summary["baseline"] is not None and summary["headline"]
        trials = api.open_store(settings).list(owner=summary["session"])
        assert len(trials) == 3  # the baseline's run, then two proposals
        for trial in trials:
            assert client.get_metric_history(trial.mlflow_run_id, "loss"), f"no loss for job {trial.id}"
    finally:
        service.stop()
