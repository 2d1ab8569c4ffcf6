"""`submit`, `queue`, `show`, `cancel`, `logs`: the queue commands (fast: no torch or mlflow imports)."""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from typing import List, Optional

import typer

from orchestrator.api import jobs as api
from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, print_columns, print_json, print_table, settings
from orchestrator.core.errors import BadInput
from orchestrator.queue.listing import DEFAULT_LIMIT, Listing, check_limit
from orchestrator.queue.models import JobSpec


def _when(ts: Optional[float]) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S") if ts else ""


def _date(ts: object) -> str:
    """A UNIX time as a date and time in the local zone, for people (`--json` keeps the seconds)."""
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return str(ts)
    return dt.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


@app.command(context_settings={"allow_interspersed_args": False})
def submit(
    argv: Optional[List[str]] = typer.Argument(None, help="The command to run, after `--`."),
    name: str = typer.Option("", "--name", help="A name for people."),
    priority: int = typer.Option(10, "--priority", help="Higher wins; agent trials use 0."),
    gpus: int = typer.Option(1, "--gpus", help="Devices the job needs (all at once)."),
    max_attempts: int = typer.Option(1, "--max-attempts", help="Attempts before the job stays FAILED."),
    grace: float = typer.Option(30.0, "--grace", help="Seconds between SIGTERM and SIGKILL."),
    no_preempt: bool = typer.Option(False, "--no-preempt", help="Never preempt this job."),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="Run an experiment: a bundled name, a "
                                             "folder holding autoresearch.toml (or its path), or a name used "
                                             "before."),
    param: List[str] = typer.Option([], "--param", help="KEY=VALUE for --experiment (repeatable)."),
    env: List[str] = typer.Option([], "--env", help="KEY=VALUE added to the job's environment (repeatable)."),
    env_file: Optional[str] = typer.Option(None, "--env-file", help="A dotenv file of KEY=VALUE lines added "
                                           "to the job's environment (--env wins); values are never shown."),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="Directory the job runs in (default: here)."),
    image: Optional[str] = typer.Option(None, "--image", help="Run the job in this container image "
                                        "(podman, or docker: the container_engine setting)."),
    mount: List[str] = typer.Option([], "--mount", help="SRC:DST[:ro] bind mount for --image (repeatable)."),
    no_track: bool = typer.Option(False, "--no-track", help="Create no MLflow run for this job."),
    time_limit: Optional[str] = typer.Option(None, "--time-limit", help="Stop an attempt that runs longer "
                                             "(90s, 5m, 2h): SIGTERM, SIGKILL after --grace, then FAILED."),
    project: Optional[str] = typer.Option(None, "--project", help="The project charged for the job "
                                          "(`autoresearch projects`; default: the default project)."),
    scavenger: bool = typer.Option(False, "--scavenger", help="Use only idle devices; preempted by any job, "
                                   "first; not charged to the project."),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="Finish by this time (\"2026-12-03 18:00\", "
                                           "ISO, or 2h): not started when it can no longer (now + --time-limit)."),
    keep_checkpoint: Optional[str] = typer.Option(None, "--keep-checkpoint", help="What the job keeps of its "
                                                  "checkpoint dir once it ends: all, latest or none (default: "
                                                  "the keep_people setting)."),
    as_json: bool = typer.Option(False, "--json", help="Print the job as JSON."),
) -> None:
    """Queue a command (after `--`) or an experiment run."""
    from orchestrator.core.durations import parse_duration
    from orchestrator.api.sharing import parse_deadline

    if scavenger and no_preempt:
        raise BadInput("--scavenger jobs are always preemptible: drop --no-preempt")
    sharing = dict(project=project or "default", scavenger=scavenger,
                   deadline=None if deadline is None else parse_deadline(deadline))
    options = dict(**sharing, name=name, priority=priority, gpus=gpus, max_attempts=max_attempts, grace=grace,
                   preemptible=not no_preempt, env=api.parse_params(env), track=not no_track,
                   env_file=env_file, cwd=workdir, image=image, mounts=list(mount) or None,
                   keep_checkpoint=keep_checkpoint,
                   time_limit=None if time_limit is None else parse_duration(time_limit, what="--time-limit"))
    if experiment:
        if argv:
            raise BadInput("give either --experiment or a command after `--`, not both")
        spec = api.experiment_spec(experiment, api.parse_params(param), **options)
    else:
        if param:
            raise BadInput("--param needs --experiment")
        spec = JobSpec(argv=list(argv or []), **options)
    job, served = api.submit(spec, settings())
    if as_json:
        print_json({**job.to_dict(), "service_running": served})
    else:
        print(job.id)
    if not served:
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
    store = api.open_store(settings())
    listed = store.listing(finished=all_jobs, limit=check_limit(limit))
    if as_json:
        print_json(listed.jobs)
        if listed.more:
            info(listed.more_line())
        return
    print_listing(listed, _plans(store) if any(j["state"] == "QUEUED" for j in listed.jobs) else {})


def _plans(store) -> dict[int, str]:
    from orchestrator.faces.views.snapshot import line_plans  # the plan `top` shows, for waiting jobs

    return line_plans(settings(), store)


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
    store = api.open_store(settings())
    job = store.record(job_id)
    if as_json:
        print_json(job)
        return
    if job["state"] == "QUEUED" and job_id in (plans := _plans(store)):
        job["next"] = plans[job_id]  # what the next plan does about it, as `queue` and `top` say
    events = job.pop("events")
    for key, value in job.items():
        if value not in (None, "", [], {}):
            print(f"{key:>16}: {_date(value) if key.endswith('_at') or key == 'not_before' else value}")
    print_table("events", ["time", "from", "to", "reason"],
                [(_date(e["at"]), e["from"] or "", e["to"], e["reason"]) for e in events])


@app.command()
def cancel(job_id: int = typer.Argument(..., metavar="ID")) -> None:
    """Cancel a job (a running one gets SIGTERM, then SIGKILL after its grace)."""
    job = api.cancel(job_id, settings())
    print(f"job {job.id}: {job.state}")


@app.command()
def logs(job_id: int = typer.Argument(..., metavar="ID"),
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job finishes.")) -> None:
    """The job's output."""
    store = api.open_store(settings())
    job = store.get(job_id)
    path = job.log_path
    if (not path or not os.path.exists(path)) and (job.proc_start or "").startswith("ray:"):
        from orchestrator.executors.ray.logs import stream_logs  # ran on a Ray cluster; its log file is elsewhere

        stream_logs(job, sys.stdout.buffer, follow=follow)
        return
    if follow:
        if not path or not os.path.exists(path):
            info(f"job {job_id} is {job.state}: waiting for it to start (Ctrl-C stops waiting)")
        while not path or not os.path.exists(path):
            if job.final:
                raise BadInput(f"job {job_id} produced no output")
            time.sleep(0.5)
            job = store.get(job_id)
            path = job.log_path
    elif not path or not os.path.exists(path):
        if path and os.path.exists(path + ".gz"):  # a finished job's log, compressed by retention
            import gzip
            import shutil

            with gzip.open(path + ".gz", "rb") as fh:
                shutil.copyfileobj(fh, sys.stdout.buffer)
            sys.stdout.flush()
            return
        info(f"job {job_id} has no output yet ({job.state})")
        return
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(65536)
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                continue
            if not follow:
                return
            job = store.get(job_id)
            if job.final:
                rest = fh.read()
                sys.stdout.buffer.write(rest)
                sys.stdout.flush()
                return
            time.sleep(0.3)
