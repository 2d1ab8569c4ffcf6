"""How a session searches: the strategy an agent (`orchestrator.agent.graph.Agent`) runs its graph with.

The graph and its plumbing are the agent's, the same for every strategy: queueing proposed trials exactly once
(`Agent.queue_proposed`), watching their jobs (`monitor`), recording how each ended (`_record_ends`), pausing at
the LLM budget and finishing. A strategy decides the rest, handed the agent as its `host` (what it reads and
calls there is declared by `Host`):

- `propose`: which trials to record next; `submit`: anything to do before they are queued (then
  `host.queue_proposed`); `analyse`: what the trials that ended or reported mean; `decide`: the phase and
  the route;
- hooks the agent's own nodes call: `watch` (a running trial's progress: True wakes the loop), `wakes` (the
  loop's wait ends for something else), `ready` (a proposed trial may be queued now), `env` and `tags` (what
  a trial's job and run get besides the session's);
- `proposes`: whether the agent builds a proposer (a sampler, the LLM) for it.

`Search` (here) is the default: the baseline, then proposals into free slots, ASHA demoting losers and
promoting paused trials, confirmation re-runs of the top candidates. Population-based training is the other
(`orchestrator.agent.pbt.PBT`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from orchestrator.core import outputmetrics
from orchestrator.agent import budget, search
from orchestrator.agent.outcome import reports
from orchestrator.agent.phases import ACTIVE, FINAL
from orchestrator.agent.proposers.base import Observation
from orchestrator.agent.trial import Phase, State, Trial, TrialStatus, dump, load

if TYPE_CHECKING:  # the annotations only
    from experiments.registry import ExperimentSpec
    from orchestrator.queue.models import Job

S, P = TrialStatus, Phase


class Host(Protocol):
    """What a strategy reads and calls on the agent it serves (`orchestrator.agent.graph.Agent`)."""

    session_id: str
    cfg: Any  # SessionConfig
    spec: Any  # ExperimentSpec
    store: Any  # JobStore
    tracker: Any  # the search's view of the Tracker (it refuses the holdout)
    settings: Any
    searched: Any  # the spec reduced to what the search varies
    fixed: dict[str, Any]
    baseline: dict[str, Any]
    seeds: list[int]
    results: Any
    proposer: Any
    llm: Any
    budget: Any
    asha: Any
    phases: Any
    outcomes: Any
    progress_metric: str
    capacity: int
    parallel: int
    notify: Any
    on_usage: Any

    def _elapsed(self, state: State) -> float: ...

    def _time_up(self, state: State) -> bool: ...

    def _event(self, kind: str, state: State, **data: Any) -> None: ...

    def _record(self, n: int, phase: str, params: dict, proposer: str, rationale: str) -> Trial: ...

    def _cancel(self, t: Trial, reason: str) -> None: ...

    def _record_ends(self, state: State, trials: list[Trial], early_stopping: bool) -> dict | None: ...

    def queue_proposed(self, state: State) -> State: ...


class Strategy(Protocol):
    """What the agent's graph asks of a strategy (see the module doc)."""

    proposes: bool

    def __init__(self, host: Host) -> None: ...

    def propose(self, state: State) -> State: ...

    def submit(self, state: State) -> State: ...

    def analyse(self, state: State) -> State: ...

    def decide(self, state: State) -> State: ...

    def watch(self, t: Trial, job: Job) -> bool: ...

    def wakes(self, trials: list[Trial]) -> bool: ...

    def ready(self, t: Trial) -> bool: ...

    def env(self, t: Trial) -> dict[str, str]: ...

    def tags(self, t: Trial) -> dict[str, Any]: ...


class Search:
    """The default strategy: a proposer's trials, ASHA, and confirmation re-runs (`orchestrator.agent.graph`'s
    module doc walks through its nodes)."""

    proposes = True

    def __init__(self, host: Host) -> None:
        self.host = host

    def propose(self, state: State) -> State:
        """The baseline first; then fill free slots: promoted paused trials, new proposals, or re-runs (confirm).
        Nothing once the time budget is spent (the session's setup counts: it may use it all on a busy host)."""
        self.host._elapsed(state)
        if self.host._time_up(state):
            return {"trials": state["trials"], "elapsed": state["elapsed"], "usage": state.get("usage", {})}
        trials = load(state["trials"])
        if not any(t.phase is P.BASELINE for t in trials):
            # Every later result is judged against these runs, so they go in before any proposal, all at once.
            for seed in self.host.seeds[: self.host.cfg.baseline_seeds]:
                params = search.seeded(self.host.spec, self.host.baseline, seed)
                why = "the baseline: the experiment's defaults"
                trials.append(self.host._record(len(trials), "baseline", params, "baseline", why))
        free = self.host.capacity - sum(1 for t in trials if t.status in ACTIVE)
        search_max, n_confirm = self.host.cfg.split()
        candidates = list(state.get("candidates") or [])
        if state["phase"] == "search" and free > 0:
            new_room = free
            if self.host.cfg.early_stopping:
                if self.host.phases.winding_down(state, trials):
                    resume, new_room = self.host.phases.to_finish(trials, free)
                    why = "promoted to finish: only the time for one whole trial and the re-runs is left"
                else:
                    paused = [t for t in trials if t.status is S.PAUSED]
                    views = self.host.asha.promotable([t.config_values() for t in paused],
                                                      [p.config_values() for p in _peers(trials)])
                    by_n = {t.n: t for t in paused}
                    resume, why = [by_n[v["n"]] for v in views][:free], "promoted by ASHA: now in the top 1/eta"
                for t in resume:
                    try:
                        self.host.store.demote(t.job_id, self.host.cfg.priority, why)
                    except Exception:  # it ended meanwhile; the next monitor pass records how
                        continue
                    self.host.notify()
                    t.update(status=S.QUEUED, stopped_at=None)
                    free -= 1
                    self.host._event("promoted", {**state, "trials": trials}, trial=t.n, reason=why)
            n_search = sum(1 for t in trials if t.phase is P.SEARCH)
            n = min(free, new_room) if search_max is None else min(free, new_room, search_max - n_search)
            if self.host.llm is not None and self.host.budget.capped and not state.get("budget_stop"):
                state["budget_stop"] = self.host.budget.reached(state.get("usage") or {}) or ""
            if n > 0 and not state.get("budget_stop"):
                history = [_project(o, self.host.searched) for o in self.host.results.observations(trials)]
                if self.host.llm is not None and self.host.budget.capped:  # checked before each of its calls
                    client = self.host.llm.client
                    client.budget, client.spent = self.host.budget, dict(state.get("usage") or {})
                proposals = self.host.proposer.propose(n, history)
                take = getattr(self.host.proposer, "take_usage", None)
                state["usage"] = budget.added(state.get("usage") or {}, take() if take else {})
                if state["usage"]:
                    self.host.on_usage(dict(state["usage"]))
                if self.host.llm is not None and self.host.llm.budget_hit:
                    state["budget_stop"] = self.host.llm.budget_hit
                for p in proposals:
                    params = search.full(self.host.spec, p.params, self.host.fixed)
                    trials.append(self.host._record(len(trials), "search", params, p.proposer, p.rationale))
        elif state["phase"] == "confirm" and not state.get("confirm_planned"):
            candidates, state["confirm_planned"] = self.host.phases.plan_confirmation(trials, n_confirm), True
        if state.get("budget_stop"):
            self.host._event("budget", state, message=f"{state['budget_stop']}: no more proposals; the trials in "
                             "flight finish, then the session pauses")
        return {"trials": dump(trials), "elapsed": state["elapsed"], "usage": state.get("usage", {}),
                "candidates": candidates, "confirm_planned": bool(state.get("confirm_planned")),
                "budget_stop": state.get("budget_stop") or ""}

    def submit(self, state: State) -> State:
        """Queue every proposed trial (the agent's queueing: keys, runs, jobs)."""
        return self.host.queue_proposed(state)

    def decide(self, state: State) -> State:
        """Phase changes (search -> confirm -> done) and the route to take next: `Phases`' rules."""
        return self.host.phases.decide(state)

    def analyse(self, state: State) -> State:
        """Record finished trials, pause ASHA losers, update the best and the session run's metrics."""
        trials = load(state["trials"])
        best = self.host._record_ends(state, trials, self.host.cfg.early_stopping)
        # Winding down, the search trials in flight are the session's last chance of a candidate: none is paused.
        if self.host.cfg.early_stopping and not self.host.phases.winding_down(state, trials):
            peers = _peers(trials)
            for t in trials:
                if t.status is not S.RUNNING or t.phase is not P.SEARCH or t.ended:
                    continue
                rung = self.host.asha.judge(t.config_values(), [p.config_values() for p in peers])
                t.judged = sorted({*t.judged, *(int(k) for k in t.rungs if rung is None or int(k) <= rung)})
                if rung is None or not self.host.outcomes.still_a_loser(t, rung, peers):
                    continue
                try:
                    self.host.store.demote(t.job_id, self.host.cfg.priority - 1,
                                           f"ASHA: outside the top 1/{self.host.asha.eta} at step {rung}")
                except Exception:  # finished in the meantime: the next monitor pass records it
                    continue
                self.host.notify()
                t.update(status=S.PAUSED, stopped_at=rung)
                self.host._event("paused", {**state, "trials": trials, "best": best}, trial=t.n, rung=rung,
                                 value=t.rungs[str(rung)])
        done = [t for t in trials if t.status in FINAL]
        metrics = {"trials_done": len(done), "trials_running": sum(t.status is S.RUNNING for t in trials),
                   "trials_stopped": sum(t.status in (S.STOPPED, S.PAUSED) for t in trials)}
        if best:
            metrics["best_so_far"] = best["value"]
        for k, v in (state.get("usage") or {}).items():
            metrics[f"llm_{k}"] = v
        self.host.tracker.log_metrics(state["parent_run"], metrics, step=len(done))
        return {"trials": dump(trials), "best": best}

    def watch(self, t: Trial, job: Job) -> bool:
        """Read a running trial's progress (ASHA's rungs); True when it reached a new one."""
        if not (t.status is S.RUNNING and t.phase in (P.BASELINE, P.SEARCH) and self.host.cfg.early_stopping
                and t.run_id):
            return False
        if self.host.spec.run is not None:  # a config-file experiment: its output lines' reports
            outputmetrics.sync(self.host.tracker, job, self.host.spec.metric)
        history = self.host.tracker.history(t.run_id, self.host.progress_metric)
        if history:
            t.last_step = history[-1][0]
        rungs = {str(k): v for k, v in self.host.asha.rung_values(reports(history)).items()}
        if rungs.keys() - t.rungs.keys():
            t.rungs = rungs
            return True
        return False

    def ready(self, t: Trial) -> bool:
        """Whether a proposed trial may be queued now (population-based training holds a child until its donor's
        checkpoint is there); one held stays proposed, and the loop comes back to it."""
        return True

    def wakes(self, trials: list[Trial]) -> bool:
        """Whether something besides the jobs ends the monitor's wait (a held child that may now be queued)."""
        return False

    def env(self, t: Trial) -> dict[str, str]:
        """Environment a trial's job gets on top of the job protocol's (population-based training's)."""
        return {}

    def tags(self, t: Trial) -> dict[str, Any]:
        """Tags a trial's MLflow run gets besides the session's (population-based training's lineage)."""
        return {}


def _peers(trials: list[Trial]) -> list[Trial]:
    """The trials ASHA ranks a search trial among: the other search trials and the baseline's runs."""
    return [t for t in trials if t.phase in (P.BASELINE, P.SEARCH)]


def _project(obs: Observation, searched: ExperimentSpec) -> Observation:
    import dataclasses

    return dataclasses.replace(obs, params=search.project(obs.params, searched.space))
