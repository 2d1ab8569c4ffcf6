"""MkDocs hook: the reference pages that are generated from the code at build time, so they cannot drift.

A page holds a marker line, replaced here by what the code says now:
- `<!-- generated: cli -->`: every command's `--help` at 80 columns, from the typer app (`orchestrator.faces.cli`),
  through the same click tree the console script uses.
- `<!-- generated: settings -->`: every `Settings` key with its environment variable and default
  (`orchestrator.core.config`), described by `_DESCRIBED` below, else by the comment on its field.
- `<!-- generated: transitions -->`: every job state and the states the store lets it go to.
- `<!-- generated: job-json -->`: the fields of a job in `queue --json` / `show --json`, in their order.
- `<!-- generated: python-api -->`: every name `import orchestrator` offers, in `_API_SECTIONS`' order, with its
  signature and docstring (a class with its fields, properties and methods).
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
    "executor": "Where jobs run: `local` (this host), `ray` (a Ray cluster) or `slurm` (a Slurm cluster).",
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
    "llm_model": "The LLM's model name (default `gpt-4o-mini`); a session's `--model` wins over it.",
    "llm_base_url": "The OpenAI-compatible endpoint; set (or `OPENAI_API_KEY` set), sessions propose with the "
                    "LLM by default, else with Optuna's TPE (`OPENAI_API_KEY` is read from the environment only).",
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
    "slurm_partition": "`--executor slurm`: the partition attempts are submitted to (unset: the cluster's default).",
    "slurm_account": "`--executor slurm`: the account charged (unset: the user's default).",
    "slurm_qos": "`--executor slurm`: the QoS asked for (unset: the user's default).",
    "llm_budget_usd": "A session's default cap on its LLM spend in USD (`start --llm-budget-usd` wins); at the cap "
                      "the session pauses, resumable with a higher one.",
    "llm_budget_tokens": "A session's default cap on its LLM tokens (`start --llm-budget-tokens` wins).",
    "usage_half_life": "Projects sharing the devices: the half-life in seconds of the past usage fair sharing "
                       "weighs.",
    "backfill": "`on`: jobs with a time limit may start behind a blocked job when they end before it could "
                "start; `off`: never.",
    "retention": "`ranked`: keep the checkpoints that matter (the best `keep_best` trials of each session, "
                 "baselines' and confirmations' latest, people's jobs as `keep_people` says); `off`: keep every "
                 "checkpoint.",
    "keep_best": "With `retention = \"ranked\"`: the trials of each session whose checkpoints are kept.",
    "keep_people": "With `retention = \"ranked\"`: hand-submitted jobs' checkpoints kept: `all`, `latest` or "
                   "`none`.",
    "gc_every": "Seconds between the service's retention passes.",
    "cgroup": "How the local executor tracks a job's processes: `auto` (a cgroup v2 where one is writable, else "
              "psutil), `off` (psutil always).",
    "node": "This host's identity in a shared queue (unset: the host name plus a hash of the home).",
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
    """Each field's comment: the one on its line, else the comment lines just above it (when they speak of
    that field alone: a block above several fields describes none of them here)."""
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        block = re.match(r"\s+#\s?(.*)$", line)
        if block:
            above.append(block.group(1).strip())
            continue
        match = re.match(r"\s+(\w+): [^=]+=(.*)$", line)
        if match:
            inline = re.search(r"#\s*(.+)$", match.group(2))
            if inline:
                comments[match.group(1)] = inline.group(1).strip()
            elif above:
                comments[match.group(1)] = " ".join(above)
        above = []
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


# The Python API's reference page, by section; every name of `orchestrator.__all__` must be in one (the build
# fails otherwise, so a new name cannot go undocumented).
_API_SECTIONS = {
    "Jobs": ["submit", "cancel", "jobs", "job", "wait", "logs"],
    "A service in this process": ["serve", "Service"],
    "Agent sessions": ["start_session", "session", "sessions", "Session"],
    "Results and experiments": ["leaderboard", "experiment", "experiments"],
    "Types": ["Job", "JobEvent", "Leaderboard", "Entry", "Event", "Verdict", "Experiment"],
    "Errors": ["BadInput", "OrchestratorError"],
}


def _signature(name: str, obj: object) -> str:
    """`name(params) -> return`, one parameter a line when it would not fit in 100 columns."""
    class Raw(str):  # an annotation as written (they are strings under `from __future__ import annotations`)
        def __repr__(self) -> str:
            return str(self)

    sig = inspect.signature(obj)
    params, star = [], False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        params.append(str(p if p.annotation is p.empty else p.replace(annotation=Raw(p.annotation))))
    returns = str(sig.return_annotation).strip("'\"")  # a forward reference is written in quotes
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {returns}"
    line = f"{name}({', '.join(params)}){ret}"
    if len(line) <= 100:
        return line
    return f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){ret}"


def _doc(obj: object) -> str:
    return inspect.getdoc(obj) or ""


def _api_class(name: str, cls: type) -> list[str]:
    """A class: its docstring, its fields (a dataclass) or constructor, then its public properties and methods."""
    out = [_doc(cls), ""]
    if dataclasses.is_dataclass(cls):
        rows = ["| field | type | default |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = ("" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                       else "`{}`" if f.default is dataclasses.MISSING else f"`{f.default!r}`")
            rows.append(f"| `{f.name}` | `{f.type}` | {default} |".replace("`{}`", "empty"))
        out += rows + [""]
    elif not issubclass(cls, BaseException):
        out += ["```python", _signature(name, cls), "```", ""]
    for attr, value in vars(cls).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, property):
            out += [f"#### `{name}.{attr}`", "", _doc(value), ""]
        elif inspect.isfunction(value) or isinstance(value, classmethod):
            fn = value.__func__ if isinstance(value, classmethod) else value
            shown = _signature(f"{name}.{attr}", fn).replace("(self, ", "(").replace("(self)", "()")
            shown = shown.replace("(cls, ", "(")
            out += [f"#### `{name}.{attr}`", "", "```python", shown, "```", "", _doc(fn), ""]
    return out


def python_api_reference() -> str:
    """Markdown: a section per group of the Python API, an entry per name with its signature and docstring."""
    _import_code()
    import orchestrator

    listed = [n for names in _API_SECTIONS.values() for n in names]
    if sorted(listed) != sorted(orchestrator.__all__):
        raise RuntimeError(f"docs/_hooks/reference.py _API_SECTIONS and orchestrator.__all__ differ: "
                           f"{sorted(set(listed) ^ set(orchestrator.__all__))}")
    parts = []
    for section, names in _API_SECTIONS.items():
        parts += [f"## {section}", ""]
        for name in names:
            obj = getattr(orchestrator, name)
            parts += [f"### `orchestrator.{name}`", ""]
            if inspect.isclass(obj):
                parts += _api_class(name, obj)
            else:
                parts += ["```python", _signature(name, obj), "```", "", _doc(obj), ""]
    return "\n".join(parts)


_GENERATORS = {"cli": cli_reference, "settings": settings_reference, "job-json": job_json_reference,
               "transitions": transitions_reference, "python-api": python_api_reference}
_MARKER = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    """Replace each generator marker on the page with what the code says at build time."""
    return _MARKER.sub(lambda m: _GENERATORS[m.group(1)](), markdown)
