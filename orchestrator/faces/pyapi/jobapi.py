"""Jobs from Python: `submit`, `cancel`, `jobs`, `job`, `wait`, `logs`; the one path of the CLI's and MCP's queue
commands too (`submit_values`, `listing`, `record`).

Keyword arguments are `autoresearch submit`'s flags (`--time-limit 5m` is `time_limit="5m"` or `time_limit=300`;
`--no-preempt` is `no_preempt=True`); the repeatable ones take a list of `KEY=VALUE` strings or a dict (`params`
for `--param`, `env` for `--env`, `mounts` for `--mount`). Their values go through the same declaration and checks
as the CLI's (`orchestrator.api.submitflags`), so a bad value raises `BadInput` with the line the CLI prints.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import IO, Any, Callable, Mapping, Optional, Sequence, Union

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.faces.pyapi.types import Job

Pairs = Union[Mapping[str, Any], Sequence[str], None]


def as_input_error(exc: ValueError) -> BaseException:
    """An experiment's own input errors (unknown experiment, a bad parameter) as BadInput, with their line."""
    from experiments.registry import UnknownExperiment
    from experiments.space import SpaceError

    return BadInput(str(exc)) if isinstance(exc, (SpaceError, UnknownExperiment)) else exc


def _pairs(value: Pairs) -> list[str]:
    """KEY=VALUE strings from a dict or a list of them (a flag given several times)."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def submit_values(argv: Optional[Sequence[str]], values: Mapping[str, Any], settings: Optional[Settings] = None,
                  *, params: Optional[Mapping[str, Any]] = None, owner: Optional[str] = None) -> Job:
    """Queue a job from submit's flag values by key (`orchestrator.api.submitflags`: what the CLI parsed). An
    experiment's `params` may be given typed (a dict) rather than as the `param` flag's KEY=VALUE strings."""
    from orchestrator.api.submitflags import spec_options
    from orchestrator.queue.models import JobSpec

    options = spec_options(values)
    if owner is not None:
        options["owner"] = owner
    experiment, given = values.get("experiment"), list(values.get("param") or [])
    try:
        if experiment:
            if argv:
                raise BadInput("give either --experiment or a command after `--`, not both")
            chosen = dict(params) if params is not None else api.parse_params(given)
            spec = api.experiment_spec(experiment, chosen, **options)
        else:
            if given or params:
                raise BadInput("--param needs --experiment")
            spec = JobSpec(argv=list(argv or []), **options)
    except ValueError as exc:
        raise as_input_error(exc) from None
    job, served = api.submit(spec, settings or Settings.load())
    return Job.from_dict(job.to_dict(), service_running=served)


def submit(command: Union[Sequence[str], str, None] = None, *, experiment: Optional[str] = None,
           params: Pairs = None, name: str = "", priority: int = 10, gpus: Union[int, float, str] = 1,
           gpu_memory: Optional[str] = None, nodes: int = 1, min_nodes: Optional[int] = None,
           max_attempts: int = 1, grace: Optional[float] = None,
           no_preempt: bool = False, env: Pairs = None, env_file: Optional[str] = None,
           workdir: Optional[str] = None, image: Optional[str] = None, mounts: Optional[Sequence[str]] = None,
           no_track: bool = False, time_limit: Union[str, float, None] = None, project: Optional[str] = None,
           scavenger: bool = False, deadline: Union[str, float, datetime, None] = None,
           keep_checkpoint: Optional[str] = None, owner: Optional[str] = None,
           settings: Optional[Settings] = None) -> Job:
    """Queue a command (an argv list, run without a shell; a string is split like a shell line) or a run of an
    `experiment` with `params`, as `autoresearch submit` does. Returns the queued `Job`; its `service_running`
    says whether a service will pick it up (if not, it waits in the queue). Raises `BadInput` with the CLI's line.

        job = submit(["python", "train.py", "--lr", "3e-4"], gpus=2, time_limit="2h")
        job = submit(experiment="digits", params={"lr": 0.05}, priority=20)

    `owner`: who the job is for (default: "human", as for the CLI); `settings`: another home or database
    (default: `Settings.load()`, from the environment and config.toml).
    """
    import shlex

    if isinstance(command, str):
        command = shlex.split(command)
    typed = isinstance(params, Mapping)
    values = dict(name=name, priority=priority, gpus=gpus, gpu_memory=gpu_memory, nodes=nodes, min_nodes=min_nodes,
                  max_attempts=max_attempts,
                  grace=Settings.stop_grace if grace is None else grace, no_preempt=no_preempt,
                  experiment=experiment, param=[] if typed else _pairs(params), env=_pairs(env),
                  env_file=env_file, workdir=workdir, image=image, mount=list(mounts or []), no_track=no_track,
                  time_limit=time_limit, project=project, scavenger=scavenger,
                  deadline=deadline.isoformat() if isinstance(deadline, datetime) else deadline,
                  keep_checkpoint=keep_checkpoint)
    return submit_values(command, values, settings, params=params if typed else None, owner=owner)


def cancel(job_id: int, *, settings: Optional[Settings] = None) -> Job:
    """Cancel a job, as `autoresearch cancel` does (a running one gets SIGTERM, then SIGKILL after its grace).
    Returns the job in its new state; `BadInput` when it has already finished or does not exist."""
    return Job.from_dict(api.cancel(int(job_id), settings or Settings.load()).to_dict())


def listing(all: bool = False, limit: Optional[int] = None, owner: Optional[str] = None,
            settings: Optional[Settings] = None) -> Any:
    """The listing `autoresearch queue` and MCP's list_jobs show (`orchestrator.queue.listing.Listing`)."""
    from orchestrator.queue.listing import DEFAULT_LIMIT, check_limit

    store = api.open_store(settings or Settings.load())
    return store.listing(finished=all, limit=check_limit(DEFAULT_LIMIT if limit is None else limit), owner=owner)


def jobs(all: bool = False, *, limit: int = 0, owner: Optional[str] = None,
         settings: Optional[Settings] = None) -> list[Job]:
    """Jobs as `autoresearch queue` lists them: those holding devices, then the waiting line in the order they
    will start; with `all`, finished jobs too (newest first). `limit`: the first N (0, the default: every one);
    `owner`: one owner's ("human", "mcp:NAME", or a session id for its trials)."""
    return [Job.from_dict(j) for j in listing(all, limit, owner, settings).jobs]


def record(job_id: int, settings: Optional[Settings] = None) -> dict[str, Any]:
    """One job's record with its events, as `show --json` prints it (`next`: what the next plan does with it)."""
    from orchestrator.faces.views.snapshot import job_record

    settings = settings or Settings.load()
    return job_record(settings, api.open_store(settings), int(job_id))


def job(job_id: int, *, settings: Optional[Settings] = None) -> Job:
    """One job with its event log (`autoresearch show ID`); `BadInput` when there is no such job."""
    return Job.from_dict(record(job_id, settings))


def wait(job_id: Union[int, Job], timeout: Optional[float] = None, *, poll: float = 0.5,
         settings: Optional[Settings] = None) -> Job:
    """Block until the job has finished (SUCCEEDED, FAILED or CANCELLED) and return it; `TimeoutError` after
    `timeout` seconds (None: wait as long as it takes). A job waits for a service: see `orchestrator.serve`."""
    job_id = job_id.id if isinstance(job_id, Job) else int(job_id)
    store = api.open_store(settings or Settings.load())
    deadline = None if timeout is None else time.monotonic() + timeout
    while not store.get(job_id).final:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} is still {store.get(job_id).state} after {timeout} s")
        time.sleep(poll)
    return job(job_id, settings=settings)


def logs(job_id: Union[int, Job], *, settings: Optional[Settings] = None) -> str:
    """The job's output so far (`autoresearch logs ID`): '' before it starts."""
    import io

    out = io.BytesIO()
    write_logs(job_id, out, settings=settings)
    return out.getvalue().decode("utf-8", errors="replace")


def write_logs(job_id: Union[int, Job], out: IO[bytes], *, follow: bool = False,
               settings: Optional[Settings] = None, say: Callable[[str], None] = lambda line: None) -> None:
    """Write the job's output to `out` (`autoresearch logs ID [--follow]`): its log file (gzipped by retention
    once finished), or its Ray log where it ran on a Ray cluster. `follow`: wait for it to start, then keep
    writing until it finishes (BadInput when it finished with no output). `say`: a line for a person (why
    there is nothing yet)."""
    import gzip
    import os
    import shutil

    store = api.open_store(settings or Settings.load())
    job_id = job_id.id if isinstance(job_id, Job) else int(job_id)
    job = store.get(job_id)
    path = job.log_path
    if (not path or not os.path.exists(path)) and (job.proc_start or "").startswith("ray:"):
        from orchestrator.executors.ray.logs import stream_logs  # ran on a Ray cluster; its log file is elsewhere

        stream_logs(job, out, follow=follow)
        return
    if follow:
        if not path or not os.path.exists(path):
            say(f"job {job_id} is {job.state}: waiting for it to start (Ctrl-C stops waiting)")
        while not path or not os.path.exists(path):
            if job.final:
                raise BadInput(f"job {job_id} produced no output")
            time.sleep(0.5)
            job = store.get(job_id)
            path = job.log_path
    elif not path or not os.path.exists(path):
        if path and os.path.exists(path + ".gz"):  # a finished job's log, compressed by retention
            with gzip.open(path + ".gz", "rb") as fh:
                shutil.copyfileobj(fh, out)
            out.flush()
            return
        say(f"job {job_id} has no output yet ({job.state})")
        return
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(65536)
            if chunk:
                out.write(chunk)
                out.flush()
                continue
            if not follow:
                return
            if store.get(job_id).final:
                out.write(fh.read())
                out.flush()
                return
            time.sleep(0.3)
