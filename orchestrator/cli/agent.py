"""`start`, `resume`, `sessions`, `leaderboard`, `ui`: the research agent's commands.

Thin on purpose: parse, call `orchestrator.agent.runner`, print. The agent's heavy imports (langgraph, mlflow,
optuna, openai) happen inside the commands, so loading this module keeps `autoresearch submit` fast.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from typing import Any, List, Optional

import typer

from orchestrator.cli import app
from orchestrator.cli.common import info, print_json, print_table
from orchestrator.errors import BadInput


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _params(params: dict, limit: int = 8) -> str:
    items = [f"{k}={_fmt(v)}" for k, v in params.items()]
    return ", ".join(items[:limit]) + (", ..." if len(items) > limit else "")


def progress(event: dict) -> None:
    """One line on stderr per thing that happened, with the running totals (what `start` shows live)."""
    kind = event["event"]
    head = f"[{event['elapsed']:7.1f}s]"
    tally = (f"done {event['done']}, running {event['running']}, queued {event['queued']}, "
             f"stopped {event['stopped']}, best {_fmt(event['best']) if event['best'] is not None else '-'}")
    if kind == "submitted":
        why = f"  why: {event['rationale']}" if event.get("rationale") else ""
        line = f"trial {event['trial']} -> job {event['job']} ({event['proposer']}): {_params(event['params'])}{why}"
    elif kind == "running":
        return  # the tally on the next line says it; one line per start would double the output
    elif kind == "succeeded":
        line = f"trial {event['trial']} finished: {_fmt(event['value'])}"
    elif kind == "failed":
        line = f"trial {event['trial']} failed: {event.get('error', '')}"
    elif kind == "paused":
        line = f"trial {event['trial']} stopped early at step {event['rung']} ({_fmt(event['value'])}): demoted"
    elif kind in ("stopped", "cancelled"):
        line = f"trial {event['trial']} {kind}"
    elif kind == "promoted":
        line = f"trial {event['trial']} promoted: resumes from its checkpoint"
    elif kind == "phase":
        line = f"{event['reason']}: {'re-running the best on fresh seeds' if event['phase'] == 'confirm' else 'done'}"
    else:
        line = event.get("message", kind)
    info(f"{head} {line} | {tally}")


def _proposer_note(name: str) -> str:
    from orchestrator.agent.proposers.factory import llm_configured

    if name in ("llm", "hybrid"):
        where = os.environ.get("OPENAI_BASE_URL") or "api.openai.com"
        return f"proposer: {name} (OpenAI-compatible endpoint at {where})"
    if llm_configured():
        return f"proposer: {name}"
    return f"proposer: {name} (no LLM endpoint configured; set OPENAI_BASE_URL or OPENAI_API_KEY to use llm)"


def _print_summary(summary: dict) -> None:
    best = summary.get("best")
    winner = summary.get("winner")
    info(f"session {summary['session']} finished ({summary['stop_reason'] or 'done'}): {summary['trials']} trials "
         f"{summary['counts']}, {summary['elapsed_s']} s, {summary['device_seconds']} device-s")
    if winner:
        spread = f" ± {_fmt(winner['spread'])}" if winner.get("spread") is not None else " (single run)"
        print(f"winner: {summary['metric']} {_fmt(winner['mean'])}{spread} over {winner['n']} seed(s): "
              f"{_params(winner['params'], 20)}")
        if summary.get("lead_within_noise"):
            print(f"note: its lead ({_fmt(summary['lead'])}) is smaller than the seed noise "
                  f"({_fmt(summary['noise'])}): the top two are not clearly different")
    elif best:
        print(f"best: {summary['metric']} {_fmt(best['value'])}: {_params(best['params'], 20)}")
    else:
        print("no trial finished with a metric")
    usage = summary.get("usage") or {}
    if usage.get("calls"):
        print(f"LLM: {int(usage['calls'])} calls, {int(usage.get('prompt_tokens', 0))}+"
              f"{int(usage.get('completion_tokens', 0))} tokens, ~${usage.get('cost_usd', 0.0):.4f}")


@app.command()
def start(
    goal: str = typer.Option(..., "--goal", help="What to achieve, in words (the LLM proposer reads it)."),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="A bundled experiment, or package.module:SPEC."),
    program: Optional[str] = typer.Option(None, "--program", help="A program folder with autoresearch.toml: the "
                                          "agent edits its code (see `autoresearch tree`)."),
    sandbox: bool = typer.Option(False, "--sandbox", help="Program mode: run each variant under bubblewrap."),
    trials: Optional[int] = typer.Option(None, "--trials", help="Jobs to run in all (re-runs included)."),
    parallel: Optional[int] = typer.Option(None, "--parallel", help="Trials in flight (default: device count)."),
    proposer: Optional[str] = typer.Option(None, "--proposer", help="llm|tpe|cmaes|random|hybrid (default: llm "
                                           "when an endpoint or key is configured, else tpe)."),
    budget_minutes: Optional[float] = typer.Option(None, "--budget-minutes", help="Stop after this long."),
    target: Optional[float] = typer.Option(None, "--target", help="Stop once the metric reaches this."),
    priority: int = typer.Option(0, "--priority", help="Priority of the trials (people's jobs use 10)."),
    model: Optional[str] = typer.Option(None, "--model", help="LLM model name."),
    param: List[str] = typer.Option([], "--param", help="KEY=VALUE held fixed while searching (repeatable)."),
    confirm_seeds: int = typer.Option(2, "--confirm-seeds", help="Fresh-seed re-runs of the best at the end."),
    no_early_stop: bool = typer.Option(False, "--no-early-stop", help="Let every trial run its full budget."),
    devices: Optional[str] = typer.Option(None, "--devices", help="Devices of the embedded service."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Run an agent session: propose, run, stop losers early, re-run the best, rank."""
    from orchestrator import api
    from orchestrator.agent import runner
    from orchestrator.agent.proposers.factory import default_name
    from orchestrator.agent.session import SessionConfig, new_id
    from orchestrator.config import Settings

    if (program is None) == (experiment is None):
        raise BadInput("give exactly one of --experiment NAME or --program DIR")
    if program is not None:
        from orchestrator.cli import programs

        return programs.start(goal=goal, program=program, trials=trials, parallel=parallel, devices=devices,
                              budget_minutes=budget_minutes, priority=priority, sandbox=sandbox, as_json=as_json,
                              model=model or Settings.load().llm_model)
    name = proposer or default_name()
    config = SessionConfig(goal=goal, experiment=experiment, proposer=name, trials=trials,
                           budget_minutes=budget_minutes, target=target, parallel=parallel, priority=priority,
                           model=model or Settings.load().llm_model, fixed=api.parse_params(param),
                           confirm_seeds=confirm_seeds, early_stopping=not no_early_stop)
    runner.check(config, devices=devices)
    session_id = new_id()
    info(f"session {session_id} on {experiment}; {_proposer_note(name)}")
    info(f"resume it with `autoresearch resume {session_id}` if this process is interrupted")
    summary = runner.start(config, session_id=session_id, devices=devices, on_event=progress)
    print_json(summary) if as_json else _print_summary(summary)


@app.command()
def resume(
    session: str = typer.Argument(..., metavar="SESSION"),
    devices: Optional[str] = typer.Option(None, "--devices", help="Devices of the embedded service."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Continue an interrupted agent session from its last checkpoint."""
    from orchestrator.agent import runner
    from orchestrator.cli import programs

    if programs.resume(session, devices, as_json):
        return
    info(f"resuming session {session}")
    summary = runner.resume(session, devices=devices, on_event=progress)
    print_json(summary) if as_json else _print_summary(summary)


@app.command()
def sessions(as_json: bool = typer.Option(False, "--json")) -> None:
    """Agent sessions and their status (interrupted ones can be resumed)."""
    from orchestrator.agent.session import Registry
    from orchestrator.config import Settings

    registry = Registry(Settings.load().home)
    rows = registry.all()
    registry.close()
    if as_json:
        print_json(rows)
        return

    def best(row: dict) -> str:
        w = row["summary"].get("winner") or row["summary"].get("best") or {}
        return _fmt(w.get("mean", w.get("value", ""))) if w else ""

    print_table("sessions", ["id", "experiment", "proposer", "status", "trials", "best", "started", "goal"],
                [(r["id"], r["experiment"], r["proposer"],
                  r["status"] + (f" ({r['summary']['stop_reason']})" if r["summary"].get("stop_reason") else ""),
                  r["summary"].get("trials", ""), best(r),
                  dt.datetime.fromtimestamp(r["created_at"]).strftime("%m-%d %H:%M"), r["goal"][:40])
                 for r in rows])


@app.command()
def leaderboard(
    experiment: Optional[str] = typer.Option(None, "--experiment", help="One experiment (default: all with runs)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Configurations ranked by mean metric over seeds, agent-made and hand-submitted runs together."""
    from orchestrator.agent import runner

    if experiment and experiment.startswith("program:"):  # a program session's commits (see `tree`)
        from orchestrator.programs.session import leaderboard as program_board

        boards = [program_board(experiment)]
    else:
        boards = runner.leaderboard(experiment)
    if as_json:
        print_json(boards)
        return
    show(boards)


def show(boards: list[dict], top: int = 10) -> None:
    """Print leaderboards as tables, with the noise note under each."""
    for board in boards:
        rows = [(e["rank"], _fmt(e["mean"]), "" if e["spread"] is None else _fmt(e["spread"]), e["n"],
                 _params(e["params"], 12), "; ".join(e["sources"]), ",".join(map(str, e["job_ids"][:6])))
                for e in board["entries"][:top]]
        print_table(f"{board['experiment']}: {board['metric']} ({board['direction']})",
                    ["#", "mean", "spread", "n", "params", "by", "jobs"], rows)
        if board["lead_within_noise"]:
            print(f"note: the leader's lead ({_fmt(board['lead'])}) is smaller than the seed noise "
                  f"({_fmt(board['noise'])})")
        elif board["lead_within_noise"] is None and len(board["entries"]) > 1:
            print("note: no configuration has been run on several seeds; the noise is unknown")


@app.command()
def ui(
    port: int = typer.Option(5000, "--port"),
    host: str = typer.Option("127.0.0.1", "--host"),
    workers: int = typer.Option(1, "--workers", help="Server worker processes (one serves a person well)."),
) -> None:
    """The MLflow UI on this home's tracking store (a real `mlflow server`; Ctrl-C stops it)."""
    from orchestrator.config import Settings

    if not 0 < port < 65536:
        raise BadInput(f"--port must be in 1..65535, got {port}")
    if workers < 1:
        raise BadInput(f"--workers must be >= 1, got {workers}")
    settings = Settings.load()
    settings.artifacts_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", settings.tracking_uri,
            "--default-artifact-root", settings.artifacts_dir.as_uri(), "--no-serve-artifacts",
            "--host", host, "--port", str(port), "--workers", str(workers)]
    info(f"MLflow UI for {settings.home} at http://{host}:{port}")
    sys.stdout.flush()
    os.execv(sys.executable, argv)
