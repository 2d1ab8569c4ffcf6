"""What the tool tells a new user on day one: config mistakes, messages that echo what was given, the order of
`--help`, dates, device states and the notes that say why nothing is printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from orchestrator.core.config import Settings
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from tests.orchestrator.helpers import ckpt_job, wait_for


def cli(*args, env=None, timeout=60, fast=False):
    module = "orchestrator.faces.fastcli" if fast else "orchestrator.faces.cli"
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line(out) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    return lines[0]


def count() -> int:
    return JobStore(Settings.load().db_url).count()


def test_an_unknown_config_key_or_table_is_one_line_exit_2_from_every_command(home, make_service):
    store = make_service("cpu:1").store  # a running service: `submit` would otherwise go straight to it (fastcli)
    cfg = home / "config.toml"
    cfg.write_text("preemt_after = 5\n")
    for args, fast in ((["queue"], False), (["submit", "--", "true"], True), (["serve", "--devices", "cpu:1"], False)):
        line = one_line(cli(*args, fast=fast))
        assert f"{cfg}: unknown key 'preemt_after' (did you mean 'preempt_after'?)" in line, line
    cfg.write_text('[serve]\ndevices = "cpu:2"\n')
    assert f"{cfg}: unknown table [serve]" in one_line(cli("queue"))
    assert store.count() == 0  # nothing was queued through either path
    cfg.write_text('cgroup = "off"\npreempt_after = 5\n')  # known keys: both are settings
    assert Settings.load().cgroup == "off" and Settings.load().preempt_after == 5
    assert cli("submit", "--", "true", fast=True).returncode == 0 and store.count() == 1


def test_messages_echo_what_was_given_and_help_lists_commands_in_the_order_a_user_meets_them(home):
    version = cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"autoresearch \S+\n", version.stdout), version
    shown = cli("--help", env={"COLUMNS": "100"}).stdout
    order = [m for m in re.findall(r"^\W*([a-z]+)\s{2,}", shown, flags=re.M)
             if m in ("serve", "submit", "queue", "show", "logs", "cancel", "gpus", "start", "leaderboard")]
    assert order == ["serve", "submit", "queue", "show", "logs", "cancel", "gpus", "start", "leaderboard"], shown
    assert "'abc'" in one_line(cli("submit", "--priority", "abc", "--", "true"))
    line = one_line(cli("serve", "--devices", "cpu:x"))
    assert line.count("devices") == 1 and "'cpu:x'" in line, line
    for var in ("AUTORESEARCH_PARAMS", "MLFLOW_RUN_ID", "CUDA_VISIBLE_DEVICES"):
        line = one_line(cli("submit", "--env", f"{var}=x", "--", "true", fast=True))
        assert var in line and "set by autoresearch" in line, line
    board = cli("leaderboard")
    assert board.returncode == 0 and "no finished runs" in board.stdout, board
    assert count() == 0


def test_sessions_never_cut_ids_and_a_sampler_session_needs_no_goal(home):
    from orchestrator.agent.session import NO_GOAL, Registry, SessionConfig

    llm = one_line(cli("start", "--experiment", "digits", "--proposer", "llm", "--trials", "1"))
    assert "--goal is required with the llm proposer" in llm, llm
    config = SessionConfig(goal="", experiment="a-rather-long-experiment-name-for-80-columns", proposer="random")
    assert config.goal == NO_GOAL
    registry = Registry(home)
    ids = [f"s-{i:08x}" for i in (0xad255cafe, 0xbeef)]
    for session_id in ids:
        registry.create(session_id, config)
    registry.close()
    out = cli("sessions", env={"COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    assert all(len(line) <= 80 for line in out.stdout.splitlines()), out.stdout
    for session_id in ids:
        assert re.search(rf"^{session_id} ", out.stdout, flags=re.M), out.stdout


def test_show_gives_local_dates_gpus_say_busy_and_last_known_and_logs_follow_says_it_waits(home, make_service):
    service = make_service("cpu:2")
    job = service.store.submit(ckpt_job(100_000))  # runs until cancelled
    wait_for(lambda: service.store.get(job.id).state == "RUNNING", what="the job running")
    shown = cli("show", str(job.id)).stdout
    submitted = service.store.get(job.id).submitted_at
    local = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(submitted))
    assert re.search(rf"submitted_at: {local}", shown), shown
    assert json.loads(cli("show", str(job.id), "--json").stdout)["submitted_at"] == pytest.approx(submitted)
    gpus = cli("gpus", env={"COLUMNS": "120"})
    busy = [line for line in gpus.stdout.splitlines() if "busy" in line]
    assert len(busy) == 1 and f"#{job.id}" in busy[0] and "last known" not in gpus.stderr, gpus.stdout
    listed = {d["device"]: d for d in json.loads(cli("gpus", "--json").stdout)}
    assert sorted(d["job"] for d in listed.values() if d["job"]) == [job.id]

    service.store.cancel(job.id)
    wait_for(lambda: service.store.get(job.id).final, what="the job cancelled")
    service.stop()
    gpus = cli("gpus")
    assert gpus.returncode == 0 and "last known" in gpus.stderr and "busy" not in gpus.stdout, gpus

    waiting = service.store.submit(JobSpec(argv=["true"], track=False))  # no service: it stays queued
    follow = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "logs", "--follow", str(waiting.id)],
                              stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = follow.stderr.readline()
        assert f"job {waiting.id} is QUEUED: waiting for it to start" in first, first
        service.store.cancel(waiting.id)
        assert follow.wait(timeout=30) == 2
    finally:
        follow.kill()
        follow.wait()


def test_a_second_serve_refuses_before_it_says_serving(home, make_service):
    make_service("cpu:1")
    out = cli("serve", "--devices", "cpu:1")
    assert out.returncode == 2 and "already running" in out.stderr and "serving" not in out.stderr, out.stderr


def test_a_job_that_will_preempt_says_when_and_its_victim_names_the_job_it_yielded_to(home, make_service):
    from orchestrator.faces.views import snapshot

    service = make_service("cpu:1", preempt_after=60)
    low = service.store.submit(ckpt_job(100_000, priority=0))  # runs until preempted
    wait_for(lambda: service.store.get(low.id).state == "RUNNING", what="the low-priority job running")
    high = service.store.submit(JobSpec(argv=["true"], priority=90, track=False))
    said = re.compile(rf"will preempt #{low.id} in (\d+) s \(its minimum runtime, --preempt-after 60\)")
    frame = {row.job.id: row.plan for row in snapshot.take(Settings.load(), with_gpus=False).queue}
    found = said.fullmatch(frame[high.id])
    assert found and 0 < int(found.group(1)) <= 60, frame  # what `top` shows
    queue = cli("queue", env={"COLUMNS": "200"}).stdout
    assert said.search(queue), queue
    shown = cli("show", str(high.id)).stdout
    assert re.search(r"next: " + said.pattern, shown), shown
    as_json = json.loads(cli("show", str(high.id), "--json").stdout)  # scripts read the same words
    assert said.fullmatch(as_json["next"]) and as_json["state"] == "QUEUED", as_json
    assert service.store.get(low.id).state == "RUNNING"  # nothing was preempted early

    service.preempt_after = 0  # the victim comes of age now: the next pass preempts it for the waiting job
    service.wake()
    wait_for(lambda: service.store.get(high.id).state == "SUCCEEDED", what="the urgent job done")
    reasons = [e.reason for e in service.store.events(low.id) if e.dst == "PREEMPTING"]
    assert reasons == [f"preempted for #{high.id} (priority 90)"], reasons
