"""Every `autoresearch` command and every Python import on a documentation page (README.md and docs/) is checked
against the real CLI and the real packages, so a renamed flag or a moved module fails here, not in a reader's
terminal.

A command line is resolved to its sub-command (an unknown one fails), every option it names must be one of that
command's, and a concrete line (no synopsis brackets, alternatives or PLACEHOLDERS) is parsed as the CLI parses it,
values and types included, without running it. Pages whose commands run whole are executed elsewhere
(tests/faces/test_python_api.py, tests/experiments/test_framework_guides.py); this test covers every page.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHELL = ("", "bash", "sh", "shell", "console")  # `text` blocks are output (a `top` frame), not commands
SYNOPSIS = re.compile(r"[\[\]|<>]|\.\.\.|\b[A-Z][A-Z_]+\b")  # [--json], a|b, <x>, ..., SESSION


def blocks(langs: tuple[str, ...]) -> list[tuple[Path, str]]:
    return [(page, body) for page in PAGES for lang, body in FENCE.findall(page.read_text()) if lang in langs]


def command_lines() -> list[tuple[str, str]]:
    """(page, command line) of every `autoresearch ...` line in the pages' shell blocks."""
    out = []
    for page, body in blocks(SHELL):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            for part in line.split(";"):  # `autoresearch sessions; autoresearch resume SESSION`
                part = re.sub(r"\s+#.*$", "", part).strip()
                if part.startswith("autoresearch "):
                    out.append((str(page.relative_to(ROOT)), part))
    return out


def import_lines() -> list[tuple[str, str]]:
    """(page, statement) of every import in the pages' Python blocks."""
    return sorted({(str(page.relative_to(ROOT)), line.strip()) for page, body in blocks(("python", "py"))
                   for line in body.splitlines() if re.match(r"\s*(from \S+ import [^(]+$|import \S+)", line)})


@pytest.fixture(scope="module")
def cli():
    import typer

    import orchestrator.faces.cli  # noqa: F401  (registers every sub-command on the app)
    from orchestrator.faces.cli.app import app

    return typer.main.get_command(app)


def _rest(ctx) -> list[str]:
    return [*(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", None) or []), *ctx.args]


def test_the_pages_hold_the_commands_this_test_checks():
    pages = {page for page, _ in command_lines()}
    assert len(command_lines()) >= 60 and {"README.md", "docs/guides/training-jobs.md"} <= pages
    assert len(import_lines()) >= 10


@pytest.mark.parametrize("page,line", command_lines())
def test_every_command_on_a_page_is_one_the_cli_takes(cli, page, line):
    words = shlex.split(line)[1:]
    command, path = cli, []
    for word in words:
        if word in getattr(command, "commands", {}):
            command, path = command.commands[word], [*path, word]
        else:
            break
    assert path, f"{page}: `{line}`: no such command"
    before = line.split(" -- ")[0]  # what follows `--` is the job's own command
    options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    unknown = [f for f in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", before) if f not in options]
    assert not unknown, f"{page}: `{line}`: `autoresearch {' '.join(path)}` has no option {', '.join(unknown)}"
    if SYNOPSIS.search(before):
        return  # a synopsis line: its command and options are checked above
    ctx = cli.make_context("autoresearch", words)
    group, rest = cli, _rest(ctx)
    while hasattr(group, "commands") and rest:  # parse each level as click does, without invoking anything
        name, sub, rest = group.resolve_command(ctx, rest)
        ctx = sub.make_context(name, rest, parent=ctx)
        group, rest = sub, _rest(ctx) if hasattr(sub, "commands") else []


@pytest.mark.parametrize("page,statement", import_lines())
def test_every_import_on_a_page_runs(page, statement):
    try:
        exec(statement, {})
    except ImportError as exc:
        pytest.fail(f"{page}: `{statement}`: {exc}")

