"""`--help` of every command, as a person reads it in an 80-column terminal: it exits 0, no line is wider
than the terminal, and no parameter carries a Python annotation for a label (`--help <bool>`, `<list[str]>`)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from orchestrator.faces.cli import app, main
from orchestrator.faces.cli.helpfmt import command, walk

# A Python annotation shown as a label: <bool>, <int>, <str>, <list[str]>, <float>...
_TYPE_LABEL = re.compile(r"<(bool|int|float|str|path|list\[[^\]]*\]|[a-z_]+\|[a-z_|]+)>", re.IGNORECASE)
PATHS = [path for path, _ in walk(command(app))]


def _help(capsys, path: tuple[str, ...]) -> tuple[int, str]:
    capsys.readouterr()
    try:
        main([*path, "--help"])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return code, capsys.readouterr().out


def _problems(text: str) -> list[str]:
    wide = [f"{len(line)} columns: {line!r}" for line in text.splitlines() if len(line) > 80]
    return wide + [f"type label {m.group(0)}" for m in _TYPE_LABEL.finditer(text)]


def test_the_walk_finds_every_command_and_its_subcommands():
    names = {" ".join(path) for path in PATHS}
    assert {"", "submit", "queue", "show", "start", "serve", "gpus", "gpus disable", "data export-delta"} <= names


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "autoresearch")
def test_help_is_clean_at_80_columns(path, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("AUTORESEARCH_HOME", str(tmp_path))  # the CLI resolves settings, never the user's home
    code, out = _help(capsys, path)
    assert code == 0
    assert "Usage: autoresearch" in out
    assert not _problems(out), "\n".join(_problems(out))


def test_the_console_script_help_names_options_by_what_they_take(child_env):
    env = {**child_env, "COLUMNS": "80"}
    run = subprocess.run([sys.executable, "-m", "orchestrator.faces.fastcli", "submit", "--help"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert not _problems(run.stdout), "\n".join(_problems(run.stdout))
    lines = {line.split()[1]: line for line in run.stdout.splitlines() if line.startswith("│ --")}
    assert "INTEGER" in lines["--priority"] and "FLOAT" in lines["--grace"] and "TEXT" in lines["--name"]
    assert lines["--no-preempt"].split()[2] == "Never", "a flag takes no value, so it has no label"
    assert "Usage: autoresearch submit [OPTIONS] [ARGV]..." in run.stdout
