"""`autoresearch mcp`: the queue, its devices, results and agent sessions as an MCP server for outside agents.

Built on the official SDK (`mcp.server.mcpserver.MCPServer`): stdio by default, streamable HTTP on request.
Every tool calls the Python API the CLI calls (`orchestrator.faces.pyapi`: submit, listing, record, cancel, boards,
start_session, Session), takes JSON arguments described by a JSON schema (from the type hints) and answers JSON.

Rules for outside agents:
- Bad arguments come back as MCP tool errors carrying the CLI's one-line message (what `autoresearch` prints
  before exiting 2); the server keeps running.
- Nothing an agent sends reaches a shell: a command is an argv list, executed as is by the executor.
- Jobs are owned by `mcp:<client name>` (shown by `queue`), and their priority is capped (`--max-priority`,
  default 5, below the manual default 10; sessions' trials too) so an outside agent cannot preempt people's
  jobs unless allowed. A client cancels only the jobs it owns unless the server runs with `--allow-cancel-any`.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Callable, Optional, Union

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput, OrchestratorError
from orchestrator.faces.pyapi import jobapi as pyapi
from orchestrator.queue.listing import DEFAULT_LIMIT
from orchestrator.queue.models import check_priority

DEFAULT_MAX_PRIORITY = 5
DEFAULT_PRIORITY = 0  # what an agent's job gets unless it asks: agent work, like the agent's own trials
MAX_LOG_BYTES = 256 * 1024  # one job_logs answer; page on with `offset`


def _input_error(exc: BaseException) -> bool:
    from experiments.registry import UnknownExperiment
    from experiments.space import SpaceError

    return isinstance(exc, (BadInput, SpaceError, UnknownExperiment))


class Refused(ToolError):
    """A tool refused its input: the message is the CLI's one line, sent to the client without the SDK's prefix."""


class Server(MCPServer):
    """MCPServer whose tool errors are one line: a refusal's own message, or which argument failed its schema."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        from pydantic import ValidationError

        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, Refused):
                raise Refused(str(cause)) from None
            if isinstance(cause, ValidationError):
                raise Refused("; ".join(_one_line(err) for err in cause.errors())) from None
            raise


def _one_line(err: dict) -> str:
    where = ".".join(str(part) for part in err.get("loc", ())) or "arguments"
    if err.get("type") == "missing":
        return f"missing argument {where}"
    return f"bad argument {where}: {err.get('msg', 'invalid')}, got {err.get('input')!r}"[:300]


def _tool(fn: Callable) -> Callable:
    """Turn the library's errors into MCP tool errors with the CLI's one-line messages."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ToolError:
            raise
        except (OrchestratorError, ValueError) as exc:
            if _input_error(exc):
                raise Refused(str(exc)) from None
            if isinstance(exc, OrchestratorError):
                raise Refused(f"error: {exc}") from None
            raise
    return wrapper


def client_owner(ctx: Optional[Context]) -> str:
    """`mcp:<client name>` from the client's initialize request (`mcp:client` when it sent none)."""
    name = ""
    try:
        params = ctx.session.client_params if ctx is not None else None
        name = params.client_info.name if params is not None else ""
    except Exception:  # transports without an initialize handshake carry no client info
        name = ""
    name = re.sub(r"[^A-Za-z0-9_.@/-]+", "-", name or "").strip("-")[:40]
    return f"mcp:{name or 'client'}"


def check_log_window(tail: Optional[int], offset: Optional[int]) -> None:
    """BadInput unless at most one of tail and offset is given, and it is not negative."""
    if tail is not None and offset is not None:
        raise BadInput("give either tail or offset, not both")
    if tail is not None and tail < 0:
        raise BadInput(f"tail must be >= 0, got {tail}")
    if offset is not None and offset < 0:
        raise BadInput(f"offset must be >= 0, got {offset}")


def read_log(job: Any, *, tail: Optional[int] = None, offset: Optional[int] = None,
             max_bytes: int = MAX_LOG_BYTES) -> dict:
    """A piece of a job's output: the last `tail` lines, or the bytes from `offset` (at most `max_bytes`).

    Returns text, the offset it starts at, `next_offset` to continue from, the file's size so far, and whether
    the job has finished (then nothing more will come)."""
    check_log_window(tail, offset)
    path = job.log_path
    base = {"job_id": job.id, "state": job.state, "final": job.final}
    if not path or not os.path.exists(path):
        return {**base, "text": "", "offset": 0, "next_offset": 0, "size": 0}
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        if tail is not None:
            start = max(0, size - max_bytes)
            fh.seek(start)
            data = fh.read(size - start)
            lines = data.splitlines(keepends=True)
            keep = lines[-tail:] if tail else []
            data = b"".join(keep)
            start = size - len(data)
        else:
            start = min(offset or 0, size)
            fh.seek(start)
            data = fh.read(max_bytes)
    return {**base, "text": data.decode("utf-8", errors="replace"), "offset": start,
            "next_offset": start + len(data), "size": size}


def run_metrics(job: Any, settings: Settings, metric: Optional[str] = None) -> dict:
    """A job's MLflow metric history: {metric: [[step, value], ...]} (every metric, or the one named)."""
    from orchestrator.tracking.client import Tracker

    if not job.mlflow_run_id:
        return {"job_id": job.id, "run_id": None, "metrics": {}}
    tracker = Tracker.from_settings(settings)
    names = [metric] if metric else sorted(tracker.client.get_run(job.mlflow_run_id).data.metrics)
    return {"job_id": job.id, "run_id": job.mlflow_run_id,
            "metrics": {name: [list(p) for p in tracker.history(job.mlflow_run_id, name)] for name in names}}


def build_server(settings: Settings, *, max_priority: int = DEFAULT_MAX_PRIORITY,
                 project: Optional[str] = None, allow_cancel_any: bool = False) -> MCPServer:
    """The MCP server over this home's queue (tools and search-space resources). `project`: the project every
    job and session of its clients is charged to (None: the one each names, else the default project);
    `allow_cancel_any`: clients may cancel any job, not only those they own."""
    check_priority(max_priority)
    server = Server("autoresearch", log_level="WARNING", instructions=(
        "A GPU job queue with priorities and preemption, and research agents. Submit commands (argv lists) or "
        "bundled experiments with params (see the experiment resources for their search spaces); watch jobs "
        f"with get_job/job_logs/run_metrics. Priorities above {max_priority} are refused by this server."))

    def store():
        return api.open_store(settings)

    def capped(priority: int) -> int:
        check_priority(priority)
        if priority > max_priority:
            raise BadInput(f"--priority {priority} is above this server's cap of {max_priority} "
                           f"(a person may raise it: autoresearch mcp --max-priority N)")
        return priority

    def charged(name: Optional[str]) -> str:
        from orchestrator.api.sharing import resolve_project

        if project is not None and name not in (None, "", project):
            raise BadInput(f"project {name!r}: this server charges its clients' work to {project!r} "
                           "(a person may change it: autoresearch mcp --project P)")
        return resolve_project(project or name, settings, store())

    @server.tool()
    @_tool
    def submit_job(ctx: Context, command: Optional[list[str]] = None, experiment: Optional[str] = None,
                   params: Optional[dict[str, Any]] = None, name: str = "", priority: int = DEFAULT_PRIORITY,
                   gpus: float = 1, gpu_memory: Optional[str] = None, max_attempts: int = 1,
                   grace: float = Settings.stop_grace, preemptible: bool = True,
                   time_limit: Optional[str] = None, env: Optional[dict[str, str]] = None,
                   cwd: Optional[str] = None, project: Optional[str] = None, scavenger: bool = False,
                   deadline: Optional[str] = None, nodes: int = 1,
                   min_nodes: Optional[int] = None) -> dict[str, Any]:
        """Queue a job: `command` (an argv list, run without a shell) or `experiment` with `params`.

        project: the project charged (see the usage tool); scavenger: only idle devices, preempted first, not
        charged; deadline: finish by then ("2026-12-03 18:00", ISO, or "2h"), else it is not started.
        gpus: whole devices, or a share of one GPU (0.5, 0.25, ... down to 1/16) beside other jobs;
        gpu_memory: the GPU memory such a job needs ("10GiB").
        nodes: nodes the job runs across, `gpus` on each (the Slurm executor); min_nodes: the fewest it may
        start on (its checkpoint reshards on load).

        priority: higher wins (people's jobs default to 10; this server caps what it accepts).
        time_limit: e.g. "90s", "5m", "2h" (stopped and FAILED past it). cwd: an existing directory (default:
        the server's working directory). env: extra environment variables for the job.
        Returns the job (id, state, ...) and whether a service is running to pick it up."""
        if scavenger and not preemptible:
            raise BadInput("--scavenger jobs are always preemptible: drop --no-preempt")
        if cwd is not None and not os.path.isdir(cwd):
            raise BadInput(f"cwd {cwd!r} is not a directory")
        if experiment and command:
            raise BadInput("give either experiment or command, not both")
        if params and not experiment:
            raise BadInput("params need an experiment")
        job = pyapi.submit(list(command or []), experiment=experiment, params=dict(params or {}), name=name,
                           priority=capped(priority), gpus=gpus, gpu_memory=gpu_memory, nodes=nodes,
                           min_nodes=min_nodes, max_attempts=max_attempts, grace=grace, no_preempt=not preemptible,
                           env=dict(env or {}), workdir=cwd,
                           time_limit=time_limit, project=charged(project), scavenger=scavenger, deadline=deadline,
                           owner=client_owner(ctx), settings=settings)
        return {**job.to_dict(), "service_running": job.service_running}

    @server.tool()
    @_tool
    def list_jobs(all: bool = False, owner: Optional[str] = None, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
        """Unfinished jobs (every job with all=true), optionally only one owner's (e.g. your own, "mcp:<client
        name>", or an agent session's id): the first `limit` (0: all) with those holding devices first, then the
        waiting line in the order jobs will start (then, with all, finished jobs newest first). `total`, `more`
        and `counts` (by state) cover every matching job, listed or not."""
        return pyapi.listing(all, limit, owner, settings).to_dict()

    @server.tool()
    @_tool
    def get_job(job_id: int) -> dict[str, Any]:
        """One job with its event log (every state transition with time and reason) and, while it waits, `next`:
        what the next plan does about it (as `queue` says)."""
        return pyapi.record(job_id, settings)

    @server.tool()
    @_tool
    def job_logs(job_id: int, tail: Optional[int] = None, offset: Optional[int] = None) -> dict[str, Any]:
        """A job's output: the last `tail` lines, or the text from byte `offset` (default 0; page on with
        next_offset until final is true and no text comes back)."""
        check_log_window(tail, offset)
        return read_log(store().get(job_id), tail=tail, offset=offset)

    @server.tool()
    @_tool
    def cancel_job(ctx: Context, job_id: int) -> dict[str, Any]:
        """Cancel one of your own jobs (owner mcp:<client name>); a running one gets SIGTERM, then SIGKILL after
        its grace. Other people's jobs are refused unless the server was started with --allow-cancel-any."""
        me, owner = client_owner(ctx), store().get(job_id).owner
        if not allow_cancel_any and owner != me:
            raise BadInput(f"job {job_id} belongs to {owner or 'nobody'}, not {me}: this server lets a client "
                           "cancel only its own jobs (a person may allow more: autoresearch mcp --allow-cancel-any)")
        return pyapi.cancel(job_id, settings=settings).to_dict()

    @server.tool()
    @_tool
    def list_devices() -> dict[str, Any]:
        """Devices (state, reason, last check), the live services that schedule them, and `disk_low`: why
        services start no job for want of disk space (empty when all have room)."""
        s = store()
        live = api.live_services(s)
        return {"devices": [d.to_dict() for d in s.hosts.devices()],
                "services": [{"host": r.host, "pid": r.pid, "devices": list(r.devices or []),
                              "heartbeat_at": r.heartbeat_at, "disk": r.disk} for r in live],
                "disk_low": [f"{r.host}: {r.disk}" for r in live if r.disk]}

    @server.tool(name="run_metrics")
    @_tool
    def run_metrics_tool(job_id: int, metric: Optional[str] = None) -> dict[str, Any]:
        """A job's MLflow metric history: {metric: [[step, value], ...]} for every metric, or the one named."""
        return run_metrics(store().get(job_id), settings, metric)

    @server.tool()
    @_tool
    def leaderboard(experiment: Optional[str] = None) -> dict[str, Any]:
        """Configurations ranked by mean metric over seeds (agent-made and hand-submitted runs), with the
        seed noise: a lead smaller than the noise is not a win."""
        from orchestrator.faces.pyapi.resultapi import boards

        return {"boards": boards(experiment, settings)}

    @server.tool()
    @_tool
    def start_session(experiment: str, goal: str = "", trials: Optional[int] = None, parallel: Optional[int] = None,
                      proposer: Optional[str] = None, budget_minutes: Optional[float] = None,
                      priority: int = DEFAULT_PRIORITY, params: Optional[dict[str, Any]] = None,
                      baseline: Optional[dict[str, Any]] = None, project: Optional[str] = None,
                      llm_budget_usd: Optional[float] = None, llm_budget_tokens: Optional[int] = None,
                      trials_per_gpu: Union[str, int] = "auto", gpus: int = 1, nodes: int = 1,
                      min_nodes: Optional[int] = None) -> dict[str, Any]:
        """Start a research-agent session in the background (it proposes, runs and ranks trials through the
        queue; every result is judged against a baseline run on several seeds first). params: values held
        fixed; baseline: overrides of the experiment's defaults for the baseline; llm_budget_usd /
        llm_budget_tokens: caps on its LLM spend (at one it pauses; `autoresearch resume` with a higher cap
        continues it); trials_per_gpu: "auto" (pack trials on a GPU by the baseline's measured use; 1 on cpu
        slots) or an integer 1..16; gpus: whole devices per trial (per node with nodes); nodes / min_nodes: each
        trial across that many nodes (a Slurm queue), as `start --gpus --nodes`. Watch it with session_status;
        stop it with stop_session."""
        from orchestrator.faces.pyapi.sessionapi import start_session as start

        session = start(experiment, goal=goal, trials=trials, parallel=parallel, proposer=proposer,
                        budget_minutes=budget_minutes, priority=capped(priority), params=dict(params or {}),
                        baseline=dict(baseline or {}), project=charged(project), trials_per_gpu=trials_per_gpu,
                        llm_budget_usd=llm_budget_usd, llm_budget_tokens=llm_budget_tokens, gpus=gpus, nodes=nodes,
                        min_nodes=min_nodes, settings=settings)
        return {"session": session.id, "pid": session.pid, "log": str(session.log_path)}

    @server.tool(name="usage")
    @_tool
    def usage_tool(by: str = "project", since: Optional[str] = None) -> dict[str, Any]:
        """Who used the devices: device-seconds per project, owner or session (`by`) from the event log, since
        e.g. "7d" (default: ever); scavenger use apart; by session, LLM calls, tokens and cost. Also the
        projects (share, quota, decayed usage, devices held, jobs queued)."""
        from orchestrator.agent.usage import usage
        from orchestrator.api import sharing

        return {"usage": usage(settings, by=by, since=since), "projects": sharing.projects_table(settings)}

    @server.tool()
    @_tool
    def session_status(session_id: Optional[str] = None) -> dict[str, Any]:
        """One session's progress (trials by state, best so far, baseline), or every session's."""
        from orchestrator.faces.pyapi.sessionapi import progress

        return {"sessions": progress(session_id, settings)}

    @server.tool()
    @_tool
    def stop_session(session_id: str) -> dict[str, Any]:
        """Interrupt a session (it stays resumable with `autoresearch resume`) and cancel its unfinished trials."""
        from orchestrator.faces.pyapi.sessionapi import Session

        return Session(session_id, settings=settings).stop()

    _add_space_resources(server, settings)
    return server


def _add_space_resources(server: MCPServer, settings: Settings) -> None:
    """One resource per experiment (bundled, and config files used before on this home): its search space,
    metric and direction, as JSON; a template answers for any name or config-file path used later."""
    import json

    from experiments import registry

    def describe(exp: str) -> str:
        try:
            spec = registry.get(exp, home=settings.home)
        except registry.UnknownExperiment as exc:
            raise BadInput(str(exc)) from None
        return json.dumps({"experiment": spec.name, "description": spec.description, "metric": spec.metric,
                           "direction": spec.direction, "space": spec.space.describe(),
                           **({"source": spec.source, "run": spec.run, "fixed": dict(spec.fixed)}
                              if spec.source else {})}, indent=2)

    def reader(exp: str) -> Callable[[], str]:
        return lambda: describe(exp)

    for exp in registry.all_names(settings.home):
        server.resource(f"autoresearch://experiments/{exp}", name=f"{exp} search space",
                        description=f"Parameters of experiment {exp} (submit_job params, start_session params)",
                        mime_type="application/json")(reader(exp))

    @server.resource("autoresearch://experiments/{name}", name="experiment search space",
                     description="Parameters of any experiment by name (a config file's once it has been used)",
                     mime_type="application/json")
    def any_experiment(name: str) -> str:
        return describe(name)


def serve(settings: Settings, *, http_port: Optional[int] = None, host: str = "127.0.0.1",
          max_priority: int = DEFAULT_MAX_PRIORITY, project: Optional[str] = None,
          allow_cancel_any: bool = False) -> None:
    """Run the server until the client hangs up (stdio) or the process is stopped (HTTP)."""
    server = build_server(settings, max_priority=max_priority, project=project, allow_cancel_any=allow_cancel_any)
    if http_port is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host=host, port=http_port)
