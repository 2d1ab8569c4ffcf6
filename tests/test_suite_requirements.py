"""The suite's own guarantee: under CI a missing PostgreSQL, FUSE or podman fails the run instead of skipping.

Each case runs pytest in a subprocess on three probe tests that only request the real fixtures (`pg_url`,
`slow_volume`, `image`), with PostgreSQL pointed at a closed port and `fusermount3` and `podman` off the PATH,
so all are unavailable whatever this machine has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.requires import in_ci

ROOT = Path(__file__).resolve().parents[1]
PROBES = '''
def test_needs_postgres(pg_url):
    pass


def test_needs_fuse(slow_volume):
    pass


def test_needs_a_container_engine(image):
    pass
'''
FIXTURES = ("from tests.conftest import pg_url  # noqa: F401\n"
            "from tests.runtime.conftest import slow_volume  # noqa: F401\n"
            "from tests.containers.conftest import image  # noqa: F401\n"
            # A run still going after 100 s writes where each thread is and exits (the test then shows it).
            "import faulthandler\n"
            "STACKS = open('stacks.txt', 'w')\n"
            "faulthandler.dump_traceback_later(100, exit=True, file=STACKS)\n")


def run_probes(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(FIXTURES)
    (tmp_path / "test_probes.py").write_text(PROBES)
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PYTHONPATH=str(ROOT), PATH=str(empty_bin),
               AUTORESEARCH_TEST_PG="postgresql+psycopg2://postgres@127.0.0.1:1/test")
    if ci is not None:
        env["CI"] = ci
    # --basetemp inside this test's own directory: without it the inner pytest numbers a directory of its own
    # under /tmp/pytest-of-USER and, on exit, deletes the older ones no live run holds, which are whatever
    # earlier runs on this machine left there, however large (a whole suite's tree, on a busy machine).
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
               f"--basetemp={tmp_path / 'basetemp'}", "test_probes.py"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    stacks = tmp_path / "stacks.txt"
    if stacks.exists() and stacks.read_text():
        pytest.fail(f"the probes ran past 100 s; where they were:\n{stacks.read_text()}\n"
                    f"{result.stdout}\n{result.stderr}", pytrace=False)
    return result


def test_under_ci_missing_postgres_and_fuse_fail_the_run(tmp_path):
    result = run_probes(tmp_path, ci="true")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "3 errors" in out and "skipped" not in out, out
    assert "PostgreSQL is required under CI=true but unavailable: no server at" in out
    assert "127.0.0.1:1/test" in out  # the reason says where it looked
    assert "FUSE (for the slow volume) is required under CI=true" in out
    assert "podman is required under CI=true but unavailable: podman is not installed" in out


def test_outside_ci_they_skip_with_the_reason(tmp_path):
    result = run_probes(tmp_path, ci=None)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "3 skipped" in out
    assert "PostgreSQL unavailable: no server at" in out and "set AUTORESEARCH_TEST_PG" in out
    assert "FUSE (for the slow volume) unavailable" in out
    assert "podman unavailable: podman is not installed" in out


@pytest.mark.parametrize("value, expected", [("true", True), ("TRUE", True), ("1", True), ("yes", True),
                                             ("", False), ("false", False), ("0", False)])
def test_what_counts_as_ci(value, expected):
    assert in_ci({"CI": value}) is expected
    assert in_ci({}) is False
