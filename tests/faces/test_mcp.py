"""`autoresearch mcp` driven by the SDK's own client over stdio (and streamable HTTP), against a real service."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import Implementation

from tests.faces.conftest import SCRIPTS

TOOLS = {"submit_job", "list_jobs", "get_job", "job_logs", "cancel_job", "list_devices", "run_metrics",
         "leaderboard", "start_session", "session_status", "stop_session", "usage"}


def with_client(env, body, *args: str, name: str = "test-agent"):
    """Run `body(session)` against `autoresearch mcp ARGS` spawned over stdio; returns what body returns."""
    async def main():
        params = StdioServerParameters(command=sys.executable, args=["-m", "orchestrator.faces.cli", "mcp", *args], env=env)
        with open(env["AUTORESEARCH_HOME"] + "/mcp.stderr", "a") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write, client_info=Implementation(name=name, version="1")) as session:
                    await session.initialize()
                    return await body(session)
    return anyio.run(main)


async def call(session, tool, **arguments):
    """(is_error, JSON result or error text) of one tool call."""
    result = await session.call_tool(tool, arguments)
    text = result.content[0].text if result.content else ""
    if result.is_error:
        return True, text
    return False, result.structured_content if result.structured_content is not None else json.loads(text)


def test_tools_have_schemas_and_search_spaces_are_resources(child_env):
    async def body(session):
        tools = {t.name: t for t in (await session.list_tools()).tools}
        resources = {str(r.uri): r for r in (await session.list_resources()).resources}
        digits = await session.read_resource("autoresearch://experiments/digits")
        return tools, resources, json.loads(digits.contents[0].text)

    tools, resources, digits = with_client(child_env, body)
    assert set(tools) == TOOLS
    submit = tools["submit_job"].input_schema
    assert submit["type"] == "object"
    assert "command" in submit["properties"] and "priority" in submit["properties"]
    assert tools["get_job"].input_schema["required"] == ["job_id"]
    assert "autoresearch://experiments/digits" in resources
    assert digits["metric"] == "val_accuracy" and {"lr", "epochs"} <= {p["name"] for p in digits["space"]}


def test_the_servers_project_bounds_its_clients_and_the_usage_tool_reads_the_ledger(child_env):
    from orchestrator.api import sharing
    from orchestrator.core.config import Settings

    sharing.set_project(Settings.load(), "vision", share=2)
    sharing.set_project(Settings.load(), "nlp", share=1)

    async def body(session):
        named = await call(session, "submit_job", command=["true"], project="nlp")
        plain = await call(session, "submit_job", command=["true"], scavenger=True)
        stuck = await call(session, "submit_job", command=["true"], scavenger=True, preemptible=False)
        used = await call(session, "usage", by="project")
        return named, plain, stuck, used

    named, plain, stuck, used = with_client(child_env, body, "--project", "vision")
    assert named[0] and "charges its clients' work to 'vision'" in named[1]
    assert not plain[0] and plain[1]["project"] == "vision" and plain[1]["scavenger"] is True
    assert stuck[0] and "always preemptible" in stuck[1]
    assert not used[0] and {p["name"] for p in used[1]["projects"]} >= {"vision", "nlp", "default"}


@pytest.mark.slow
def test_an_agent_submits_watches_to_success_and_reads_logs_and_metrics(tracked_home, child_env, make_service,
                                                                       tmp_path):
    make_service(devices="cpu:2")
    marker = tmp_path / "pwned"

    async def body(session):
        # The last argument would run a command if anything put this argv through a shell.
        command = [sys.executable, str(SCRIPTS / "metrics_job.py"), f"; touch {marker}", f"$(touch {marker})"]
        err, job = await call(session, "submit_job", command=command, name="mcp-metrics", priority=5,
                              env={"PYTHONPATH": child_env["PYTHONPATH"]}, cwd=str(tmp_path))
        assert not err, job
        assert job["service_running"] and job["owner"] == "mcp:test-agent" and job["priority"] == 5
        deadline = time.monotonic() + 90
        while True:
            err, shown = await call(session, "get_job", job_id=job["id"])
            assert not err, shown
            if shown["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") or time.monotonic() > deadline:
                break
            await anyio.sleep(0.3)
        _, tail = await call(session, "job_logs", job_id=job["id"], tail=1)
        _, first = await call(session, "job_logs", job_id=job["id"], offset=0)
        _, rest = await call(session, "job_logs", job_id=job["id"], offset=first["next_offset"])
        _, metrics = await call(session, "run_metrics", job_id=job["id"])
        _, listed = await call(session, "list_jobs", all=True, owner="mcp:test-agent")
        _, devices = await call(session, "list_devices")
        _, board = await call(session, "leaderboard", experiment="digits")
        return shown, tail, first, rest, metrics, listed, devices, board

    shown, tail, first, rest, metrics, listed, devices, board = with_client(child_env, body)
    assert [(b["experiment"], b["metric"], b["entries"]) for b in board["boards"]] == [("digits", "val_accuracy", [])]
    assert shown["state"] == "SUCCEEDED", shown
    assert [e["to"] for e in shown["events"]][-3:] == ["STARTING", "RUNNING", "SUCCEEDED"]
    assert tail["text"].startswith("argv tail:") and tail["text"].count("\n") == 1
    assert "step 2 loss 0.3333" in first["text"] and first["next_offset"] == first["size"] and first["final"]
    assert rest["text"] == "" and rest["offset"] == first["size"]
    assert f"; touch {tmp_path}" in first["text"] and not (tmp_path / "pwned").exists()  # argv stayed literal
    assert metrics["metrics"]["loss"] == [[0, 1.0], [1, 0.5], [2, pytest.approx(1 / 3)]]
    assert [j["id"] for j in listed["jobs"]] == [shown["id"]] and (listed["total"], listed["more"]) == (1, 0)
    assert {d["device"] for d in devices["devices"]} == {"cpu:0", "cpu:1"} and len(devices["services"]) == 1

    # People see who submitted it.
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "queue", "--all", "--json"], env=child_env,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)[0]["owner"] == "mcp:test-agent"
    table = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "queue", "--all"], capture_output=True,
                           env={**child_env, "COLUMNS": "200"}, text=True, check=True).stdout
    assert any("mcp-metrics" in line and "mcp:test-agent" in line for line in table.splitlines())


def test_bad_arguments_are_one_line_tool_errors_like_the_cli_and_the_server_keeps_serving(child_env):
    cli = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "submit", "--experiment", "digits",
                          "--param", "lr=fast"], env=child_env, capture_output=True, text=True)
    assert cli.returncode == 2
    cli_line = cli.stderr.strip().removeprefix("autoresearch: ")

    async def body(session):
        answers = {
            "param": await call(session, "submit_job", experiment="digits", params={"lr": "fast"}),
            "cap": await call(session, "submit_job", command=["true"], priority=6),
            "empty": await call(session, "submit_job", command=[]),
            "both": await call(session, "submit_job", command=["true"], experiment="digits"),
            "experiment": await call(session, "submit_job", experiment="nope"),
            "missing": await call(session, "get_job", job_id=12345),
            "type": await call(session, "get_job", job_id="one"),
            "no-arg": await call(session, "cancel_job"),
            "time": await call(session, "submit_job", command=["true"], time_limit="soon"),
            "logs": await call(session, "job_logs", job_id=1, tail=3, offset=0),
            "session": await call(session, "session_status", session_id="s-00000000"),
            "start": await call(session, "start_session", goal="x", experiment="nope"),
            "budget": await call(session, "start_session", goal="x", experiment="digits", proposer="llm",
                                 llm_budget_usd=1.0),
            "board": await call(session, "leaderboard", experiment="nope"),
            "limit": await call(session, "list_jobs", limit=-1),
        }
        answers["after"] = await call(session, "list_jobs", all=True)
        return answers

    # A model with no known price (and no llm_price): a dollar budget on it is refused.
    answers = with_client({**child_env, "AUTORESEARCH_LLM_MODEL": "my-local-model"}, body)
    for key, (is_error, text) in answers.items():
        if key == "after":
            continue
        assert is_error, (key, text)
        assert "\n" not in text and "Traceback" not in text and not text.startswith("Error executing"), (key, text)
    assert answers["param"][1] == cli_line
    assert answers["cap"][1].startswith("--priority 6 is above this server's cap of 5")
    assert answers["missing"][1] == "no job with id 12345"
    assert answers["type"][1].startswith("bad argument job_id:")
    assert answers["no-arg"][1] == "missing argument job_id"
    assert "unknown experiment 'nope'" in answers["experiment"][1]
    assert answers["logs"][1] == "give either tail or offset, not both"
    assert answers["budget"][1].startswith("--llm-budget-usd: no price is known for model 'my-local-model'")
    assert answers["limit"][1] == "--limit must be an integer >= 0 (0: every job), got -1"
    assert answers["after"] == (False, {"jobs": [], "total": 0, "more": 0, "counts": {}})  # nothing was queued


def a_persons_job() -> int:
    """A job typed by a person (through the library, as `autoresearch submit` does), owned by them."""
    from orchestrator.api import jobs as api
    from orchestrator.queue.models import JobSpec

    job, _ = api.submit(JobSpec(argv=["true"], track=False))
    assert not job.owner.startswith("mcp:")
    return job.id


def test_a_client_cancels_only_its_own_jobs_and_the_cap_holds_for_sessions_and_admits_itself(child_env):
    theirs = a_persons_job()

    async def body(session):
        err, mine = await call(session, "submit_job", command=["true"], priority=5)  # the default cap, exactly
        assert not err, mine
        return (mine, await call(session, "submit_job", command=["true"], priority=6),
                await call(session, "start_session", experiment="digits", trials=1, priority=6),
                await call(session, "cancel_job", job_id=theirs), await call(session, "cancel_job", job_id=mine["id"]),
                await call(session, "session_status"))

    mine, over, session, refused, cancelled, sessions = with_client(child_env, body)
    assert mine["priority"] == 5 and mine["owner"] == "mcp:test-agent"
    assert over[0] and "cap of 5" in over[1]
    assert session[0] and "cap of 5" in session[1] and sessions == (False, {"sessions": []})  # none was started
    assert refused[0] and f"job {theirs} belongs to" in refused[1] and "--allow-cancel-any" in refused[1]
    assert cancelled == (False, {**cancelled[1], "state": "CANCELLED"})
    from orchestrator.api import jobs as api

    assert api.open_store(None).get(theirs).state == "QUEUED"  # the person's job is untouched


def test_max_priority_is_a_server_side_cap_a_person_can_raise(child_env):
    theirs = a_persons_job()

    async def body(session):
        return (await call(session, "submit_job", command=["true"], priority=11),
                await call(session, "submit_job", command=["true"], priority=13),
                await call(session, "cancel_job", job_id=theirs))

    (ok, job), (refused, why), (err, cancelled) = with_client(child_env, body, "--max-priority", "12",
                                                              "--allow-cancel-any")
    assert not ok and job["priority"] == 11
    assert refused and "cap of 12" in why
    assert not err and cancelled["id"] == theirs and cancelled["state"] == "CANCELLED"
    bad = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "mcp", "--http", "0"], env=child_env,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "autoresearch: --http must be a port in 1..65535, got 0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_listens_on_loopback(child_env):
    from mcp.client.streamable_http import streamable_http_client

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "mcp", "--http", str(port)], env=child_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.2)

        async def main():
            async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as streams:
                async with ClientSession(streams[0], streams[1]) as session:
                    await session.initialize()
                    return {t.name for t in (await session.list_tools()).tools}

        assert anyio.run(main) == TOOLS
        local = [line.split()[3] for line in subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                                                             text=True).stdout.splitlines()]
        assert local == [f"127.0.0.1:{port}"]  # loopback only, unless --host says otherwise
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.slow
def test_a_session_is_started_watched_and_stopped_over_mcp(tracked_home, child_env, make_service):
    make_service(devices="cpu:2")

    async def body(session):
        err, started = await call(session, "start_session", goal="higher val_accuracy", experiment="digits",
                                  proposer="random", trials=20, parallel=2, params={"epochs": 30})
        assert not err, started
        sid = started["session"]
        deadline = time.monotonic() + 120
        while True:  # wait until its trials are on the devices
            _, status = await call(session, "session_status", session_id=sid)
            if status["sessions"][0]["trials"].get("RUNNING", 0) or time.monotonic() > deadline:
                break
            await anyio.sleep(0.5)
        err, stopped = await call(session, "stop_session", session_id=sid)
        assert not err, stopped
        _, jobs = await call(session, "list_jobs", all=True, owner=sid)
        again = await call(session, "stop_session", session_id="s-nothere")
        return status["sessions"][0], stopped, jobs["jobs"], again

    status, stopped, jobs, again = with_client(child_env, body)
    assert status["status"] == "running" and status["experiment"] == "digits" and status["tally"].startswith("baseline ")
    # --trials 20: 14 search trials and 6 re-runs (2 candidates x 3 seeds), the baseline's 3 seeds on top.
    assert {p: r["planned"] for p, r in status["phases"].items()} == {"baseline": 3, "search": 14, "confirm": 6}
    assert stopped["status"] == "interrupted"  # resumable with `autoresearch resume`
    assert stopped["cancelled_jobs"] and set(stopped["cancelled_jobs"]) <= {j["id"] for j in jobs}
    assert all(j["state"] in ("CANCELLING", "CANCELLED", "SUCCEEDED", "FAILED") for j in jobs), jobs
    assert again == (True, "no session 's-nothere'; see `autoresearch sessions`")
