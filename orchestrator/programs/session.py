"""Program sessions: start, resume, and the lineage of commits and metrics (`autoresearch tree`).

    summary = start(ProgramConfig(goal="lower val_bpb", program="examples/charlm-program", parallel=4))
    summary = resume("s-1a2b3c4d")      # after the process running it was killed
    rows = lineage("s-1a2b3c4d")

Sessions share the experiment agent's registry (so `sessions` lists them and `resume` finds them); their
trials and loop state live in `tree`. Like `autoresearch start --experiment`, a session embeds a queue
service for the home when none runs, and otherwise uses the running one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.programs import spec as specs, tree
from orchestrator.programs.trial import Kind, ProgramTrial, S


@dataclass(frozen=True)
class ProgramConfig:
    """What `autoresearch start --program` asked for. `trials` counts every job, baseline and re-runs included."""

    goal: str
    program: str
    trials: int | None = None
    parallel: int | None = None
    budget_minutes: float | None = None
    priority: int = 0
    model: str | None = None
    sandbox: bool = False
    max_reasks: int = 2
    poll: float = 1.0
    llm: dict[str, Any] = field(default_factory=dict)
    proposer: str = "llm"
    project: str = "default"  # the project its runs are charged to (orchestrator.queue.projects)
    memory_chars: int = 4000  # the prompt's section on earlier sessions' variants stays within this size

    def __post_init__(self) -> None:
        if not self.goal.strip():  # a program session is the LLM's: the goal is what it is told
            raise BadInput("--goal is required with --program (it is what the LLM is told)")
        if self.trials is not None and self.trials < 1:
            raise BadInput(f"--trials must be >= 1, got {self.trials}")
        if self.parallel is not None and self.parallel < 1:
            raise BadInput(f"--parallel must be >= 1, got {self.parallel}")
        if self.budget_minutes is not None and not self.budget_minutes > 0:
            raise BadInput(f"--budget-minutes must be > 0, got {self.budget_minutes}")
        if self.max_reasks < 0:
            raise BadInput("max_reasks must be >= 0")
        if not isinstance(self.project, str) or not self.project.strip():
            raise BadInput("--project must be a non-empty name")
        if self.memory_chars < 200:
            raise BadInput(f"memory_chars must be >= 200, got {self.memory_chars}")

    @property
    def experiment(self) -> str:
        """The name sessions are listed under."""
        return f"program:{Path(self.program).name}"

    @property
    def max_trials(self) -> int | None:
        """The job budget; 40 when no budget at all was given (a session must end)."""
        return 40 if self.trials is None and self.budget_minutes is None else self.trials

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProgramConfig":
        return cls(**data)


def check(config: ProgramConfig, devices: str | None = None, settings: Settings | None = None) -> specs.ProgramSpec:
    """The program's spec, or BadInput for anything that would stop the session before it starts."""
    from orchestrator.core import devices as devspec
    from orchestrator.programs import repo as gitrepo, sandbox
    from orchestrator.service.daemon import Service

    spec = specs.load(config.program)
    settings = settings or Settings.load()
    if not settings.llm_configured:
        raise BadInput("program mode needs an LLM: set llm_base_url (OPENAI_BASE_URL, an OpenAI-compatible "
                       "endpoint) or OPENAI_API_KEY")
    if config.sandbox:
        sandbox.available()
    try:
        gitrepo.Repo(spec.repo).head()
    except gitrepo.GitError as exc:
        raise BadInput(str(exc)) from None
    if not Service.running(settings):
        devspec.parse(devices or settings.devices)
    return spec


def is_program(session_id: str, settings: Settings | None = None) -> bool:
    """Whether `session_id` is a program session (BadInput when there is no such session)."""
    from orchestrator.agent.session import Registry

    registry = Registry((settings or Settings.load()).home)
    try:
        return "program" in registry.get(session_id)["config"]
    finally:
        registry.close()


def start(config: ProgramConfig, *, settings: Settings | None = None, session_id: str | None = None,
          devices: str | None = None, say: Callable[[str], None] = lambda s: None, llm: Any = None,
          on_registered: Callable[[str], None] = lambda session_id: None) -> dict[str, Any]:
    """Run a new program session to its end; returns its summary. `on_registered(id)` once it is in the
    registry (from then on `resume` can continue it)."""
    from orchestrator.agent.lifecycle import through_full_disk
    from orchestrator.agent.session import Registry, new_id

    settings = settings or Settings.load()
    spec = check(config, devices, settings)
    config = ProgramConfig(**{**config.to_dict(), "program": str(spec.root)})
    registry = Registry(settings.home)
    session_id = session_id or new_id()
    registry.create(session_id, config)  # type: ignore[arg-type]  (duck-typed: experiment, goal, proposer)
    try:
        on_registered(session_id)
        return through_full_disk(lambda: _run(session_id, config, spec, settings, registry, devices, say, llm),
                                 settings.home, registry, session_id)
    finally:
        registry.close()


def resume(session_id: str, *, settings: Settings | None = None, devices: str | None = None,
           say: Callable[[str], None] = lambda s: None, llm: Any = None) -> dict[str, Any]:
    """Continue a program session whose process died: no trial is lost, none runs twice."""
    from orchestrator.agent.lifecycle import mark_resumed, resumable_row, through_full_disk
    from orchestrator.agent.session import Registry

    settings = settings or Settings.load()
    registry = Registry(settings.home)
    try:
        row = resumable_row(registry, session_id, f"`autoresearch tree {session_id}`")
        config = ProgramConfig.from_dict(row["config"])
        spec = check(config, devices, settings)
        mark_resumed(registry, session_id)
        return through_full_disk(lambda: _run(session_id, config, spec, settings, registry, devices, say, llm),
                                 settings.home, registry, session_id)
    finally:
        registry.close()


def _run(session_id: str, config: ProgramConfig, spec: specs.ProgramSpec, settings: Settings, registry: Any,
         devices: str | None, say: Callable[[str], None], llm: Any) -> dict[str, Any]:
    from orchestrator.agent.lifecycle import Lifecycle
    from orchestrator.programs.loop import Loop
    from orchestrator.agent.llmclient import LLMClient
    from orchestrator.programs.repo import Repo

    trees = tree.TreeStore(settings.home)
    try:
        with Lifecycle.open(session_id, settings, registry, devices, f"program:{spec.name}") as life:
            repo = Repo(spec.repo)
            dirty = repo.dirty([spec.repo_path(f) for f in (*spec.edit, *spec.protected)])
            if dirty:
                say(f"note: uncommitted changes in {', '.join(dirty)} are not part of the session "
                    "(it starts from HEAD)")
            parallel = config.parallel or life.slots
            parent = life.session_run({
                "goal": config.goal, "program": str(spec.root), "trials": config.trials, "parallel": parallel,
                "budget_minutes": config.budget_minutes, "sandbox": config.sandbox, "metric": spec.metric,
                "repeats": spec.repeats})
            loop = Loop(session_id=session_id, config=config, spec=spec, store=life.store, tracker=life.tracker,
                        repo=repo, trees=trees, parallel=parallel, home=settings.home, parent_run=parent,
                        llm=llm or LLMClient.from_settings(settings, model=config.model, **config.llm),
                        notify=life.wake(), say=say, on_usage=life.on_usage())
            state = loop.run()
            summary = summarise(session_id, config, spec, state, trees.trials(session_id), parallel)
            best = summary.get("best") or {}
            return life.finish(parent, summary, verdict=headline(summary), step=summary["trials"],
                               tags={"autoresearch.branch": summary["branch"]},
                               metrics={"best_mean": best.get("value"), "baseline_mean": summary.get("baseline"),
                                        "device_seconds": summary["device_seconds"]})
    finally:
        trees.close()


def summarise(session_id: str, config: ProgramConfig, spec: specs.ProgramSpec, state: dict[str, Any],
              trials: list[ProgramTrial], parallel: int) -> dict[str, Any]:
    """What a session found: the incumbent against the baseline, counts, cost, why it stopped."""
    counts: dict[str, int] = {}
    for node in tree.nodes(trials):
        if node.kind is Kind.VARIANT:
            counts[tree.state_of(node)] = counts.get(tree.state_of(node), 0) + 1
    best_node = trials[state["incumbent"]] if trials else None
    best = None
    if best_node is not None:
        s = tree.summary_of(trials, best_node.n)
        best = {"value": s["mean"], "mean": s["mean"], "std": s["std"], "runs": s["n"], "commit": best_node.commit,
                "trial": best_node.n, "rationale": best_node.rationale, "verdict": best_node.verdict_text}
    return {
        "session": session_id, "program": str(spec.root), "goal": config.goal, "metric": spec.metric,
        "direction": spec.direction, "stop_reason": state.get("stop_reason", ""), "trials": len(trials),
        "variants": counts, "baseline": tree.summary_of(trials, 0)["mean"] if trials else None, "best": best,
        "branch": f"autoresearch/{session_id}", "elapsed_s": round(state.get("elapsed", 0.0), 1),
        "device_seconds": round(sum(t.device_s for t in trials), 1), "usage": state.get("usage", {}),
        "rejected_rounds": state.get("rejected", 0), "parallel": parallel, "finished_at": time.time(),
        "holdout": state.get("holdout"),
    }


def headline(summary: dict[str, Any]) -> str:
    """A finished session's verdict in one line (what `session.finished` notifications carry)."""
    best, metric = summary.get("best") or {}, summary["metric"]
    base = summary.get("baseline")
    base_text = "n/a" if base is None else f"{base:.5g}"
    if best.get("trial"):
        return (f"{metric} {best['mean']:.5g} against the baseline's {base_text}: commit {best['commit'][:10]} "
                f"on {summary['branch']} ({best['rationale']})")
    return f"no variant beat the baseline's {metric} {base_text} through the noise gate"


def lineage(session_id: str, settings: Settings | None = None) -> list[dict[str, Any]]:
    """Every commit of a program session (parents before children), with its runs, metric and verdict."""
    settings = settings or Settings.load()
    if not is_program(session_id, settings):
        raise BadInput(f"session {session_id} is not a program session (it has no tree)")
    trees = tree.TreeStore(settings.home)
    try:
        trials, held = trees.trials(session_id), (trees.state(session_id) or {}).get("holdout") or {}
    finally:
        trees.close()
    rows = []
    for node in tree.nodes(trials):
        runs = tree.runs_of(trials, node.n)
        s = tree.summary_of(trials, node.n)
        rows.append({"trial": node.n, "commit": node.commit, "parent_trial": node.parent_node,
                     "parent": node.parent, "step": node.step, "state": tree.state_of(node),
                     "runs": len(runs), "mean": s["mean"], "std": s["std"], "rationale": node.rationale,
                     "detail": node.verdict_text or node.error, "job_ids": [r.job_id for r in runs],
                     "holdout": held.get("value") if held.get("trial") == node.n else
                     held.get("baseline") if held and node.n == 0 else None})
    return rows


def leaderboard(name: str, settings: Settings | None = None) -> dict[str, Any]:
    """Every commit that ran for program `name` (`program:<folder>`), all sessions, ranked by mean over its runs
    (the shape of `autoresearch leaderboard`; a commit's params are its short id and its change)."""
    from orchestrator.agent.session import Registry
    from orchestrator.tracking.client import leaderboard as rank

    settings = settings or Settings.load()
    registry = Registry(settings.home)
    try:
        sessions = [r for r in registry.all() if "program" in r["config"] and r["experiment"] == name]
    finally:
        registry.close()
    if not sessions:
        raise BadInput(f"no program session for {name!r}; see `autoresearch sessions`")
    try:
        spec = specs.load(sessions[0]["config"]["program"])
        metric, direction = spec.metric, spec.direction
    except BadInput:  # the folder moved: the sessions' own record still says how they were scored
        metric = sessions[0]["summary"].get("metric", "metric")
        direction = sessions[0]["summary"].get("direction", "minimize")
    trees = tree.TreeStore(settings.home)
    rows = []
    try:
        for row in sessions:
            trials = trees.trials(row["id"])
            for t in trials:
                node = trials[t.node]
                if t.status is S.SUCCEEDED and t.value is not None:
                    rows.append({"params": {"commit": (t.commit or "")[:10], "change": node.rationale[:80]},
                                 "value": t.value, "job_id": t.job_id, "source": row["id"],
                                 "baseline": node.kind is Kind.BASELINE})
    finally:
        trees.close()
    return {"experiment": name, "metric": metric, **rank(rows, direction)}
