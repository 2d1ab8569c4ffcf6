"""MkDocs hook: the reference pages that are generated from the code at build time, so they cannot drift.

A page holds a marker line, replaced here by what the code says now:
- `<!-- generated: cli -->`: every command's `--help` at 80 columns, from the typer app (`orchestrator.faces.cli`),
  through the same click tree the console script uses.
- `<!-- generated: settings -->`: every `Settings` key with its environment variable and default
  (`orchestrator.core.config`), described by `_DESCRIBED` below, else by the comment on its field.
- `<!-- generated: transitions -->`: every job state and the states the store lets it go to.
- `<!-- generated: job-json -->`: the fields of a job in `queue --json` / `show --json`, in their order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What each setting means; a setting not described here is described by the comment on its field in config.py.
_DESCRIBED = {
    "db_url": "The queue's database: any SQLAlchemy URL (SQLite in WAL mode by default; PostgreSQL for "
              "several hosts).",
    "tracking_uri": "The MLflow tracking store: a database URL, a folder or an `http://` server.",
    "devices": "The service's devices: `auto` (the GPUs NVML sees), `cpu:N` (N virtual slots) or a list "
               "`0,1,3`.",
    "executor": "Where jobs run: `local` (this host) or `ray` (a Ray cluster).",
    "ray_address": "The Ray cluster's Jobs API address, e.g. `http://HEAD:8265`.",
    "preflight": "Checks before each start: `quick` or `off`.",
    "warm": "Start Python attempts warm: forked from a pool with torch and the runtime imported, where the "
            "pool can make them exactly what a fresh interpreter would be ([warm starts](job-protocol.md#warm-starts)); "
            "`0`: every attempt starts a fresh interpreter.",
    "preflight_ttl": "Seconds a device that passed its checks is trusted without checking again.",
    "recheck_level": "The level of the checks idle devices get: `quick` or `full`.",
    "recheck_every": "Seconds between the checks of idle devices.",
    "monitor_every": "Seconds between samples of a running job's devices.",
    "hang_timeout": "Stop (and requeue) a job whose heartbeat is older than this many seconds; 0: never.",
    "llm_model": "The agent's LLM model name; unset: Optuna samplers propose instead.",
    "llm_base_url": "The OpenAI-compatible endpoint (`OPENAI_API_KEY` is read from the environment only).",
    "llm_price": "The LLM's price in USD per million tokens, `\"in,out\"` (prompt, completion), for models whose "
                 "price is not known; used for the session's cost estimate.",
    "preempt_after": "Seconds a job runs before it may be preempted.",
    "retry_backoff": "Seconds before a failed job's first retry; doubles with each retry.",
    "retry_backoff_cap": "The most seconds a retry waits.",
    "monitor_hits": "Throttle samples (or failing NVML calls) in a row before a device counts as faulty.",
    "nvml_timeout": "Seconds one NVML call may take.",
    "gpu_sample_interval": "Seconds between the service's samples of its GPUs' utilisation and memory (what "
                           "`top`, `usage` and a job's `system/gpu_utilization_percentage` show); `0`: none.",
    "container_engine": "For `--image` jobs: `podman`, `docker`, or `auto` (podman when installed).",
}

_JSON_FIELDS = {
    "id": "the job id (an integer)", "name": "the name given at submit", "state": "its state (job states)",
    "priority": "higher runs first", "gpus": "devices it needs, all at once",
    "devices": "the devices it holds now (or held last)", "attempts": "placements so far",
    "preemptions": "times it was preempted", "exit_code": "the last attempt's exit code",
    "mlflow_run_id": "its MLflow run (the same for every attempt)", "owner": "who submitted it",
    "experiment": "the experiment it runs, if any", "params": "the experiment's parameters",
    "argv": "the command", "cwd": "where it runs", "max_attempts": "attempts before it stays FAILED",
    "failures": "failed attempts so far", "grace": "seconds between SIGTERM and SIGKILL",
    "preemptible": "whether it may be preempted", "reason": "why it is in its state (or waits)",
    "host": "the service host that holds it", "pid": "its wrapper's process id", "log_path": "its output",
    "checkpoint_dir": "its checkpoint directory, the same for every attempt",
    "submitted_at": "UNIX seconds", "started_at": "UNIX seconds", "finished_at": "UNIX seconds",
    "not_before": "a retry waits until then (UNIX seconds)",
    "idempotency_key": "a submitter's key: the same key never queues twice",
    "time_limit": "seconds an attempt may run", "env": "the names of its extra variables (never values)",
    "env_file": "the env file's path", "image": "the container image as given",
    "image_id": "the image's content id it runs", "mounts": "bind mounts for the image",
}


_home: tempfile.TemporaryDirectory | None = None


def _import_code() -> None:
    """Import this checkout's packages with a throwaway home (removed when the build ends): the CLI resolves
    settings, and the build must neither read nor create the reader's own home, nor see their settings."""
    global _home
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if _home is None:
        _home = tempfile.TemporaryDirectory(prefix="autoresearch-docs-")
    for name in list(os.environ):
        if name.startswith("AUTORESEARCH_") or name in ("MLFLOW_TRACKING_URI", "OPENAI_BASE_URL"):
            del os.environ[name]
    os.environ["AUTORESEARCH_HOME"] = _home.name


def cli_reference() -> str:
    """Markdown: a section per command (the tree's order) with its `--help` as a person sees it at 80 columns."""
    _import_code()
    from orchestrator.faces.cli import app, main
    from orchestrator.faces.cli.helpfmt import command, walk

    os.environ["COLUMNS"] = "80"
    os.environ.pop("FORCE_COLOR", None)
    os.environ["NO_COLOR"] = "1"
    parts = []
    for path, cmd in walk(command(app)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*path, "--help"])
        text = "\n".join(line.rstrip() for line in out.getvalue().strip("\n").splitlines())
        title = " ".join(("autoresearch",) + path)
        level = "###" if len(path) <= 1 else "####"  # under the page's "Commands"
        parts.append(f"{level} `{title}`\n\n```text\n{text}\n```\n")
    return "\n".join(parts)


def _field_comments(cls: type) -> dict[str, str]:
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.+)$", line)
        if match:
            comments[match.group(1)] = match.group(2).strip()
    return comments


def settings_reference() -> str:
    """Markdown: a table of every setting, its environment variable, its default and what it means."""
    _import_code()
    from orchestrator.core import config

    comments = _field_comments(config.Settings)
    defaults = {f.name: f.default for f in dataclasses.fields(config.Settings)}
    defaults["db_url"] = "sqlite:///$AUTORESEARCH_HOME/queue.db"
    defaults["tracking_uri"] = "sqlite:///$AUTORESEARCH_HOME/mlflow.db"
    rows = ["| key (config.toml) | environment variable | default | meaning |", "|---|---|---|---|"]
    for name, (env, _) in config._SOURCES.items():
        default = defaults.get(name)
        shown = "-" if default is None or default is dataclasses.MISSING else f"`{default}`"
        meaning = _DESCRIBED.get(name) or comments.get(name, "")
        meaning = meaning[:1].upper() + meaning[1:]
        rows.append(f"| `{name}` | `{env}` | {shown} | {meaning.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"


def transitions_reference() -> str:
    """Markdown: every state and the states it may go to, as the store enforces them."""
    _import_code()
    from orchestrator.queue.states import ALLOWED

    rows = ["| from | may go to |", "|---|---|"]
    for src, dsts in ALLOWED.items():
        to = ", ".join(f"`{d.value}`" for d in sorted(dsts, key=list(ALLOWED).index)) or "nothing (final)"
        rows.append(f"| `{src.value}` | {to} |")
    return "\n".join(rows) + "\n"


def job_json_reference() -> str:
    """Markdown: the job object's fields in `queue --json` and `show --json`, in the order printed."""
    _import_code()
    from collections import defaultdict

    from orchestrator.queue.models import job_dict

    keys = list(job_dict(defaultdict(lambda: None)))
    rows = ["| field | meaning |", "|---|---|"]
    rows += [f"| `{key}` | {_JSON_FIELDS.get(key, '')} |" for key in keys]
    return "\n".join(rows) + "\n"


_GENERATORS = {"cli": cli_reference, "settings": settings_reference, "job-json": job_json_reference,
               "transitions": transitions_reference}
_MARKER = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    """Replace each generator marker on the page with what the code says at build time."""
    return _MARKER.sub(lambda m: _GENERATORS[m.group(1)](), markdown)
