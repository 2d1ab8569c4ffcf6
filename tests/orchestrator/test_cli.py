"""The CLI contract: --json shapes, exit codes, one-line errors that change nothing, and concurrent submits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.core.config import Settings
from orchestrator.queue.store import JobStore
from orchestrator.service.health import HealthConfig
from tests.orchestrator.helpers import wait_for


def cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def count() -> int:
    return JobStore(Settings.load().db_url).count()


def a_queued_job() -> None:
    """One job in this home's queue, put there through the library (a CLI process spends a second importing):
    the store the CLI is about to be refused on is not empty."""
    from orchestrator.api import jobs as api
    from orchestrator.queue.models import JobSpec

    api.submit(JobSpec(argv=["true"]))


def test_submit_json_queue_and_show(home):
    out = cli("submit", "--json", "--name", "hello", "--priority", "3", "--", "echo", "hi")
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    assert job["id"] == 1 and job["state"] == "QUEUED" and job["priority"] == 3 and job["argv"] == ["echo", "hi"]
    assert "no service is running" in out.stderr
    listed = json.loads(cli("queue", "--json").stdout)
    for key in ("id", "name", "state", "priority", "gpus", "devices", "attempts", "preemptions", "exit_code",
                "mlflow_run_id"):
        assert key in listed[0]
    shown = json.loads(cli("show", "1", "--json").stdout)
    assert shown["events"][0]["to"] == "QUEUED"
    assert cli("cancel", "1").returncode == 0
    assert json.loads(cli("queue", "--json").stdout) == []
    assert [j["state"] for j in json.loads(cli("queue", "--all", "--json").stdout)] == ["CANCELLED"]


def test_submit_experiment_validates_params(home):
    ok = cli("submit", "--json", "--experiment", "digits", "--param", "lr=0.01")
    assert ok.returncode == 0, ok.stderr
    job = json.loads(ok.stdout)
    assert job["experiment"] == "digits" and job["params"]["lr"] == 0.01 and job["priority"] == 10


@pytest.mark.parametrize("args,needle", [
    (["show", "999"], "no job with id 999"),
    (["cancel", "999"], "no job with id 999"),
    (["submit", "--gpus", "0", "--", "true"], "--gpus"),
    (["submit", "--priority", "high", "--", "true"], "--priority"),
    (["submit", "--priority", "99999999999999999999", "--", "true"], "--priority must be an integer from"),
    (["submit", "--gpus", "99999999999999999999", "--", "true"], "--gpus must be an integer from"),
    (["submit", "--"], "command is empty"),
    (["submit"], "command is empty"),
    (["submit", "--experiment", "nope"], "unknown experiment"),
    (["submit", "--experiment", "digits", "--param", "bogus=1"], "bogus"),
    (["submit", "--experiment", "digits", "--param", "lr=7"], "lr"),
    (["submit", "--param", "lr=1", "--", "true"], "--experiment"),
    (["serve", "--devices", "gpu:x"], "--devices"),
    (["serve", "--devices", "cpu:0"], "cpu:N"),
    (["queue", "--limit", "-1"], "--limit must be an integer >= 0"),
    (["queue", "--json", "--limit", "many"], "--limit"),
])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(home, args, needle):
    a_queued_job()
    before = count()
    out = cli(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert needle in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert count() == before


def test_unreachable_database_is_exit_2(home):
    out = cli("queue", env={"AUTORESEARCH_DB_URL": "postgresql+psycopg2://x@127.0.0.1:1/none?connect_timeout=1"})
    assert out.returncode == 2 and "cannot reach queue database" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_cancel_finished_job_and_gpus_over_capacity_with_a_service(home, make_service):
    service = make_service("cpu:2")
    done = json.loads(cli("submit", "--json", "--no-track", "--", "true").stdout)["id"]
    wait_for(lambda: service.store.get(done).state == "SUCCEEDED", timeout=30)
    before = count()
    out = cli("cancel", str(done))
    assert out.returncode == 2 and "already SUCCEEDED" in out.stderr
    out = cli("submit", "--gpus", "3", "--", "true")
    assert out.returncode == 2 and "no live service has 3 devices; largest has 2" in out.stderr
    second = cli("serve", "--devices", "cpu:1")
    assert second.returncode == 2 and "already running" in second.stderr
    assert count() == before
    gpus = json.loads(cli("gpus", "--json").stdout)
    assert [d["device"] for d in gpus] == ["cpu:0", "cpu:1"]
    assert cli("gpus", "disable", "1", "--reason", "fan").returncode == 0
    assert {d["device"]: d["state"] for d in json.loads(cli("gpus", "--json").stdout)}["cpu:1"] == "disabled"
    assert cli("gpus", "enable", "cpu:1").returncode == 0
    assert cli("gpus", "disable", "7").returncode == 2


@pytest.mark.parametrize("command", [["queue"], ["show", "1"], ["submit", "--", "true"], ["cancel", "1"],
                                     ["gpus"], ["serve", "--devices", "cpu:1"], ["preflight", "--devices", "cpu:1"],
                                     ["sessions"], ["leaderboard"], ["cache", "stats"],
                                     ["data", "export-delta", "t", "dest"]])
def test_a_malformed_config_file_is_one_line_exit_2_from_every_command(home, command):
    a_queued_job()
    (home / "config.toml").write_text('devices = "cpu:2\n')  # unterminated string
    out = cli(*command)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert str(home / "config.toml") in out.stderr and "not valid TOML" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    (home / "config.toml").unlink()
    assert count() == 1 and json.loads(cli("queue", "--json").stdout)[0]["state"] == "QUEUED"


def test_process_tracking_and_the_node_name_are_settings_like_any_other(home, monkeypatch):
    from orchestrator.core.layout import node_name
    from orchestrator.executors.local.executor import LocalExecutor
    from orchestrator.core.layout import Layout

    monkeypatch.delenv("AUTORESEARCH_CGROUP", raising=False)
    monkeypatch.delenv("AUTORESEARCH_NODE", raising=False)
    (home / "config.toml").write_text('cgroup = "off"\nnode = "rack2-a"\n')
    settings = Settings.load()
    assert node_name(home, settings.node) == "rack2-a"
    executor = LocalExecutor.create(settings, Layout(home), lambda *a: None)
    try:
        assert executor.tracking == "psutil"  # the file's `off`, where the environment says nothing
    finally:
        executor.close()
    monkeypatch.setenv("AUTORESEARCH_NODE", "rack3-b")  # the environment wins over the file
    assert Settings.load().node == "rack3-b"


def test_settings_come_from_flags_then_env_then_config_file(home, monkeypatch):
    (home / "config.toml").write_text('devices = "cpu:3"\npreempt_after = 5\nhang_timeout = 7\nllm_model = "m"\n')
    monkeypatch.setenv("AUTORESEARCH_PREEMPT_AFTER", "6")
    settings = Settings.load(hang_timeout=8)
    assert (settings.devices, settings.preempt_after, settings.hang_timeout, settings.llm_model) == ("cpu:3", 6, 8, "m")
    assert HealthConfig.from_settings(settings).hang_timeout == 8
    (home / "config.toml").write_text('preempt_after = "soon"\n')
    monkeypatch.delenv("AUTORESEARCH_PREEMPT_AFTER")
    out = cli("queue")
    assert out.returncode == 2 and "config.toml: preempt_after: 'soon' is not a number" in out.stderr
    out = cli("queue", env={"AUTORESEARCH_RETRY_BACKOFF": "-1"})
    assert out.returncode == 2 and "config.toml" in out.stderr  # the file is read (and wrong) first
    (home / "config.toml").unlink()
    out = cli("queue", env={"AUTORESEARCH_RETRY_BACKOFF": "-1"})
    assert out.returncode == 2 and "retry_backoff must be >= 0" in out.stderr


def test_a_job_no_live_service_can_place_says_so_and_is_refused_once_services_are_known(home, make_service):
    out = cli("submit", "--json", "--gpus", "100000", "--", "true")  # no service known yet: accepted
    assert out.returncode == 0, out.stderr
    big = json.loads(out.stdout)["id"]
    make_service("cpu:2")
    why = "no live service has 100000 devices; largest has 2"
    wait_for(lambda: json.loads(cli("queue", "--json").stdout)[0]["reason"] == why, timeout=30,
             what="the reason in `queue`")
    shown = cli("show", str(big))
    assert why in shown.stdout and json.loads(cli("show", str(big), "--json").stdout)["state"] == "QUEUED"
    before = count()
    out = cli("submit", "--gpus", "100000", "--", "true")
    assert out.returncode == 2 and why in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert count() == before


def test_logs_follow_streams_until_the_job_ends(home, make_service):
    service = make_service("cpu:1")
    job = json.loads(cli("submit", "--json", "--no-track", "--", "sh", "-c",
                         "for i in 1 2 3; do echo line$i; sleep 0.3; done").stdout)["id"]
    out = cli("logs", str(job), "--follow")
    assert out.returncode == 0
    assert "line1" in out.stdout and "line3" in out.stdout
    assert service.store.get(job).state == "SUCCEEDED"


SUBMITTER = """
import sys
from orchestrator.api import jobs as api
from orchestrator.queue.models import JobSpec
ids = [api.submit(JobSpec(argv=["true"], name=f"p{sys.argv[1]}"))[0].id for _ in range(50)]
print(" ".join(map(str, ids)))
"""


def test_eight_processes_submitting_fifty_each_lose_nothing(home):
    cli("queue")  # create the schema once, as a first user would
    procs = [subprocess.Popen([sys.executable, "-c", SUBMITTER, str(i)], stdout=subprocess.PIPE, text=True)
             for i in range(8)]
    ids = []
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0
        ids += [int(x) for x in out.split()]
    assert len(ids) == 400 and len(set(ids)) == 400
    jobs = JobStore(Settings.load().db_url).list()
    assert len(jobs) == 400 and sorted(j.id for j in jobs) == sorted(ids)
