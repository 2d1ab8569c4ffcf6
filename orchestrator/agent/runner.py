"""Running a session: wire the store, MLflow, the queue service and the graph together; start or resume.

    summary = start(SessionConfig(goal="...", experiment="digits", proposer="tpe", trials=12))
    summary = resume("s-1a2b3c4d")        # after the process running it was killed

`start` embeds a queue service for this home when none is running (and stops it at the end); otherwise it
uses the running one, and K (trials in flight) defaults to the devices that service has.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from orchestrator.agent.lifecycle import Lifecycle, mark_resumed, resumable_row, through_full_disk
from orchestrator.agent.session import Registry, SessionConfig, connect, new_id
from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput

RECURSION_LIMIT = 1_000_000  # the loop is long by design; the budget, not LangGraph, ends it


def start(config: SessionConfig, *, settings: Settings | None = None, session_id: str | None = None,
          devices: str | None = None, on_event: Callable[[dict], None] | None = None,
          proposer: Any = None, on_registered: Callable[[str], None] = lambda session_id: None) -> dict[str, Any]:
    """Run a new session to its end; returns its summary. `on_registered(id)` once it is in the registry (from
    then on `resume` can continue it: the CLI names it only then)."""
    settings = settings or Settings.load()
    check(config, settings, devices)
    config = named(config, settings)
    registry = Registry(settings.home)
    session_id = session_id or new_id()
    registry.create(session_id, config)
    try:
        on_registered(session_id)
        return through_full_disk(lambda: _run(session_id, config, settings, registry, devices, on_event, proposer),
                                 settings.home, registry, session_id)
    finally:
        registry.close()


def resume(session_id: str, *, settings: Settings | None = None, devices: str | None = None,
           on_event: Callable[[dict], None] | None = None, proposer: Any = None,
           llm_budget_usd: float | None = None, llm_budget_tokens: int | None = None) -> dict[str, Any]:
    """Continue a session whose process died, or one paused at its LLM budget (give a higher cap), from its last
    checkpoint. A new cap replaces the one the session was started with."""
    settings = settings or Settings.load()
    registry = Registry(settings.home)
    try:
        row = _resumable(registry, session_id)
        config = _with_budget(SessionConfig.from_dict(row["config"]), llm_budget_usd, llm_budget_tokens)
        _room_left(row, config)
        mark_resumed(registry, session_id, config=json.dumps(config.to_dict()))
        return through_full_disk(lambda: _run(session_id, config, settings, registry, devices, on_event, proposer),
                                 settings.home, registry, session_id)
    finally:
        registry.close()


def resumable(session_id: str, settings: Settings | None = None, llm_budget_usd: float | None = None,
              llm_budget_tokens: int | None = None) -> None:
    """BadInput unless `session_id` names an interrupted session, or a paused one whose (new) LLM budget has room
    (unknown, running or finished ones are not resumable)."""
    registry = Registry((settings or Settings.load()).home)
    try:
        row = _resumable(registry, session_id)
        _room_left(row, _with_budget(SessionConfig.from_dict(row["config"]), llm_budget_usd, llm_budget_tokens))
    finally:
        registry.close()


def _resumable(registry: Registry, session_id: str) -> dict[str, Any]:
    return resumable_row(registry, session_id, "`autoresearch leaderboard`")


def _with_budget(config: SessionConfig, usd: float | None, tokens: int | None) -> SessionConfig:
    import dataclasses

    changes = {k: v for k, v in (("llm_budget_usd", usd), ("llm_budget_tokens", tokens)) if v is not None}
    return dataclasses.replace(config, **changes) if changes else config


def _room_left(row: dict[str, Any], config: SessionConfig) -> None:
    """BadInput when a session paused at its LLM budget would pause again at once (the cap was not raised)."""
    from orchestrator.agent import budget

    if row["status"] != "paused":
        return
    spent = (row.get("summary") or {}).get("usage") or {}
    reason = budget.of(config).reached(spent)
    if reason:
        raise BadInput(f"session {row['id']} paused: {reason}; resume it with a higher --llm-budget-usd or "
                       "--llm-budget-tokens")


def session_links(url: str, settings: Settings | None = None, limit: int = 5) -> list[str]:
    """Lines with the MLflow UI addresses of the store's experiments (their runs tables: hand-submitted jobs
    are in `jobs` or their own experiment) and of the latest sessions' runs (their experiment's runs table,
    filtered to the session, and the session run with its report), in MLflow 3's model-training view."""
    from orchestrator.tracking.client import TAG_SESSION, Tracker, runs_page

    tracker = Tracker.from_settings(settings or Settings.load())
    out = [f"experiment {exp.name}: {runs_page(url, exp.experiment_id)}" for exp in tracker.experiments(limit)]
    for run in tracker.session_runs()[:limit]:
        session = run.data.tags.get(TAG_SESSION, "?")
        exp = run.info.experiment_id
        out.append(f"session {session}: {runs_page(url, exp, f'tags.`{TAG_SESSION}` = {session!r}')}  (report: "
                   f"{url}/#/experiments/{exp}/runs/{run.info.run_id}/artifacts?workflowType=machine_learning)")
    return out


def load_spec(name: str, settings: Settings | None = None) -> Any:
    """An experiment as `experiments.registry.get` resolves it (a bundled name, a config file's folder or path,
    a remembered name, or `package.module:SPEC`); BadInput with its one line otherwise."""
    from experiments import registry

    try:
        return registry.get(name, home=(settings or Settings.load()).home)
    except registry.UnknownExperiment as exc:
        raise BadInput(str(exc)) from None


def named(config: SessionConfig, settings: Settings | None = None) -> SessionConfig:
    """`config` naming its experiment as later commands will (`resume`, `sessions`, `leaderboard`): a config
    file's path becomes the experiment's remembered name."""
    import dataclasses

    spec = load_spec(config.experiment, settings)
    return dataclasses.replace(config, experiment=spec.name) if spec.source else config


def check(config: SessionConfig, settings: Settings | None = None, devices: str | None = None) -> None:
    """BadInput unless the experiment, proposer, fixed and baseline params and (with no service running)
    devices are valid, and a trial of several devices (`--gpus`, `--nodes`) fits somewhere."""
    from orchestrator.core import devices as devspec
    from orchestrator.agent import budget
    from orchestrator.agent.proposers.factory import NAMES
    from orchestrator.agent.search import baseline_params, fixed_params, reduced
    from orchestrator.service.daemon import Service

    spec = load_spec(config.experiment, settings)
    if config.proposer not in NAMES:
        raise BadInput(f"unknown proposer {config.proposer!r}; choose from {', '.join(NAMES)}")
    if config.proposer == "pbt":
        from orchestrator.agent.pbt import check as pbt_check

        pbt_check(spec)
    fixed = fixed_params(spec, config.fixed, config.seed)
    reduced(spec, fixed)
    baseline_params(spec, config.baseline, fixed)
    settings = settings or Settings.load()
    budget.check(config, settings)
    embedded = None if Service.running(settings) else devspec.parse(devices or settings.devices)  # its devices
    if config.gpus * config.nodes > 1:  # trials of several devices: somewhere must hold one whole
        from orchestrator.api import jobs as api
        from orchestrator.queue.policy import unplaceable_reason

        store = api.open_store(settings)
        api.check_nodes(config.nodes, settings, store)  # across nodes: an executor that places gangs (Slurm)
        asked = f"--gpus {config.gpus}" + (f" x --nodes {config.nodes}" if config.nodes > 1 else "")
        live = store.hosts.live_capacities(api.SERVICE_STALE_AFTER)
        why = unplaceable_reason(config.gpus * config.nodes, max(live)) if live else None
        if why:
            raise BadInput(f"{asked}: {why}")
        if not live and embedded is not None and config.gpus * config.nodes > len(embedded):
            raise BadInput(f"{asked}: a trial needs {config.gpus * config.nodes} devices; the session's service "
                           f"would have {len(embedded)} ({devices or settings.devices})")


def _run(session_id: str, config: SessionConfig, settings: Settings, registry: Registry, devices: str | None,
         on_event: Callable[[dict], None] | None, proposer: Any) -> dict[str, Any]:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from orchestrator.agent import holdout, report
    from orchestrator.agent.graph import Agent, build
    from orchestrator.agent.strategy import Search
    from orchestrator.agent.packer import session_devices, summary as packing_summary

    spec = load_spec(config.experiment, settings)
    with Lifecycle.open(session_id, settings, registry, devices, spec.name) as life:
        store, tracker = life.store, life.tracker
        names = session_devices(life.service, store)  # cpu slots or GPUs: how `--trials-per-gpu auto` packs
        parent = life.session_run({
            "goal": config.goal, "proposer": config.proposer, "experiment": spec.name, "trials": config.trials,
            "budget_minutes": config.budget_minutes, "target": config.target, "priority": config.priority,
            "parallel": config.parallel or life.slots, "model": config.model or "", "fixed": config.fixed,
            "trials_per_gpu": config.trials_per_gpu, "gpus": config.gpus, "nodes": config.nodes})
        strategy = Search
        if config.proposer == "pbt":
            from orchestrator.agent.pbt import PBT as strategy  # population-based training's rules
        agent = Agent(session_id=session_id, config=config, spec=spec, store=store, tracker=tracker,
                      parallel=config.parallel or life.slots, proposer=proposer, notify=life.wake(),
                      on_event=on_event or (lambda e: None), settings=settings, on_usage=life.on_usage(),
                      devices=names, strategy=strategy)
        saver = SqliteSaver(connect(settings.home))
        graph = build(agent, saver)
        run_cfg = {"configurable": {"thread_id": session_id}, "recursion_limit": RECURSION_LIMIT}
        snapshot = graph.get_state(run_cfg)
        if snapshot.values and not snapshot.next and snapshot.values.get("paused"):
            # Paused at the LLM budget and resumed with a higher cap: the graph starts again at `propose`.
            final = graph.invoke({"paused": "", "budget_stop": "", "config": config.to_dict()}, run_cfg,
                                 durability="sync")
        elif snapshot.values and not snapshot.next:
            final = snapshot.values  # it had finished; only the bookkeeping below was lost
        else:
            first = None if snapshot.values else {
                "session": session_id, "config": config.to_dict(), "parent_run": parent, "phase": "search",
                "trials": [], "elapsed": 0.0, "best": None, "usage": {}, "stop_reason": "", "route": ""}
            final = graph.invoke(first, run_cfg, durability="sync")
        summary = report.summarise(session_id, config, final, spec, parallel=agent.parallel,
                                   defaults=agent.baseline)
        summary["gpu"] = report.gpu_use(store, final["trials"])  # "GPU busy N% of the device time it held"
        if packing_summary(final):
            summary["packing"] = packing_summary(final)
        usage_tags = {f"autoresearch.llm_{k}": f"{final.get('usage', {}).get(k, 0):g}"
                      for k in ("calls", "prompt_tokens", "completion_tokens", "cost_usd")}
        if final.get("paused"):
            # Not finished: no holdout read (the search may continue), the parent run stays open.
            return life.pause(parent, summary, final["paused"], usage_tags)
        # The holdout, read once now that no search decision is left (the agent's tracker refuses it).
        holdout.attach(summary, spec, tracker, *holdout.session_runs(final["trials"], summary.get("winner")))
        held = summary.get("holdout") or {}
        winner, base = summary.get("winner") or {}, summary.get("baseline") or {}
        return life.finish(
            parent, summary, verdict=summary["headline"], step=len(final["trials"]),
            tags={"autoresearch.verdict": summary["headline"],
                  **({"autoresearch.holdout": held["text"]} if held else {}), **usage_tags},
            metrics={"winner_mean": winner.get("mean"), "winner_spread": winner.get("spread"),
                     "baseline_mean": base.get("mean"), "baseline_spread": base.get("spread"),
                     "improvement": (summary.get("verdict") or {}).get("delta"),
                     "holdout_improvement": held.get("delta"),
                     "holdout_baseline_mean": held.get("baseline_mean"),
                     "holdout_winner_mean": held.get("winner_mean"),
                     "device_seconds": summary["device_seconds"]},
            report=(report.markdown(summary), report.REPORT))


def leaderboard(experiment: str | None = None, settings: Settings | None = None) -> list[dict[str, Any]]:
    """The leaderboard of one experiment (or of every bundled one with results): agent and hand-made runs."""
    from experiments import registry as experiments
    from orchestrator.agent import holdout
    from orchestrator.agent.history import Results
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker, leaderboard as rank

    settings = settings or Settings.load()
    if experiment is not None:
        load_spec(experiment, settings)
    store = JobStore(settings.db_url)
    tracker = Tracker.from_settings(settings)
    out = []
    for name in [experiment] if experiment else experiments.all_names(settings.home):
        try:
            spec = load_spec(name, settings)
        except BadInput:
            if experiment:
                raise
            continue  # a remembered file that has gone or broken: the others still show
        rows = Results(store, holdout.search_view(tracker, spec), spec).rows()  # ranked and gated blind
        if rows or experiment:
            board = {"experiment": spec.name, "metric": spec.metric,
                     **rank(rows, spec.direction, defaults=spec.space.defaults(), exact=not spec.seeded)}
            board["holdout_metric"] = spec.holdout_metric
            # Then the holdout, for the gated winner and the baseline only (what the verdict compares).
            runs = lambda entry: [getattr(store.get(j), "mlflow_run_id", None) for j in (entry or {}).get(
                "fresh_jobs", [])]
            holdout.attach(board, spec, tracker, runs(board["baseline"]), runs(board["winner"]))
            out.append(board)
    return out
