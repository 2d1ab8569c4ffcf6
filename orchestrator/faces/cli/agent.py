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

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, print_columns, print_json
from orchestrator.core.errors import BadInput


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
        line = f"trial {event['trial']} {event.get('reason') or 'promoted'}; resumes from its checkpoint"
    elif kind == "phase":
        then = {"confirm": "re-running the best on fresh seeds", "paused": "paused (resume with a higher cap)"}
        line = f"{event['reason']}: {then.get(event['phase'], 'done')}"
    else:
        line = event.get("message", kind)
    info(f"{head} {line} | {tally}")


def _proposer_note(name: str, settings: Any) -> str:
    if name in ("llm", "hybrid"):
        where = settings.llm_base_url or "api.openai.com"
        return f"proposer: {name} (OpenAI-compatible endpoint at {where})"
    if settings.llm_configured:
        return f"proposer: {name}"
    return (f"proposer: {name} (no LLM endpoint configured; set llm_base_url (OPENAI_BASE_URL) or OPENAI_API_KEY "
            "to use llm)")


def _print_summary(summary: dict) -> None:
    """The end of a session for people: the baseline, the winner (if any) and the gate's verdict."""
    metric = summary["metric"]
    if summary.get("status") == "paused":
        info(f"session {summary['session']} paused ({summary['stop_reason']}) after {summary['tally']}"
             f"; continue it with `autoresearch resume {summary['session']} --llm-budget-usd Y` "
             "(or --llm-budget-tokens N) above what it spent")
        _print_usage(summary)
        return
    info(f"session {summary['session']} finished ({summary['stop_reason'] or 'done'}): {summary['tally']}, "
         f"{summary['elapsed_s']} s, {summary['device_seconds']} device-s")
    base, winner = summary.get("baseline"), summary.get("winner")
    if base:
        print(f"baseline: {metric} {_mean(base)} over {base['n']} seed(s) (the experiment's defaults)")
    if winner:
        diff = {k: v for k, v in winner["params"].items() if (base or {}).get("params", {}).get(k) != v}
        fresh = len(winner.get("fresh") or [])
        print(f"winner:   {metric} {_mean(winner)} over {winner['n']} seeds ({fresh} fresh re-runs gated): "
              f"{_params(diff, 20) or '-'}")
    elif summary.get("best"):
        best = summary["best"]
        print(f"best single run: {metric} {_fmt(best['value'])} (not a win unless it holds up over seeds)")
    print(summary.get("headline") or "no trial finished with a metric")
    held = summary.get("holdout")
    if held:
        print(f"holdout ({held['metric']}): baseline {_fmt(held['baseline_mean'])}, winner "
              f"{_fmt(held['winner_mean'])} over {held['n_winner']} fresh re-runs")
    if (summary.get("gpu") or {}).get("held_s"):  # sampled GPUs only: nothing to say on cpu slots
        print(summary["gpu"]["text"])
    _print_usage(summary)


def _print_usage(summary: dict) -> None:
    usage = summary.get("usage") or {}
    if usage.get("calls"):
        print(f"LLM: {int(usage['calls'])} calls, {int(usage.get('prompt_tokens', 0))}+"
              f"{int(usage.get('completion_tokens', 0))} tokens, ~${usage.get('cost_usd', 0.0):.4f}")


def _llm(row: dict) -> str:
    """A session's LLM spend for the sessions table: calls, tokens, cost ("" for none)."""
    usage = row.get("llm_usage") or (row.get("summary") or {}).get("usage") or {}
    if not usage.get("calls"):
        return ""
    tokens = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
    return f"{int(usage['calls'])} calls, {tokens:,} tok, ${usage.get('cost_usd', 0.0):.4f}"


def _mean(entry: dict) -> str:
    spread = f" ± {_fmt(entry['spread'])}" if entry.get("spread") is not None else " (single run)"
    return f"{_fmt(entry['mean'])}{spread}"


@app.command()
def start(
    goal: str = typer.Option("", "--goal", help="What to achieve, in words (the LLM proposer reads it; "
                             "optional for the samplers)."),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="A bundled experiment, a folder holding "
                                             "autoresearch.toml (or the toml, or a W&B sweep .yaml), a name used "
                                             "before, or package.module:SPEC."),
    program: Optional[str] = typer.Option(None, "--program", help="A program folder with autoresearch.toml: the "
                                          "agent edits its code (see `autoresearch tree`)."),
    sandbox: bool = typer.Option(False, "--sandbox", help="Program mode: run each variant under bubblewrap."),
    trials: Optional[int] = typer.Option(None, "--trials", help="Jobs to run in all (re-runs included)."),
    parallel: Optional[int] = typer.Option(None, "--parallel", help="Trials in flight (default: device count)."),
    proposer: Optional[str] = typer.Option(None, "--proposer", help="llm|tpe|cmaes|random|hybrid|pbt (default: "
                                           "llm when an endpoint or key is configured, else tpe)."),
    population: Optional[int] = typer.Option(None, "--population", help="pbt: members training at once."),
    perturbation_interval: Optional[int] = typer.Option(None, "--perturbation-interval", help="pbt: steps (the "
                                                        "experiment's progress steps) between exploit/explore."),
    budget_minutes: Optional[float] = typer.Option(None, "--budget-minutes", help="Stop after this long."),
    target: Optional[float] = typer.Option(None, "--target", help="Stop once the metric reaches this."),
    priority: int = typer.Option(0, "--priority", help="Priority of the trials (people's jobs use 10)."),
    model: Optional[str] = typer.Option(None, "--model", help="LLM model name."),
    param: List[str] = typer.Option([], "--param", help="KEY=VALUE held fixed while searching (repeatable)."),
    confirm_seeds: int = typer.Option(3, "--confirm-seeds", help="Fresh-seed re-runs of each top "
                                       "candidate (the gate judges it on these alone)."),
    confirm_top: int = typer.Option(2, "--confirm-top", help="Top candidates (by mean) re-run at the end."),
    baseline: List[str] = typer.Option([], "--baseline", help="KEY=VALUE: the baseline's change from the "
                                       "experiment's defaults (repeatable)."),
    baseline_seeds: int = typer.Option(3, "--baseline-seeds", help="Seeds the baseline runs on, first of all."),
    no_early_stop: bool = typer.Option(False, "--no-early-stop", help="Let every trial run its full budget."),
    devices: Optional[str] = typer.Option(None, "--devices", help="Devices of the embedded service."),
    trials_per_gpu: str = typer.Option("auto", "--trials-per-gpu", help="Trials sharing one GPU: auto (packs by "
                                       "the baseline's measured use; 1 on cpu slots) or N in 1..16."),
    gpus: int = typer.Option(1, "--gpus", help="Whole devices each trial holds (on each node with --nodes); "
                             "above 1 nothing is packed."),
    nodes: int = typer.Option(1, "--nodes", help="Run each trial across N nodes, --gpus devices on each (needs "
                              "the Slurm executor)."),
    min_nodes: Optional[int] = typer.Option(None, "--min-nodes", help="With --nodes: a trial may start again on "
                                            "as few as M nodes after a node is lost."),
    project: Optional[str] = typer.Option(None, "--project", help="The project the trials are charged to "
                                          "(`autoresearch projects`; default: the default project)."),
    llm_budget_usd: Optional[float] = typer.Option(None, "--llm-budget-usd", help="Pause the session once its "
                                                   "LLM calls cost this much (needs a known price or llm_price)."),
    llm_budget_tokens: Optional[int] = typer.Option(None, "--llm-budget-tokens", help="Pause the session once "
                                                    "its LLM calls used this many tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Run an agent session: propose, run, stop losers early, re-run the best, rank."""
    from orchestrator.agent import runner
    from orchestrator.agent.session import new_id
    from orchestrator.faces.cli.common import settings as load_settings
    from orchestrator.faces.pyapi.sessionapi import experiment_config, no_nodes, program_config

    if (program is None) == (experiment is None):
        raise BadInput("give exactly one of --experiment NAME or --program DIR")
    settings = load_settings()
    if program is not None:
        from orchestrator.faces.cli import programs

        no_nodes(nodes, min_nodes, gpus)
        config = program_config(program, goal=goal, trials=trials, parallel=parallel, budget_minutes=budget_minutes,
                                priority=priority, model=model, sandbox=sandbox, project=project,
                                settings=settings)
        return programs.start(config, devices=devices, as_json=as_json)
    config = experiment_config(experiment, goal=goal, trials=trials, parallel=parallel, proposer=proposer,
                               population=population, perturbation_interval=perturbation_interval,
                               budget_minutes=budget_minutes, target=target, priority=priority, model=model,
                               params=param, confirm_seeds=confirm_seeds, confirm_top=confirm_top,
                               baseline=baseline, baseline_seeds=baseline_seeds, no_early_stop=no_early_stop,
                               trials_per_gpu=trials_per_gpu, project=project, llm_budget_usd=llm_budget_usd,
                               llm_budget_tokens=llm_budget_tokens, gpus=gpus, nodes=nodes, min_nodes=min_nodes,
                               settings=settings)
    runner.check(config, settings, devices=devices)
    def registered(session_id: str) -> None:  # named once `resume` can continue it
        info(f"session {session_id} on {experiment}; {_proposer_note(config.proposer, settings)}")
        info(f"resume it with `autoresearch resume {session_id}` if this process is interrupted")

    summary = runner.start(config, settings=settings, session_id=new_id(), devices=devices, on_event=progress,
                           on_registered=registered)
    print_json(summary) if as_json else _print_summary(summary)


@app.command()
def resume(
    session: str = typer.Argument(..., metavar="SESSION"),
    devices: Optional[str] = typer.Option(None, "--devices", help="Devices of the embedded service."),
    llm_budget_usd: Optional[float] = typer.Option(None, "--llm-budget-usd", help="A new cap on the session's "
                                                   "LLM cost in all (a paused session needs a higher one)."),
    llm_budget_tokens: Optional[int] = typer.Option(None, "--llm-budget-tokens", help="A new cap on its LLM "
                                                    "tokens in all."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Continue an interrupted agent session, or one paused at its LLM budget, from its last checkpoint."""
    from orchestrator.agent import runner
    from orchestrator.faces.cli import programs

    if programs.resume(session, devices, as_json):
        return
    # An unknown or finished session, or a paused one without a higher cap: one line, before anything else.
    runner.resumable(session, llm_budget_usd=llm_budget_usd, llm_budget_tokens=llm_budget_tokens)
    info(f"resuming session {session}")
    summary = runner.resume(session, devices=devices, on_event=progress, llm_budget_usd=llm_budget_usd,
                            llm_budget_tokens=llm_budget_tokens)
    print_json(summary) if as_json else _print_summary(summary)


@app.command()
def sessions(as_json: bool = typer.Option(False, "--json")) -> None:
    """Agent sessions and their status (interrupted ones can be resumed)."""
    from orchestrator.agent import tally
    from orchestrator.agent.background import trial_counts
    from orchestrator.agent.session import Registry
    from orchestrator.core.config import Settings
    from orchestrator.queue.store import JobStore

    settings = Settings.load()
    registry = Registry(settings.home)
    rows = registry.all()
    registry.close()
    store = JobStore.from_settings(settings)
    for r in rows:
        r["phases"] = trial_counts(r, store)
    if as_json:
        print_json(rows)
        return

    def best(row: dict) -> str:
        w = row["summary"].get("winner") or row["summary"].get("best") or {}
        return _fmt(w.get("mean", w.get("value", ""))) if w else ""

    if not rows:
        print("no agent sessions yet (`autoresearch start` begins one)")
        return
    # Plain columns fitted to the terminal: the id (what `resume` needs), counts and times are never cut; the
    # experiment, proposer, status and goal share what is left, each cut with an ellipsis.
    print_columns(SESSION_COLUMNS,
                  [(r["id"], r["experiment"], r["proposer"],
                    r["status"] + (f" ({r['summary']['stop_reason']})" if r["summary"].get("stop_reason") else ""),
                    tally.text(r["phases"], short=True), best(r), _llm(r),
                    dt.datetime.fromtimestamp(r["created_at"]).strftime("%m-%d %H:%M"), r["goal"])
                   for r in rows])


SESSION_COLUMNS = [("id", {}), ("experiment", {"ratio": 2, "min_width": 6}), ("proposer", {"ratio": 1}),
                   ("status", {"ratio": 2, "min_width": 6}), ("trials", {"right": True}), ("best", {"right": True}),
                   ("llm", {"ratio": 1, "min_width": 3}), ("started", {}), ("goal", {"ratio": 3, "min_width": 4})]


@app.command()
def leaderboard(
    experiment: Optional[str] = typer.Option(None, "--experiment", help="One experiment (default: all with runs)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Configurations ranked by mean metric over seeds, agent-made and hand-submitted runs together."""
    from orchestrator.faces.pyapi.resultapi import boards as read_boards

    boards = read_boards(experiment)
    if as_json:
        print_json(boards)
        return
    if not any(board.get("entries") for board in boards):
        print(f"no finished runs with a metric yet{f' for {experiment}' if experiment else ''}")
        return
    show(boards)


WIDTH = 100  # the leaderboard fits a 100-column terminal; full params are in --json


def show(boards: list[dict], top: int = 10) -> None:
    """Print leaderboards as tables (params as changes from the baseline), with the verdict under each."""
    from rich.console import Console
    from rich.table import Table

    from orchestrator.agent.schedule import SCHEDULE_KEY

    console = Console(width=WIDTH)
    for board in boards:
        table = Table(title=f"{board['experiment']}: {board['metric']} ({board['direction']})",
                      title_justify="left", pad_edge=False)
        for name, opts in (("#", {}), ("mean", {}), ("±", {}), ("n", {}), ("gap", {"no_wrap": True}),
                           ("changes from the baseline", {"overflow": "ellipsis", "no_wrap": True, "max_width": 48}),
                           ("jobs", {"overflow": "ellipsis", "no_wrap": True, "max_width": 12})):
            table.add_column(name, **opts)
        for e in board["entries"][:top]:
            diff = dict(e.get("diff", e["params"]))
            lineage = " + PBT schedule" if diff.pop(SCHEDULE_KEY, None) else ""  # a PBT lineage: its table follows
            what = "(baseline)" if e.get("baseline") else ((_params(diff, 6) or "(same)") + lineage)
            table.add_row(f"{e['rank']}{'*' if e.get('winner') else ''}", _fmt(e["mean"]),
                          "" if e["spread"] is None else f"{e['spread']:.2g}", str(e["n"]),
                          "" if e.get("gap") is None else f"{e['gap']:+.2g}", what,
                          ",".join(map(str, e["job_ids"][:4])))
        console.print(table)
        _schedule(console, board)
        if board.get("headline"):
            console.print(board["headline"], markup=False, highlight=False)
        if len(board["entries"]) > top:
            console.print(f"({len(board['entries']) - top} more; --json for all, with full params)")


def _schedule(console, board: dict) -> None:
    """The schedule of a population-based-training lineage on the board: the winner's when it is one; with no
    winner, the best re-run (gated) candidate's, else the best-ranked lineage's, whatever ranks above it."""
    from rich.table import Table

    from orchestrator.agent.schedule import SCHEDULE_KEY, table as schedule_rows

    entries = board["entries"]
    winner = next((e for e in entries if e.get("winner")), None)
    lineages = [e for e in ([winner] if winner else entries) if SCHEDULE_KEY in e["params"]]
    entry = next((e for e in lineages if e.get("gated")), None) or (lineages or [None])[0]
    if entry is None:
        return
    rows = schedule_rows(entry["params"][SCHEDULE_KEY])
    out = Table(pad_edge=False)  # its title on a line of its own: a table of two columns would fold it
    for name in rows[0]:
        out.add_column(name)
    for row in rows:
        out.add_row(*(_fmt(v) if isinstance(v, float) else str(v) for v in row.values()))
    role = " (the winner)" if entry.get("winner") else " (the re-run candidate)" if entry.get("gated") else ""
    console.print(f"schedule of #{entry['rank']}{role}:")
    console.print(out)


@app.command()
def ui(
    port: int = typer.Option(5000, "--port"),
    host: str = typer.Option("127.0.0.1", "--host"),
    workers: int = typer.Option(1, "--workers", help="Server worker processes (one serves a person well)."),
) -> None:
    """The MLflow UI on this home's tracking store (a real `mlflow server`; Ctrl-C stops it)."""
    from orchestrator.core.config import Settings

    if not 0 < port < 65536:
        raise BadInput(f"--port must be in 1..65535, got {port}")
    if workers < 1:
        raise BadInput(f"--workers must be >= 1, got {workers}")
    settings = Settings.load()
    settings.artifacts_dir.mkdir(parents=True, exist_ok=True)
    from orchestrator.tracking.store import open_client

    open_client(settings.tracking_uri, settings.artifacts_dir)  # a new store made whole before the server opens it
    argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", settings.tracking_uri,
            "--default-artifact-root", settings.artifacts_dir.as_uri(), "--no-serve-artifacts",
            "--host", host, "--port", str(port), "--workers", str(workers)]
    url = f"http://{host}:{port}"
    info(f"MLflow UI for {settings.home} at {url}")
    from orchestrator.agent import runner

    for line in runner.session_links(url, settings):
        info(line)
    sys.stdout.flush()
    os.execv(sys.executable, argv)
