"""The agent loop as a LangGraph StateGraph, checkpointed after every step.

    START -> propose -> submit -> monitor -> analyse -> decide -+-> propose   (free slots, budget left)
                                    ^                           +-> monitor   (nothing to add: wait)
                                    +---------------------------+-> finish -> END
                                                                +-> pause -> END  (the LLM budget is spent)

- propose: first of all the baseline (the spec's defaults on `baseline_seeds` seeds, all at once); then fill
  free slots (K in flight) with proposals, each recorded with its idempotency key `<session>:<n>` before
  anything is submitted; ASHA-paused trials that now rank well are promoted first.
- submit: create each proposal's MLflow child run and queue its job under that key. Re-running this node after
  a crash finds the run (by tag) and the job (by key) instead of making new ones; the params of whatever was
  made first win, so the state always describes what actually runs.
- monitor: block until something happens (a job changes state, a trial reaches an ASHA rung, the time budget
  runs out) or a heartbeat passes, so checkpoints track events rather than a polling clock.
- analyse: read final metrics, apply ASHA (demote losers: they checkpoint and wait in line), track the best.
  A trial whose metric history reached its full budget counts whatever stopped it afterwards.
- decide: move search -> confirm (fresh-seed re-runs of the top candidates by mean) -> done, and route.
  The winner is decided afterwards by the noise gate against the baseline (`orchestrator.agent.report`).
- finish: stop leftovers, log the best-so-far plot and summary on the session run, record the leaderboard.
- pause: the LLM budget (orchestrator.agent.budget) was reached and the trials in flight have ended; the run
  of the graph ends here, and `resume` with a higher cap starts it again at `propose` from the same state.

State is plain JSON-able data (the checkpoint); live resources (store, tracker, proposer) live on `Agent`. What
the nodes propose, analyse and decide is the agent's strategy (`orchestrator.agent.strategy`): `Search`, as above,
or population-based training (`orchestrator.agent.pbt`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from orchestrator.core.config import Settings
from orchestrator.agent import budget, search
from orchestrator.agent.history import Results, device_seconds
from orchestrator.agent.holdout import search_view
from orchestrator.agent.outcome import Outcomes
from orchestrator.agent.packer import Packer
from orchestrator.agent.phases import ACTIVE, FINAL, Phases
from orchestrator.agent.stopping import ASHA
from orchestrator.agent.strategy import Search, Strategy
from orchestrator.agent.trial import Phase, State, Trial, TrialStatus, dump, load

if TYPE_CHECKING:  # heavy or cyclic at import time; the annotations only
    from experiments.registry import ExperimentSpec
    from orchestrator.agent.proposers.base import Proposer
    from orchestrator.agent.session import SessionConfig
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker

S, P = TrialStatus, Phase

HEARTBEAT = 15.0


class Agent:
    """The nodes of the graph plus the live resources they use. See `orchestrator.agent.runner` to run one.

    How the session searches is its `strategy` (`orchestrator.agent.strategy`): `Search` (a proposer, ASHA,
    confirmation re-runs) unless another is given (`orchestrator.agent.pbt.PBT`); the agent keeps what every
    strategy shares: queueing trials, watching their jobs, recording how they ended, pausing and finishing."""

    def __init__(self, *, session_id: str, config: SessionConfig, spec: ExperimentSpec, store: JobStore,
                 tracker: Tracker, parallel: int, proposer: Proposer | None = None,
                 notify: Callable[[], None] = lambda: None, on_event: Callable[[dict], None] = lambda e: None,
                 settings: Settings | None = None, on_usage: Callable[[dict], None] = lambda u: None,
                 devices: list[str] | None = None, strategy: type[Strategy] = Search):
        self.session_id = session_id
        self.on_usage = on_usage  # told the session's LLM spend in all after each proposal round
        self.settings = settings
        self.cfg = config
        self.spec = spec
        self.store = store
        # Every metric the search reads (proposers' history, ASHA, the best so far) goes through this view,
        # which refuses the holdout; the holdout is read after the graph ends (orchestrator.agent.holdout).
        self.tracker = search_view(tracker, spec)
        # k trials per device (`orchestrator.agent.packer`): `parallel` and `capacity` follow from it.
        self.packer = Packer(self, parallel, devices, settings.pack_target_busy if settings is not None else 0.8)
        self.notify = notify
        self.on_event = on_event
        self.fixed = search.fixed_params(spec, config.fixed, config.seed)
        self.searched = search.reduced(spec, self.fixed)
        self.results = Results(store, self.tracker, spec)
        self.baseline = search.baseline_params(spec, config.baseline, self.fixed)
        if proposer is None and strategy.proposes:
            from orchestrator.agent.proposers.factory import make

            proposer = make(config.proposer, self.searched, config.goal, seed=config.seed, model=config.model,
                            llm_options=config.llm, baseline=search.project(self.baseline, self.searched.space),
                            settings=settings)
        self.proposer = proposer
        self.phases = Phases(self)  # the rules for moving between phases, over this agent's trials
        self.budget = budget.of(config)
        self.llm = _llm_of(proposer)
        seed0 = int(self.fixed.get(search.SEED_KEY, config.seed))
        self.seeds = [seed0, *search.confirm_seeds(session_id, max(config.baseline_seeds, config.confirm_seeds),
                                                   seed0)]
        # Rungs count progress reports (evaluations), not optimizer steps: trials with different batch sizes
        # then meet at the same fraction of their budget (digits reports once per epoch).
        self.asha = ASHA(grace=1, eta=config.eta, direction=spec.direction)
        self.progress_metric = spec.progress_metric or spec.metric
        self.outcomes = Outcomes(store, self.tracker, spec, self.asha)
        self._tick = time.time()
        self.strategy = strategy(self)

    # -- packing (orchestrator.agent.packer) --------------------------------------------------------------------

    @property
    def k(self) -> int:
        """Trials per device now."""
        return self.packer.k

    @property
    def parallel(self) -> int:
        """Trials in flight: --parallel when given, else k x devices."""
        return self.packer.parallel

    @property
    def capacity(self) -> int:
        """Trials the session keeps proposed or in flight (one more than `parallel` waits in the queue)."""
        return self.packer.capacity

    def gpus(self) -> float | int:
        """What a trial submitted now asks for."""
        return self.packer.gpus()

    def packed(self, name: str, node: Callable[[State], State]) -> Callable[[State], State]:
        """`node` wrapped by the packer (k restored before it, decided anew after `analyse`)."""
        return self.packer.packed(name, node)

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _elapsed(self, state: State) -> float:
        """Session time so far, advanced to now (only time this process has been alive counts)."""
        now = time.time()
        state["elapsed"] = state.get("elapsed", 0.0) + (now - self._tick)
        self._tick = now
        return state["elapsed"]

    def _event(self, kind: str, state: State, **data: Any) -> None:
        trials = load(state.get("trials", []))
        counts = {s.value: sum(1 for t in trials if t.status is s) for s in TrialStatus}
        best = state.get("best")
        self.on_event({"event": kind, "session": self.session_id, "elapsed": round(state.get("elapsed", 0.0), 1),
                       "done": counts["succeeded"] + counts["failed"], "running": counts["running"],
                       "queued": counts["queued"] + counts["proposed"],
                       "stopped": counts["stopped"] + counts["paused"], "best": best["value"] if best else None,
                       **data})

    def _time_up(self, state: State) -> bool:
        minutes = self.cfg.budget_minutes
        return minutes is not None and state.get("elapsed", 0.0) >= minutes * 60

    def _cancel(self, t: Trial, reason: str) -> None:
        try:
            self.store.cancel(t.job_id, reason)
        except Exception:  # it finished on its own meanwhile
            pass
        self.notify()

    # -- nodes -----------------------------------------------------------------------------------------------------

    def propose(self, state: State) -> State:
        """The strategy's proposals (`orchestrator.agent.strategy`)."""
        return self.strategy.propose(state)

    def submit(self, state: State) -> State:
        """The strategy's submit (it ends in `queue_proposed`)."""
        return self.strategy.submit(state)

    def analyse(self, state: State) -> State:
        """The strategy's reading of what ended and what it decides from it."""
        return self.strategy.analyse(state)

    def decide(self, state: State) -> State:
        """The strategy's phase change and route."""
        return self.strategy.decide(state)

    def _record(self, n: int, phase: str, params: dict, proposer: str, rationale: str) -> Trial:
        return Trial(n=n, key=f"{self.session_id}:{n}", phase=Phase(phase), params=params, proposer=proposer,
                     rationale=rationale)

    def queue_proposed(self, state: State) -> State:
        """Queue every proposed trial exactly once (idempotency key), each with its own MLflow child run."""
        from orchestrator.api import jobs as api

        trials = load(state["trials"])
        for t in trials:
            if t.status is not S.PROPOSED or not self.strategy.ready(t):
                continue
            job = self.store.find_by_key(t.job_key)
            if job is not None:  # submitted before a crash: adopt what really runs
                t.params, run_id = dict(job.params or t.params), job.mlflow_run_id
            else:
                made = self.tracker.find_trial(self.spec.name, t.job_key)
                if made is not None:  # the run was made before a crash, the job was not: keep the run's params
                    t.params = self.spec.space.validate(self.tracker.params(made))
                tags = {"autoresearch.session": self.session_id, "autoresearch.proposer": t.proposer,
                        "autoresearch.phase": t.phase.value, "autoresearch.rationale": t.rationale,
                        "autoresearch.owner": self.session_id,
                        "autoresearch.project": getattr(self.cfg, "project", "default"),
                        **({"autoresearch.baseline": "true"} if t.phase is P.BASELINE else {}), **self.strategy.tags(t)}
                run_id = made or self.tracker.trial_run(state["parent_run"], self.spec.name, key=t.job_key,
                                                        name=f"{self.session_id} trial {t.n}", params=t.params,
                                                        tags=tags)
                spec = api.job_spec(self.spec, t.params, name=f"{self.spec.name}-{self.session_id}-{t.n}",
                                    priority=self.cfg.priority, gpus=self.gpus(), max_attempts=self.cfg.max_attempts,
                                    grace=Settings.stop_grace, preemptible=True, owner=self.session_id,
                                    env=self.strategy.env(t), mlflow_run_id=run_id, idempotency_key=t.job_key,
                                    project=getattr(self.cfg, "project", "default"), phase=t.phase.value,
                                    nodes=getattr(self.cfg, "nodes", 1), min_nodes=getattr(self.cfg, "min_nodes", None))
                job, _ = api.submit(spec, settings=self.settings, store=self.store)  # the checks people's jobs get
                if job.image:  # pinned by api.submit to the image's content id; the run says which
                    from orchestrator.tracking.jobruns import image_tags

                    self.tracker.set_tags(run_id, image_tags(job))
            t.update(job_id=job.id, run_id=job.mlflow_run_id or run_id, status=S.QUEUED, submitted_at=time.time())
            if t.run_id:
                self.tracker.set_tags(t.run_id, {"autoresearch.job_id": job.id})
            self._event("submitted", {**state, "trials": trials}, trial=t.n, job=job.id, proposer=t.proposer,
                        params=t.params, rationale=t.rationale)
        return {"trials": dump(trials)}

    def monitor(self, state: State) -> State:
        """Wait for an event: a job state change, a new ASHA rung reached, the time budget running out."""
        trials = load(state["trials"])
        deadline = time.time() + HEARTBEAT
        while True:
            changed = not any(t.status in (S.QUEUED, S.RUNNING, S.PAUSED) and not t.ended for t in trials)
            for t in trials:
                if t.status not in (S.QUEUED, S.RUNNING, S.PAUSED) or t.ended:
                    continue
                job = self.store.get(t.job_id)
                if job.final:
                    t.ended = True
                    changed = True
                    continue
                if t.status is S.QUEUED and job.state == "RUNNING":
                    t.status = S.RUNNING
                    changed = True
                    self._event("running", {**state, "trials": trials}, trial=t.n, job=job.id)
                changed = self.strategy.watch(t, job) or changed
            changed = self.strategy.wakes(trials) or changed
            self._elapsed(state)
            if changed or self._time_up(state) or time.time() >= deadline:
                break
            time.sleep(self.cfg.poll)
        return {"trials": dump(trials), "elapsed": state["elapsed"]}

    def _score(self, t: Trial) -> None:
        """Record a finished trial's place in the session's ranking on its job (checkpoint retention keeps the
        best few: `orchestrator.service.retention`)."""
        if t.job_id is not None and t.value is not None and t.status is S.SUCCEEDED:
            self.store.keeping.set_scores({t.job_id: self.spec.direction.score(t.value)})

    def _record_ends(self, state: State, trials: list[Trial], early_stopping: bool) -> dict | None:
        """Record how each newly ended trial ended, score it, and return the best search trial so far."""
        best = state.get("best")
        for t in trials:
            if not t.ended or t.status in FINAL:
                continue
            if self.outcomes.stopped_with_session(t, self.session_id):
                job_id = t.job_id
                if t.run_id:
                    self.tracker.finish(t.run_id, "KILLED")
                t.run_again()
                self._event("rerun", {**state, "trials": trials, "best": best}, trial=t.n, job=job_id,
                            message=f"trial {t.n} runs again: its job {job_id} was cancelled when the session "
                                    "was stopped")
                continue
            self.outcomes.record_end(t, early_stopping)
            self._score(t)
            # Once confirmation has begun, the candidates being re-run on fresh seeds stay the best: a search
            # trial that was still running and ends better shows on the leaderboard, but it was not confirmed.
            if t.status is S.SUCCEEDED and t.phase is P.SEARCH and state["phase"] == "search" and (
                    best is None or self.spec.better(t.value, best["value"])):
                best = {"n": t.n, "value": t.value, "params": t.params, "job_id": t.job_id}
            self._event(t.status.value, {**state, "trials": trials, "best": best}, trial=t.n, value=t.value,
                        error=t.error, phase=t.phase)
        return best

    def pause(self, state: State) -> State:
        """End this run of the graph paused at the LLM budget: nothing is in flight, nothing is cancelled (ASHA's
        paused trials wait in line as they were); `resume` with a higher cap continues from `propose`."""
        self._elapsed(state)
        self._event("phase", state, phase="paused", reason=state["budget_stop"])
        return {"paused": state["budget_stop"], "route": "end", "elapsed": state["elapsed"]}

    def finish(self, state: State) -> State:
        """Stop leftovers and wait for them, record how each ended, then log the best-so-far plot."""
        trials = load(state["trials"])
        pending = [t for t in trials if t.status in (*ACTIVE, S.PAUSED) and t.job_id is not None]
        self.phases.stop_paused(pending, f"session {self.session_id} finished")
        for t in pending:
            if t.status is not S.PAUSED:
                self._cancel(t, f"session {self.session_id} finished")
        deadline = time.time() + 90
        waiting = list(pending)
        while waiting and time.time() < deadline:
            waiting = [t for t in waiting if not self.store.get(t.job_id).final]
            time.sleep(self.cfg.poll if waiting else 0)
        for t in trials:
            if t.status in (*ACTIVE, S.PAUSED):
                if t.job_id is not None and self.store.get(t.job_id).final:
                    # A job that finished its budget before the cancel landed still counts.
                    self.outcomes.record_end(t, self.cfg.early_stopping)
                    self._score(t)
                    continue
                t.status = S.STOPPED if t.status is S.PAUSED else S.CANCELLED
                if t.run_id:
                    self.tracker.finish(t.run_id, "KILLED")
                if t.job_id is not None:
                    t.device_s = device_seconds(self.store, self.store.get(t.job_id))
        values = [t.value if t.status is S.SUCCEEDED else None for t in trials if t.phase is P.SEARCH]
        try:
            self.tracker.best_so_far_plot(state["parent_run"], values, self.spec.direction, self.spec.metric)
        except Exception as exc:  # a plot is not worth failing the session over
            self._event("warning", state, message=f"best-so-far plot failed: {exc}")
        return {"trials": dump(trials), "phase": "done", "route": "end"}


def _llm_of(proposer: Any) -> Any:
    """The LLM proposer inside `proposer` (itself, or a hybrid's), or None for a pure sampler."""
    from orchestrator.agent.proposers.llm import LLMProposer

    for candidate in (proposer, getattr(proposer, "llm", None)):
        if isinstance(candidate, LLMProposer):
            return candidate
    return None


def build(agent: Agent, checkpointer: Any) -> Any:
    """The compiled graph for `agent`, checkpointed by `checkpointer`."""
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(State)
    for name in ("propose", "submit", "monitor", "analyse", "decide", "pause", "finish"):
        graph.add_node(name, agent.packed(name, getattr(agent, name)))
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "submit")
    graph.add_edge("submit", "monitor")
    graph.add_edge("monitor", "analyse")
    graph.add_edge("analyse", "decide")
    graph.add_conditional_edges("decide", lambda s: s["route"], {"propose": "propose", "monitor": "monitor",
                                                                 "pause": "pause", "finish": "finish"})
    graph.add_edge("pause", END)
    graph.add_edge("finish", END)
    return graph.compile(checkpointer=checkpointer)
