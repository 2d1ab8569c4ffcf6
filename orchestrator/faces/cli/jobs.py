"""`submit`, `queue`, `show`, `cancel`, `logs`: the queue commands (fast: no torch or mlflow imports)."""

from __future__ import annotations

import datetime as dt
import sys
from typing import List, Optional

import typer

from orchestrator.api import jobs as api
from orchestrator.api import submitflags
from orchestrator.api.submitflags import BY_NAME
from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, print_columns, print_json, print_table, settings
from orchestrator.queue.listing import DEFAULT_LIMIT, Listing


def _when(ts: Optional[float]) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S") if ts else ""


def _date(ts: object) -> str:
    """A UNIX time as a date and time in the local zone, for people (`--json` keeps the seconds)."""
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return str(ts)
    return dt.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def _flag(name: str):
    """The typer option of a submit flag, as `orchestrator.api.submitflags` declares it."""
    flag = BY_NAME[name]
    return typer.Option(submitflags.default(flag), flag.name, help=flag.help, metavar=flag.metavar)


@app.command(context_settings={"allow_interspersed_args": False})
def submit(
    ctx: typer.Context,
    argv: Optional[List[str]] = typer.Argument(None, help="The command to run, after `--`."),
    name: str = _flag("--name"),
    priority: int = _flag("--priority"),
    gpus: str = _flag("--gpus"),
    gpu_memory: Optional[str] = _flag("--gpu-memory"),
    nodes: int = _flag("--nodes"),
    min_nodes: Optional[int] = _flag("--min-nodes"),
    max_attempts: int = _flag("--max-attempts"),
    grace: float = _flag("--grace"),
    no_preempt: bool = _flag("--no-preempt"),
    experiment: Optional[str] = _flag("--experiment"),
    param: List[str] = _flag("--param"),
    env: List[str] = _flag("--env"),
    env_file: Optional[str] = _flag("--env-file"),
    workdir: Optional[str] = _flag("--workdir"),
    image: Optional[str] = _flag("--image"),
    mount: List[str] = _flag("--mount"),
    no_track: bool = _flag("--no-track"),
    time_limit: Optional[str] = _flag("--time-limit"),
    project: Optional[str] = _flag("--project"),
    scavenger: bool = _flag("--scavenger"),
    deadline: Optional[str] = _flag("--deadline"),
    keep_checkpoint: Optional[str] = _flag("--keep-checkpoint"),
    as_json: bool = _flag("--json"),
) -> None:
    """Queue a command (after `--`) or an experiment run."""
    from orchestrator.faces.pyapi import jobapi as pyapi  # the Python API: one path for every face

    job = pyapi.submit_values(argv, ctx.params, settings())
    if as_json:
        print_json({**job.to_dict(), "service_running": job.service_running})
    else:
        print(job.id)
    if not job.service_running:
        info("note: no service is running for this home; the job waits in the queue until `autoresearch serve`")


# Numbers, states and times are never cut; names, owners, devices and reasons share what is left of the width
# (at 80 columns: about 10, 5, 7 and 6 characters), each cut with an ellipsis.
_RIGHT = {"right": True}
QUEUE_COLUMNS = [("id", _RIGHT), ("name", {"ratio": 3, "min_width": 8}), ("owner", {"ratio": 1, "min_width": 5}),
                 ("state", {}), ("prio", _RIGHT), ("gpus", _RIGHT), ("devices", {"ratio": 1, "min_width": 5}),
                 ("att", _RIGHT), ("pre", _RIGHT), ("exit", _RIGHT), ("submitted", {}),
                 ("reason", {"ratio": 2, "min_width": 6})]


@app.command()
def queue(
    all_jobs: bool = typer.Option(False, "--all", help="Every job, finished ones too (after the unfinished, "
                                  "newest first)."),
    limit: int = typer.Option(DEFAULT_LIMIT, "--limit", help="Show the first N jobs in listing order "
                              "(0: all of them)."),
    as_json: bool = typer.Option(False, "--json", help="The jobs as a JSON list (the same first N)."),
) -> None:
    """List jobs: running ones, then the waiting line in the order jobs will start (default: not finished)."""
    from orchestrator.faces.pyapi import jobapi as pyapi  # the Python API: one path for every face

    listed = pyapi.listing(all_jobs, limit, settings=settings())
    if as_json:
        print_json(listed.jobs)
        if listed.more:
            info(listed.more_line())
        return
    print_listing(listed, _plans() if any(j["state"] == "QUEUED" for j in listed.jobs) else {})


def _plans() -> dict[int, str]:
    from orchestrator.faces.views.snapshot import line_plans  # the plan `top` shows, for waiting jobs

    return line_plans(settings(), api.open_store(settings()))


def print_listing(listed: Listing, plans: Optional[dict] = None) -> None:
    """A listing as a table for people (one line per job, fitted to the terminal), then what it left out. A
    waiting job's reason is what the next plan does about it (`plans`, by id), as `top` says it."""
    plans = plans or {}
    print_columns(QUEUE_COLUMNS, [(j["id"], j["name"], j["owner"], j["state"], j["priority"], j["gpus"],
                                   ",".join(j["devices"]), j["attempts"], j["preemptions"], j["exit_code"],
                                   _when(j["submitted_at"]),
                                   plans.get(j["id"], j["reason"]) if j["state"] == "QUEUED" else j["reason"])
                                  for j in listed.jobs])
    if listed.more:
        print(listed.more_line())


@app.command()
def show(job_id: int = typer.Argument(..., metavar="ID"), as_json: bool = typer.Option(False, "--json")) -> None:
    """One job, with its events."""
    from orchestrator.faces.pyapi import jobapi as pyapi  # the Python API: one path for every face

    job = pyapi.record(job_id, settings())  # with `next`: what the plan does, as `queue` says
    if as_json:
        print_json(job)
        return
    events = job.pop("events")
    for key, value in job.items():
        if value in (None, "", [], {}):
            continue
        if key == "excluded_nodes":  # a job across nodes: node -> why, one line each
            value = [f"{node}: {why}" for node, why in sorted(value.items())]
        if key in ("excluded_nodes", "node_attempts"):
            value = ("\n" + " " * 18).join(value)
        print(f"{key:>16}: {_date(value) if key.endswith('_at') or key == 'not_before' else value}")
    print_table("events", ["time", "from", "to", "reason"],
                [(_date(e["at"]), e["from"] or "", e["to"], e["reason"]) for e in events])


@app.command()
def cancel(job_id: int = typer.Argument(..., metavar="ID")) -> None:
    """Cancel a job (a running one gets SIGTERM, then SIGKILL after its grace)."""
    from orchestrator.faces.pyapi import jobapi as pyapi  # the Python API: one path for every face

    job = pyapi.cancel(job_id, settings=settings())
    print(f"job {job.id}: {job.state}")


@app.command()
def logs(job_id: int = typer.Argument(..., metavar="ID"),
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job finishes.")) -> None:
    """The job's output."""
    from orchestrator.faces.pyapi.jobapi import write_logs

    write_logs(job_id, sys.stdout.buffer, follow=follow, settings=settings(), say=info)
