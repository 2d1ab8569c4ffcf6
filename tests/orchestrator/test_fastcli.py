"""The lean `autoresearch submit` (orchestrator.faces.fastcli): handed to the running service over its socket, with
the full CLI's output, exit codes and checks; the full CLI's path when no service (or another queue) is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from orchestrator.core.config import Settings
from orchestrator.queue.store import JobStore

FAST_ONLY = "import sys; sys.argv[1:] = {args!r}; from orchestrator.faces import fastcli; " \
            "code = fastcli.fast_submit(sys.argv[2:]); " \
            "print('HEAVY', sorted(m for m in ('typer', 'sqlalchemy', 'mlflow', 'rich') if m in sys.modules), " \
            "file=sys.stderr); sys.exit(99 if code is None else code)"


def fast(*args, env=None):
    return subprocess.run([sys.executable, "-m", "orchestrator.faces.fastcli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def fast_only(*args):
    """Only the fast path (exit 99 when it would hand over to the full CLI), reporting heavy imports."""
    return subprocess.run([sys.executable, "-c", FAST_ONLY.format(args=["submit", *args])], capture_output=True,
                          text=True, timeout=60)


def count() -> int:
    return JobStore(Settings.load().db_url).count()


def test_submit_goes_through_the_service_without_heavy_imports(make_service, tmp_path):
    service = make_service("cpu:2")
    out = fast_only("--json", "--name", "hello", "--priority", "3", "--env", "A=1", "--no-track", "--",
                    "echo", "hi")
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stderr
    job = json.loads(out.stdout)
    stored = service.store.get(job["id"])
    assert (stored.name, stored.priority, stored.argv, stored.env, stored.track) == ("hello", 3, ["echo", "hi"],
                                                                                     {"A": "1"}, False)
    assert stored.cwd == os.getcwd()
    full = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "submit", "--json", "--name", "hello",
                           "--priority", "3", "--", "echo", "hi"], capture_output=True, text=True, timeout=60)
    assert full.returncode == 0, full.stderr
    assert list(json.loads(full.stdout)) == list(job), "the same JSON shape as the full CLI"
    plain = fast("submit", "--no-track", "true")
    assert plain.returncode == 0 and plain.stdout.strip() == str(job["id"] + 2) and plain.stderr == ""


def test_bad_input_is_one_line_exit_2_and_changes_nothing(make_service):
    make_service("cpu:2")
    before = count()
    for args in (["--priority", "5000000", "--", "true"], ["--gpus", "3", "--", "true"],
                 ["--time-limit", "5x", "--", "true"], ["--"]):
        out = fast_only(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 2  # the reason, then HEAVY
        assert out.stderr.startswith("autoresearch: ")
    assert count() == before


def test_without_a_service_or_for_another_queue_the_full_cli_submits(home, tmp_path):
    assert fast_only("--", "true").returncode == 99  # nobody listens: the full CLI's path
    out = fast("submit", "--json", "--", "true")
    assert out.returncode == 0 and json.loads(out.stdout)["service_running"] is False
    assert "no service is running" in out.stderr
    assert fast_only("--experiment", "digits").returncode == 99  # not the lean path's business
    assert fast_only("--priority", "high", "--", "true").returncode == 99  # typer words the error


def test_a_submit_naming_another_database_is_not_taken_by_this_service(make_service, tmp_path):
    service = make_service("cpu:2")
    other = f"sqlite:///{tmp_path / 'other.db'}"
    out = fast("submit", "--json", "--no-track", "--", "true", env={"AUTORESEARCH_DB_URL": other})
    assert out.returncode == 0, out.stderr
    assert JobStore(other).count() == 1 and service.store.count() == 0


def _reads(job_id):
    return (("queue", ["queue", "--json"]), ("all", ["queue", "--all", "--json"]),
            ("one", ["queue", "--limit", "1", "--json"]), ("show", ["show", str(job_id), "--json"]))


def test_queue_and_show_json_come_from_the_service_in_the_full_cli_shape(make_service):
    service = make_service("cpu:1")
    first = service.store.submit(__import__("orchestrator.queue.models", fromlist=["JobSpec"]).JobSpec(
        argv=["sleep", "30"], track=False)).id
    second = fast("submit", "--no-track", "--", "true").stdout.strip()
    full = {name: subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", *args], capture_output=True, text=True,
                                 timeout=60).stdout
            for name, args in _reads(first)}
    for name, args in _reads(first):
        code = "import sys; from orchestrator.faces import fastcli; c = fastcli.fast_read(sys.argv[1], sys.argv[2:]); " \
               "assert 'sqlalchemy' not in sys.modules and 'typer' not in sys.modules; sys.exit(99 if c is None else c)"
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        mine, theirs = json.loads(out.stdout), json.loads(full[name])
        if name == "show":
            assert list(mine) == list(theirs) and mine["id"] == first
        else:
            assert [j["id"] for j in mine] == [j["id"] for j in theirs] and list(mine[0]) == list(theirs[0])
        if name == "one":  # the first in listing order, and the rest counted on stderr as the full CLI does
            assert len(mine) == 1 and out.stderr.startswith("... and 1 more ")
    assert str(second) in {str(j["id"]) for j in json.loads(full["all"])}
    missing = fast("show", "999", "--json")
    assert missing.returncode == 2 and missing.stderr.startswith("autoresearch: ") and missing.stdout == ""
    service.store.cancel(first)


def test_project_scavenger_and_deadline_are_read_by_the_lean_path(make_service):
    service = make_service("cpu:2")
    out = fast_only("--json", "--no-track", "--project", "default", "--scavenger", "--deadline", "2h", "--", "true")
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stderr
    stored = service.store.get(json.loads(out.stdout)["id"])
    assert (stored.project, stored.scavenger, stored.preemptible) == ("default", True, True)
    assert 7100 < stored.deadline - stored.submitted_at <= 7200
    both = fast_only("--scavenger", "--no-preempt", "--", "true")
    assert both.returncode == 2 and both.stderr.startswith("autoresearch: --scavenger jobs are always preemptible")
    past = fast_only("--deadline", "2001-01-01 00:00", "--", "true")
    assert past.returncode == 2 and "is in the past" in past.stderr


def test_the_typer_command_takes_every_submit_flag_as_declared():
    import typer.main

    from orchestrator.api.submitflags import FLAGS, default
    from orchestrator.faces.cli import app

    params = {p.name: p for p in typer.main.get_command(app).commands["submit"].params}
    for flag in FLAGS:
        assert params[flag.key].opts == [flag.name] and params[flag.key].default == default(flag), flag.name
    assert set(params) == {flag.key for flag in FLAGS} | {"argv"}
