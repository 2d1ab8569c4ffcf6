"""Agent sessions from Python: `start_session` runs one in the background and returns a `Session` handle to
watch it (`events`, `progress`), `wait` for its `Verdict`, `stop` it and `resume` it; `session(ID)` is the handle of
one started before (by `autoresearch start` too).

A session takes minutes to hours, longer than a notebook cell or an MCP call should block, so it runs in a
detached process of its own (`python -m orchestrator.faces.detached`, an argv list, never a shell) that outlives
the caller: its output goes to `AUTORESEARCH_HOME/agent/logs/SESSION.log` (what `autoresearch start` prints) and
its events to `SESSION.events.jsonl` beside it. Stopping it is Ctrl-C's SIGINT: it stays resumable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.faces.pyapi.types import Event, Verdict

Pairs = Union[Mapping[str, Any], Sequence[str], None]
ACTIVE = ("running",)  # the statuses of a session whose process is at work
START_WAIT = 120.0  # seconds a new background process gets to register its session (imports on a busy box)


def events_path(home: Path, session_id: str) -> Path:
    """Where a background session's events go, one JSON object a line (appended to by a resume)."""
    return Path(home) / "agent" / "logs" / f"{session_id}.events.jsonl"


def _params(value: Pairs) -> dict[str, Any]:
    """A dict of parameters from a dict (typed values) or KEY=VALUE strings (`--param`, as the CLI takes them)."""
    from orchestrator.api.jobs import parse_params

    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    return parse_params([value] if isinstance(value, str) else list(value))


def _project(name: Optional[str], settings: Settings) -> str:
    """The session's project, checked like a submit's (an undeclared one while projects exist: BadInput)."""
    from orchestrator.api import jobs as api
    from orchestrator.api.sharing import resolve_project

    return resolve_project(name, settings, api.open_store(settings)) if name else "default"


def no_nodes(nodes: int, min_nodes: Optional[int], gpus: int = 1) -> None:
    """BadInput when a program session is asked for trials across nodes or of several devices (each of its runs
    holds one device on one host)."""
    if nodes != 1 or min_nodes is not None or gpus != 1:
        raise BadInput("--gpus, --nodes and --min-nodes go with --experiment (a program session's runs hold one "
                       "device each)")


def experiment_config(experiment: str, *, goal: str = "", trials: Optional[int] = None,
                      parallel: Optional[int] = None, proposer: Optional[str] = None,
                      population: Optional[int] = None, perturbation_interval: Optional[int] = None,
                      budget_minutes: Optional[float] = None, target: Optional[float] = None, priority: int = 0,
                      model: Optional[str] = None, params: Pairs = None, confirm_seeds: int = 3,
                      confirm_top: int = 2, baseline: Pairs = None, baseline_seeds: int = 3,
                      no_early_stop: bool = False, trials_per_gpu: Union[str, int] = "auto",
                      project: Optional[str] = None, llm_budget_usd: Optional[float] = None,
                      llm_budget_tokens: Optional[int] = None, gpus: int = 1, nodes: int = 1,
                      min_nodes: Optional[int] = None, settings: Optional[Settings] = None) -> Any:
    """The `SessionConfig` of `autoresearch start --experiment` with these flags (the CLI, MCP and
    `start_session` build it here): the proposer defaults to llm when an endpoint is configured, else tpe; the
    model and LLM budgets to the settings'. `BadInput` for a malformed value."""
    from orchestrator.agent.proposers.factory import default_name
    from orchestrator.agent.session import SessionConfig

    settings = settings or Settings.load()
    try:
        return SessionConfig(goal=goal, experiment=experiment, proposer=proposer or default_name(settings),
                             trials=trials,
                             budget_minutes=budget_minutes, target=target, parallel=parallel, priority=priority,
                             model=model or settings.llm_model, fixed=_params(params), confirm_seeds=confirm_seeds,
                             confirm_top=confirm_top, baseline=_params(baseline), baseline_seeds=baseline_seeds,
                             early_stopping=not no_early_stop, project=_project(project, settings),
                             population=population, perturbation_interval=perturbation_interval,
                             trials_per_gpu=trials_per_gpu, gpus=gpus, nodes=nodes, min_nodes=min_nodes,
                             llm_budget_usd=settings.llm_budget_usd if llm_budget_usd is None else llm_budget_usd,
                             llm_budget_tokens=(settings.llm_budget_tokens if llm_budget_tokens is None
                                                else llm_budget_tokens))
    except ValueError as exc:
        from orchestrator.faces.pyapi.jobapi import as_input_error

        raise as_input_error(exc) from None


def start_session(experiment: Optional[str] = None, *, goal: str = "", program: Optional[str] = None,
                  sandbox: bool = False, trials: Optional[int] = None, parallel: Optional[int] = None,
                  proposer: Optional[str] = None, population: Optional[int] = None,
                  perturbation_interval: Optional[int] = None, budget_minutes: Optional[float] = None,
                  target: Optional[float] = None, priority: int = 0, model: Optional[str] = None,
                  params: Pairs = None, confirm_seeds: int = 3, confirm_top: int = 2, baseline: Pairs = None,
                  baseline_seeds: int = 3, no_early_stop: bool = False, devices: Optional[str] = None,
                  trials_per_gpu: Union[str, int] = "auto", project: Optional[str] = None,
                  llm_budget_usd: Optional[float] = None, llm_budget_tokens: Optional[int] = None,
                  gpus: int = 1, nodes: int = 1, min_nodes: Optional[int] = None,
                  settings: Optional[Settings] = None) -> "Session":
    """Start an agent session in the background, as `autoresearch start` would run it in the foreground, and
    return its `Session` handle. Give `experiment` (a bundled name, a folder with `autoresearch.toml`, a W&B sweep
    file) or `program` (a git repository whose code the LLM edits). The keywords are `start`'s flags: `params`
    are `--param` (held fixed; a dict or KEY=VALUE strings), `baseline` is `--baseline`; `devices` is the embedded
    service's when no service runs for this home.

        session = start_session("digits", proposer="tpe", trials=8, params={"epochs": 2}, devices="cpu:2")
        verdict = session.wait()

    Everything is checked first: bad input raises `BadInput` with the CLI's line, and then nothing has started.
    """
    settings = settings or Settings.load()
    if (program is None) == (experiment is None):
        raise BadInput("give exactly one of --experiment NAME or --program DIR")
    if program is not None:
        no_nodes(nodes, min_nodes, gpus)
        config = program_config(program, goal=goal, trials=trials, parallel=parallel, budget_minutes=budget_minutes,
                                priority=priority, model=model, sandbox=sandbox, project=project, settings=settings)
        from orchestrator.programs.session import check

        spec = check(config, devices, settings)
        body = {**config.to_dict(), "program": str(spec.root)}
    else:
        from orchestrator.agent import runner

        config = experiment_config(experiment, goal=goal, trials=trials, parallel=parallel, proposer=proposer,
                                   population=population, perturbation_interval=perturbation_interval,
                                   budget_minutes=budget_minutes, target=target, priority=priority, model=model,
                                   params=params, confirm_seeds=confirm_seeds, confirm_top=confirm_top,
                                   baseline=baseline, baseline_seeds=baseline_seeds, no_early_stop=no_early_stop,
                                   trials_per_gpu=trials_per_gpu, project=project, llm_budget_usd=llm_budget_usd,
                                   llm_budget_tokens=llm_budget_tokens, gpus=gpus, nodes=nodes, min_nodes=min_nodes,
                                   settings=settings)
        try:
            runner.check(config, settings, devices)
        except ValueError as exc:
            from orchestrator.faces.pyapi.jobapi import as_input_error

            raise as_input_error(exc) from None
        body = runner.named(config, settings).to_dict()
        _ready_tracking(settings)
    from orchestrator.agent.session import new_id

    session_id = new_id()
    proc = _spawn([json.dumps(body), session_id, devices or ""], session_id, settings, lambda row, pid: True)
    handle = Session(session_id, settings=settings)
    handle._process = proc
    return handle


def program_config(program: str, *, goal: str, trials: Optional[int] = None, parallel: Optional[int] = None,
                   budget_minutes: Optional[float] = None, priority: int = 0, model: Optional[str] = None,
                   sandbox: bool = False, project: Optional[str] = None, settings: Optional[Settings] = None) -> Any:
    """The `ProgramConfig` of `autoresearch start --program` with these flags (`BadInput` for a bad value)."""
    from orchestrator.programs.session import ProgramConfig

    settings = settings or Settings.load()
    return ProgramConfig(goal=goal, program=program, trials=trials, parallel=parallel, budget_minutes=budget_minutes,
                         priority=priority, model=model or settings.llm_model, sandbox=sandbox,
                         project=_project(project, settings))


def _ready_tracking(settings: Settings) -> None:
    """Create (migrate) the MLflow store now, in one process: a fresh SQLite store created by the session and
    by the service at once fails in MLflow's migrations ("table _alembic_tmp_experiments already exists")."""
    from orchestrator.tracking.client import Tracker

    Tracker.from_settings(settings).client.search_experiments(max_results=1)


def _registry(settings: Settings) -> Any:
    from orchestrator.agent.session import Registry

    return Registry(settings.home)


def _row(session_id: str, settings: Settings) -> dict[str, Any]:
    """The session's registry row (BadInput when there is none)."""
    registry = _registry(settings)
    try:
        return registry.get(session_id)
    finally:
        registry.close()


def _spawn(args: list[str], session_id: str, settings: Settings,
           ready: Callable[[dict, int], bool]) -> subprocess.Popen:
    """Start `python -m orchestrator.faces.detached ARGS` in a session of its own (it outlives this process), its
    output appended to the session's log, and wait until its registry row is `ready` (so that status works at
    once); BadInput with the last line it printed when it ends first."""
    from orchestrator.agent.background import log_path

    log = log_path(settings.home, session_id)
    env = {**os.environ, "AUTORESEARCH_HOME": str(settings.home)}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.detached", *args], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                close_fds=True)
    registry = _registry(settings)
    try:
        deadline = time.monotonic() + START_WAIT
        while time.monotonic() < deadline:
            try:
                if ready(registry.get(session_id), proc.pid):
                    return proc
            except BadInput:
                pass
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise BadInput(f"session did not start: {tail[0]}")
            time.sleep(0.1)
    finally:
        registry.close()
    proc.kill()
    raise BadInput(f"session {session_id} did not start within {START_WAIT:g} s; see {log}")


def progress(session_id: Optional[str] = None, settings: Optional[Settings] = None) -> list[dict[str, Any]]:
    """Progress of every session (newest first) or of one, as MCP's session_status answers it: trials by phase,
    the best so far, the baseline, the status."""
    from orchestrator.agent import background

    return background.sessions(settings or Settings.load(), session_id=session_id)


class Session:
    """A handle on one agent session (either mode), whichever process runs it.

    `status` is running, finished, paused (at its LLM budget), interrupted (its process is gone: `resume` it)
    or failed. A handle holds no resources: make one with `orchestrator.session(ID)` at any time.
    """

    def __init__(self, session_id: str, *, settings: Optional[Settings] = None):
        self.id = session_id
        self.settings = settings or Settings.load()
        self._process: Optional[subprocess.Popen] = None  # the background process, when this handle started it
        _row(session_id, self.settings)  # BadInput now for a session that does not exist

    def __repr__(self) -> str:
        return f"Session({self.id!r}, status={self.status!r})"

    @property
    def pid(self) -> Optional[int]:
        """The process running it (None when none does)."""
        row = _row(self.id, self.settings)
        return row["pid"] if row["status"] in ACTIVE else None

    @property
    def log_path(self) -> Path:
        """Its log: what `autoresearch start` prints, for a background session."""
        from orchestrator.agent.background import log_path

        return log_path(self.settings.home, self.id)

    @property
    def is_program(self) -> bool:
        """Whether the agent edits code (program mode) rather than searching an experiment's parameters."""
        return "program" in _row(self.id, self.settings)["config"]

    @property
    def status(self) -> str:
        """running, finished, paused, interrupted or failed."""
        self._reap()
        return _row(self.id, self.settings)["status"]

    def _reap(self) -> None:
        """Collect our own background process once it ended, so that it does not linger as a zombie (a zombie
        counts as gone for the status, but stays in the process table until its parent waits on it)."""
        if self._process is not None and self._process.poll() is not None:
            self._process = None

    def progress(self) -> dict[str, Any]:
        """Its trials by phase and state, the best so far and the baseline (as MCP's session_status)."""
        return progress(self.id, self.settings)[0]

    def events(self, follow: bool = True, poll: float = 0.3) -> Iterator[Event]:
        """Its events from the start (a background session's: each trial submitted, finished, stopped early, each
        phase), and with `follow`, those still to come, until its process ends."""
        path, offset, partial = events_path(self.settings.home, self.id), 0, b""
        while True:
            running = self.status in ACTIVE  # read before the file: nothing is written after the process ends
            if path.exists():
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
                offset += len(chunk)
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield Event.from_dict(json.loads(line))
            if not follow or not running:
                return
            time.sleep(poll)

    def wait(self, timeout: Optional[float] = None, poll: float = 0.5) -> Verdict:
        """Block until its process ends (finished, paused, interrupted or failed) and return its verdict;
        `TimeoutError` after `timeout` seconds (None: as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status in ACTIVE:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"session {self.id} is still running after {timeout} s")
            time.sleep(poll)
        if self._process is not None:
            self._process.wait()
        return self.verdict()

    def verdict(self) -> Verdict:
        """How it ended, or where it stands if it has not (status running: no headline yet)."""
        row = _row(self.id, self.settings)
        summary = dict(row.get("summary") or {})
        if "program" in row["config"] and summary.get("metric") and not summary.get("headline"):
            from orchestrator.programs.session import headline

            summary["headline"] = headline(summary)
        return Verdict.from_summary(self.id, row["status"], summary)

    def stop(self) -> dict[str, Any]:
        """Interrupt it (SIGINT, as Ctrl-C: it stays resumable) and cancel its unfinished trials; returns its
        progress with `cancelled_jobs`. `BadInput` when it has already finished."""
        from orchestrator.agent import background

        out = background.stop_session(self.id, self.settings)
        self._reap()
        return out

    def resume(self, *, devices: Optional[str] = None, llm_budget_usd: Optional[float] = None,
               llm_budget_tokens: Optional[int] = None) -> "Session":
        """Continue it in the background from its last checkpoint (an interrupted session, or a paused one with a
        higher LLM cap), as `autoresearch resume` does; returns this handle. `BadInput` when it is running, has
        finished, or would pause again at once."""
        budget = {k: v for k, v in (("llm_budget_usd", llm_budget_usd), ("llm_budget_tokens", llm_budget_tokens))
                  if v is not None}
        row = _row(self.id, self.settings)
        if row["status"] == "running":
            raise BadInput(f"session {self.id} is still running (pid {row['pid']})")
        if row["status"] == "finished":
            raise BadInput(f"session {self.id} already finished; see `autoresearch leaderboard`")
        if "program" not in row["config"]:
            from orchestrator.agent import runner

            runner.resumable(self.id, self.settings, **budget)
        self._process = _spawn(["--resume", self.id, devices or "", json.dumps(budget)], self.id, self.settings,
                               lambda r, pid: r["pid"] == pid)
        return self


def session(session_id: str, *, settings: Optional[Settings] = None) -> Session:
    """The handle of a session started before (`autoresearch start`, `start_session`, MCP); `BadInput` when
    there is none."""
    return Session(session_id, settings=settings)


def sessions(*, settings: Optional[Settings] = None) -> list[Session]:
    """Every session on this home, newest first (`autoresearch sessions`)."""
    settings = settings or Settings.load()
    registry = _registry(settings)
    try:
        ids = [row["id"] for row in registry.all()]
    finally:
        registry.close()
    return [Session(sid, settings=settings) for sid in ids]
