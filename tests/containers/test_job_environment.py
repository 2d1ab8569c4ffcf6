"""`submit --workdir/--env-file/--image/--mount` through the CLI: what the job gets, what is never shown, and
bad input refused with one line, exit 2, nothing queued."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.core.config import Settings
from orchestrator.queue.store import JobStore
from tests.orchestrator.helpers import wait_for

SECRET = "hunter2-7f3a91"


def cli(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120, cwd=cwd)


def test_a_relative_workdir_is_stored_absolute(home, tmp_path):
    (tmp_path / "sub").mkdir()
    out = cli("submit", "--workdir", "sub", "--json", "--", "true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cwd"] == str(tmp_path / "sub")


def test_env_file_values_reach_the_job_and_are_never_shown(make_service, tmp_path):
    service = make_service("cpu:1")
    work = tmp_path / "work dir"
    work.mkdir()
    env_file = tmp_path / "job.env"
    env_file.write_text(f"# credentials\nexport SECRET={SECRET}\nOVER='from the file'\nQUOTED=\"a b\"\n")
    (tmp_path / "expected").write_text(SECRET)  # compared inside, so the secret is in no argv either
    check = (f'test "$SECRET" = "$(cat {tmp_path}/expected)" && test "$OVER" = cli && test "$QUOTED" = "a b" '
             '&& pwd && echo checked')
    out = cli("submit", "--env-file", str(env_file), "--env", "OVER=cli", "--workdir", str(work), "--no-track",
              "--", "sh", "-c", check)
    assert out.returncode == 0, out.stderr
    job_id = int(out.stdout.strip())
    wait_for(lambda: service.store.get(job_id).final, timeout=60, what="the job")
    assert service.store.get(job_id).state == "SUCCEEDED"
    shown = [cli(*args) for args in (["show", str(job_id)], ["show", str(job_id), "--json"],
                                     ["queue", "--all", "--json"], ["queue", "--all"], ["logs", str(job_id)])]
    assert all(o.returncode == 0 for o in shown)
    assert f"{work}\nchecked" in shown[-1].stdout  # ran in the workdir, with the variables
    assert "SECRET" in shown[0].stdout and str(env_file) in shown[0].stdout  # names and the file, for people
    assert not [o.args for o in shown if SECRET in o.stdout + o.stderr or "from the file" in o.stdout]


@pytest.mark.parametrize("args, says", [
    (["--workdir", "/no/such/dir"], "--workdir /no/such/dir: not a directory"),
    (["--workdir", "{file}"], "not a directory"),
    (["--env-file", "/no/such.env"], "--env-file /no/such.env: no such file"),
    (["--env-file", "{bad_env}"], "BARE has no value"),
    (["--mount", "/tmp:/x"], "--mount needs --image"),
    (["--image", "whatever:1", "--mount", "/no/such/src:/data"], "/no/such/src does not exist"),
    (["--image", "whatever:1", "--mount", "/tmp"], "expected SRC:DST"),
])
def test_bad_environment_input_is_one_line_exit_2_and_queues_nothing(home, tmp_path, args, says):
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.env").write_text(f"GOOD=1\nBARE\nSECRET={SECRET}\n")
    args = [a.format(file=tmp_path / "file", bad_env=tmp_path / "bad.env") for a in args]
    out = cli("submit", *args, "--", "true")
    assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert SECRET not in out.stderr
    assert JobStore(Settings.load().db_url).list() == []


def test_no_container_engine_is_one_line_exit_2(home, tmp_path):
    out = cli("submit", "--image", "python:3.12", "--", "true", env={"PATH": str(tmp_path)})
    assert out.returncode == 2 and "needs a container engine" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert JobStore(Settings.load().db_url).list() == []


def test_an_image_the_engine_does_not_have_is_one_line_exit_2(home, image):
    out = cli("submit", "--image", "localhost/no-such-image:0", "--", "true")
    assert out.returncode == 2 and "--image localhost/no-such-image:0: no such image" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert JobStore(Settings.load().db_url).list() == []
    ok = cli("submit", "--image", image, "--mount", f"{home}:/data:ro", "--json", "--", "true")
    assert ok.returncode == 0 and '"image_id": "sha256:' in ok.stdout and f'"{home}:/data:ro"' in ok.stdout
