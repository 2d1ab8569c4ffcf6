"""The agent loop as a LangGraph StateGraph, checkpointed after every step.

    START -> propose -> submit -> monitor -> analyse -> decide -+-> propose   (free slots, budget left)
                                    ^                           +-> monitor   (nothing to add: wait)
                                    +---------------------------+-> finish -> END

- propose: fill free slots (K in flight) with proposals, each recorded with its idempotency key
  `<session>:<n>` before anything is submitted; ASHA-paused trials that now rank well are promoted first.
- submit: create each proposal's MLflow child run and queue its job under that key. Re-running this node after
  a crash finds the run (by tag) and the job (by key) instead of making new ones; the params of whatever was
  made first win, so the state always describes what actually runs.
- monitor: block until something happens (a job changes state, a trial reaches an ASHA rung, the time budget
  runs out) or a heartbeat passes, so checkpoints track events rather than a polling clock.
- analyse: read final metrics, apply ASHA (demote losers: they checkpoint and wait in line), track the best.
- decide: move search -> confirm (fresh-seed re-runs of the best) -> done, and route.
- finish: stop leftovers, log the best-so-far plot and summary on the session run, record the leaderboard.

State is plain JSON-able data (the checkpoint); live resources (store, tracker, proposer) live on `Agent`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypedDict

from orchestrator.agent import search
from orchestrator.agent.history import Results, device_seconds, is_final
from orchestrator.agent.proposers.base import Observation
from orchestrator.agent.stopping import ASHA

ACTIVE = ("proposed", "queued", "running")
FINAL = ("succeeded", "failed", "stopped", "cancelled")
HEARTBEAT = 15.0


class State(TypedDict, total=False):
    """The checkpointed state of a session."""

    session: str
    config: dict
    parent_run: str
    phase: str  # search | confirm | done
    trials: list[dict]
    elapsed: float  # seconds this session has been alive (time while killed does not count)
    best: dict | None
    usage: dict
    stop_reason: str
    route: str


class Agent:
    """The nodes of the graph plus the live resources they use. See `orchestrator.agent.runner` to run one."""

    def __init__(self, *, session_id: str, config: Any, spec: Any, store: Any, tracker: Any,
                 parallel: int, proposer: Any = None, notify: Callable[[], None] = lambda: None,
                 on_event: Callable[[dict], None] = lambda e: None):
        self.session_id = session_id
        self.cfg = config
        self.spec = spec
        self.store = store
        self.tracker = tracker
        self.parallel = parallel
        # One proposal more than there are devices waits in the queue: a freed device starts the next trial at
        # once (no round trip through the agent), and a demoted trial (lower priority) never slips into it.
        self.capacity = parallel + 1
        self.notify = notify
        self.on_event = on_event
        self.fixed = search.fixed_params(spec, config.fixed, config.seed)
        self.searched = search.reduced(spec, self.fixed)
        self.results = Results(store, tracker, spec)
        if proposer is None:
            from orchestrator.agent.proposers import make

            proposer = make(config.proposer, self.searched, config.goal, seed=config.seed, model=config.model,
                            llm_options=config.llm)
        self.proposer = proposer
        # Rungs count progress reports (evaluations), not optimizer steps: trials with different batch sizes
        # then meet at the same fraction of their budget (digits reports once per epoch).
        self.asha = ASHA(grace=1, eta=config.eta, direction=spec.direction)
        self.progress_metric = spec.progress_metric or spec.metric
        self._tick = time.time()

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _elapsed(self, state: State) -> float:
        """Session time so far, advanced to now (only time this process has been alive counts)."""
        now = time.time()
        state["elapsed"] = state.get("elapsed", 0.0) + (now - self._tick)
        self._tick = now
        return state["elapsed"]

    def _event(self, kind: str, state: State, **data: Any) -> None:
        trials = state.get("trials", [])
        counts = {s: sum(1 for t in trials if t["status"] == s) for s in (*ACTIVE, *FINAL, "paused")}
        best = state.get("best")
        self.on_event({"event": kind, "session": self.session_id, "elapsed": round(state.get("elapsed", 0.0), 1),
                       "done": counts["succeeded"] + counts["failed"], "running": counts["running"],
                       "queued": counts["queued"] + counts["proposed"],
                       "stopped": counts["stopped"] + counts["paused"], "best": best["value"] if best else None,
                       **data})

    def _time_up(self, state: State) -> bool:
        minutes = self.cfg.budget_minutes
        return minutes is not None and state.get("elapsed", 0.0) >= minutes * 60

    def _cancel(self, t: dict, reason: str) -> None:
        try:
            self.store.cancel(t["job_id"], reason)
        except Exception:  # it finished on its own meanwhile
            pass
        self.notify()

    # -- nodes -----------------------------------------------------------------------------------------------------

    def propose(self, state: State) -> State:
        """Fill free slots: promoted paused trials first, then new proposals (search) or re-runs (confirm)."""
        self._elapsed(state)
        trials = [dict(t) for t in state["trials"]]
        free = self.capacity - sum(1 for t in trials if t["status"] in ACTIVE)
        search_max, n_confirm = self.cfg.split()
        if state["phase"] == "search" and free > 0:
            if self.cfg.early_stopping:
                paused = [t for t in trials if t["status"] == "paused"]
                for t in self.asha.promotable(paused, [t for t in trials if t["phase"] == "search"])[:free]:
                    try:
                        self.store.demote(t["job_id"], self.cfg.priority, "promoted by ASHA: now in the top 1/eta")
                    except Exception:  # it ended meanwhile; the next monitor pass records how
                        continue
                    self.notify()
                    t.update(status="queued", stopped_at=None)
                    free -= 1
                    self._event("promoted", {**state, "trials": trials}, trial=t["n"])
            n_search = sum(1 for t in trials if t["phase"] == "search")
            n = free if search_max is None else min(free, search_max - n_search)
            if n > 0:
                history = [_project(o, self.searched) for o in self.results.observations(trials)]
                proposals = self.proposer.propose(n, history)
                usage = dict(state.get("usage") or {})
                take = getattr(self.proposer, "take_usage", None)
                for k, v in (take() if take else {}).items():
                    usage[k] = usage.get(k, 0) + v
                state["usage"] = usage
                for p in proposals:
                    trials.append(self._record(len(trials), "search", search.full(self.spec, p.params, self.fixed),
                                               p.proposer, p.rationale))
        elif state["phase"] == "confirm" and not any(t["phase"] == "confirm" for t in trials) and state.get("best"):
            best = state["best"]["params"]
            for seed in search.confirm_seeds(self.session_id, n_confirm, int(self.fixed.get(search.SEED_KEY, -1))):
                params = dict(best, **({search.SEED_KEY: seed} if search.SEED_KEY in self.spec.space else {}))
                trials.append(self._record(len(trials), "confirm", self.spec.space.validate(params), "confirm",
                                           f"re-run of trial {state['best']['n']} on a fresh seed"))
        return {"trials": trials, "elapsed": state["elapsed"], "usage": state.get("usage", {})}

    def _record(self, n: int, phase: str, params: dict, proposer: str, rationale: str) -> dict:
        return {"n": n, "key": f"{self.session_id}:{n}", "phase": phase, "params": params, "proposer": proposer,
                "rationale": rationale, "status": "proposed", "job_id": None, "run_id": None, "value": None,
                "rungs": {}, "judged": [], "stopped_at": None, "last_step": None, "device_s": 0.0, "error": ""}

    def submit(self, state: State) -> State:
        """Queue every proposed trial exactly once (idempotency key), each with its own MLflow child run."""
        from orchestrator import api
        from orchestrator.queue.models import JobSpec

        trials = [dict(t) for t in state["trials"]]
        for t in trials:
            if t["status"] != "proposed":
                continue
            job = self.store.find_by_key(t["key"])
            if job is not None:  # submitted before a crash: adopt what really runs
                t["params"], run_id = dict(job.params or t["params"]), job.mlflow_run_id
            else:
                made = self.tracker.find_trial(self.spec.name, t["key"])
                if made is not None:  # the run was made before a crash, the job was not: keep the run's params
                    t["params"] = self.spec.space.validate(self.tracker.params(made))
                tags = {"autoresearch.session": self.session_id, "autoresearch.proposer": t["proposer"],
                        "autoresearch.phase": t["phase"], "autoresearch.rationale": t["rationale"],
                        "autoresearch.owner": self.session_id}
                run_id = made or self.tracker.trial_run(state["parent_run"], self.spec.name, key=t["key"],
                                                        name=f"{self.session_id} trial {t['n']}", params=t["params"],
                                                        tags=tags)
                spec = JobSpec(argv=self.spec.argv(in_image=bool(self.spec.image)),
                               name=f"{self.spec.name}-{self.session_id}-{t['n']}",
                               priority=self.cfg.priority, gpus=1, max_attempts=self.cfg.max_attempts, grace=30.0,
                               preemptible=True, owner=self.session_id, experiment=self.spec.name,
                               params=t["params"], env={}, cwd=_repo_root(), mlflow_run_id=run_id,
                               idempotency_key=t["key"], image=self.spec.image)
                if spec.image:  # pinned to the image's content id; the run says which
                    from orchestrator.jobenv import image_tags, prepare

                    spec = prepare(spec)
                    self.tracker.set_tags(run_id, image_tags(spec))
                job = self.store.submit(spec)
                self.notify()
            t.update(job_id=job.id, run_id=job.mlflow_run_id or run_id, status="queued", submitted_at=time.time())
            if t["run_id"]:
                self.tracker.set_tags(t["run_id"], {"autoresearch.job_id": job.id})
            self._event("submitted", {**state, "trials": trials}, trial=t["n"], job=job.id, proposer=t["proposer"],
                        params=t["params"], rationale=t["rationale"])
        return {"trials": trials}

    def monitor(self, state: State) -> State:
        """Wait for an event: a job state change, a new ASHA rung reached, the time budget running out."""
        trials = [dict(t) for t in state["trials"]]
        deadline = time.time() + HEARTBEAT
        while True:
            changed = False
            for t in trials:
                if t["status"] not in ("queued", "running", "paused") or t.get("ended"):
                    continue
                job = self.store.get(t["job_id"])
                if is_final(job):
                    t["ended"] = True
                    changed = True
                    continue
                if t["status"] == "queued" and job.state == "RUNNING":
                    t["status"] = "running"
                    changed = True
                    self._event("running", {**state, "trials": trials}, trial=t["n"], job=job.id)
                if t["status"] == "running" and t["phase"] == "search" and self.cfg.early_stopping and t["run_id"]:
                    history = self.tracker.history(t["run_id"], self.progress_metric)
                    if history:
                        t["last_step"] = history[-1][0]
                    rungs = {str(k): v for k, v in self.asha.rung_values(reports(history)).items()}
                    if rungs.keys() - t["rungs"].keys():
                        t["rungs"] = rungs
                        changed = True
            self._elapsed(state)
            if changed or self._time_up(state) or time.time() >= deadline:
                break
            time.sleep(self.cfg.poll)
        return {"trials": trials, "elapsed": state["elapsed"]}

    def analyse(self, state: State) -> State:
        """Record finished trials, pause ASHA losers, update the best and the session run's metrics."""
        trials = [dict(t) for t in state["trials"]]
        best = state.get("best")
        for t in trials:
            if not t.get("ended") or t["status"] in FINAL:
                continue
            job = self.store.get(t["job_id"])
            t["device_s"] = device_seconds(self.store, job)
            t["finished_at"] = job.finished_at
            if job.state == "SUCCEEDED":
                if t["phase"] == "search" and self.cfg.early_stopping:
                    # A trial can finish between two looks; its rung values are what later trials meet there.
                    history = self.tracker.history(t["run_id"], self.progress_metric)
                    t["rungs"] = {str(k): v for k, v in self.asha.rung_values(reports(history)).items()}
                t["value"] = self.tracker.final(t["run_id"], self.spec.metric)
                t["status"] = "succeeded" if t["value"] is not None else "failed"
                t["error"] = "" if t["value"] is not None else f"no {self.spec.metric} logged"
            elif job.state == "FAILED":
                t.update(status="failed", error=f"exit code {job.exit_code}: {job.reason}"[:300])
            else:
                t["status"] = "stopped" if t.get("stopped_at") is not None else "cancelled"
            self.tracker.finish(t["run_id"], {"succeeded": "FINISHED", "failed": "FAILED"}.get(t["status"], "KILLED"))
            # Once confirmation has begun, the candidate being re-run on fresh seeds stays the best: a search
            # trial that was still running and ends better shows on the leaderboard, but it was not confirmed.
            if t["status"] == "succeeded" and t["phase"] == "search" and state["phase"] == "search" and (
                    best is None or self.spec.better(t["value"], best["value"])):
                best = {"n": t["n"], "value": t["value"], "params": t["params"], "job_id": t["job_id"]}
            self._event(t["status"], {**state, "trials": trials, "best": best}, trial=t["n"], value=t["value"],
                        error=t["error"])
        if self.cfg.early_stopping:
            peers = [t for t in trials if t["phase"] == "search"]
            for t in trials:
                if t["status"] != "running" or t["phase"] != "search" or t.get("ended"):
                    continue
                rung = self.asha.judge(t, peers)
                t["judged"] = sorted({*t["judged"], *(int(k) for k in t["rungs"] if rung is None or int(k) <= rung)})
                if rung is not None:
                    try:
                        self.store.demote(t["job_id"], self.cfg.priority - 1,
                                          f"ASHA: outside the top 1/{self.asha.eta} at step {rung}")
                    except Exception:  # finished in the meantime: the next monitor pass records it
                        continue
                    self.notify()
                    t.update(status="paused", stopped_at=rung)
                    self._event("paused", {**state, "trials": trials, "best": best}, trial=t["n"], rung=rung,
                                value=t["rungs"][str(rung)])
        done = [t for t in trials if t["status"] in FINAL]
        metrics = {"trials_done": len(done), "trials_running": sum(t["status"] == "running" for t in trials),
                   "trials_stopped": sum(t["status"] in ("stopped", "paused") for t in trials)}
        if best:
            metrics["best_so_far"] = best["value"]
        for k, v in (state.get("usage") or {}).items():
            metrics[f"llm_{k}"] = v
        self.tracker.log_metrics(state["parent_run"], metrics, step=len(done))
        return {"trials": trials, "best": best}

    def decide(self, state: State) -> State:
        """Phase changes (search -> confirm -> done) and the route to take next."""
        self._elapsed(state)
        trials = [dict(t) for t in state["trials"]]
        phase, reason = state["phase"], state.get("stop_reason", "")
        search_max, n_confirm = self.cfg.split()
        active = [t for t in trials if t["status"] in ACTIVE]
        best = state.get("best")
        if phase == "search":
            target = self.cfg.target
            hit = target is not None and best is not None and not self.spec.better(target, best["value"])
            n_search = sum(1 for t in trials if t["phase"] == "search")
            exhausted = search_max is not None and n_search >= search_max
            reserve = 0.0
            if n_confirm and self.cfg.budget_minutes:
                # Room for one more round: the slowest finished trial, with a margin for a busy machine.
                took = [t["device_s"] for t in trials if t["status"] == "succeeded"]
                reserve = 1.25 * max(took) if took else 0.0
            late = self.cfg.budget_minutes is not None and state["elapsed"] >= self.cfg.budget_minutes * 60 - reserve
            if hit or late or (exhausted and not active):
                reason = ("target reached" if hit else "time budget reached" if self._time_up(state)
                          else "time left only for the confirmation re-runs" if late else "trial budget used")
                for t in trials:
                    if t["status"] in (*ACTIVE, "paused") and t["job_id"] is not None:
                        self._cancel(t, f"session {self.session_id}: {reason}")
                    if t["status"] == "proposed":
                        t["status"] = "cancelled"
                phase = "confirm" if n_confirm and best and not self._time_up(state) else "done"
                self._event("phase", {**state, "trials": trials}, phase=phase, reason=reason)
        elif phase == "confirm":
            confirm = [t for t in trials if t["phase"] == "confirm"]
            if self._time_up(state):
                for t in confirm:
                    if t["status"] in ACTIVE and t["job_id"] is not None:
                        self._cancel(t, f"session {self.session_id}: time budget reached")
                phase, reason = "done", "time budget reached during the confirmation re-runs"
            elif confirm and all(t["status"] in FINAL for t in confirm):
                phase = "done"
        active = [t for t in trials if t["status"] in ACTIVE]
        if phase == "done":
            route = "finish"
        elif phase == "confirm" and not any(t["phase"] == "confirm" for t in trials) and len(active) < self.capacity:
            route = "propose"
        elif phase == "search" and len(active) < self.capacity and (
                search_max is None or sum(t["phase"] == "search" for t in trials) < search_max
                or any(t["status"] == "paused" for t in trials)):
            route = "propose"
        else:
            route = "monitor"
        return {"trials": trials, "phase": phase, "stop_reason": reason, "route": route, "elapsed": state["elapsed"]}

    def finish(self, state: State) -> State:
        """Stop leftovers and wait for them, then summarise on the session run."""
        trials = [dict(t) for t in state["trials"]]
        pending = [t for t in trials if t["status"] in (*ACTIVE, "paused") and t["job_id"] is not None]
        for t in pending:
            self._cancel(t, f"session {self.session_id} finished")
        deadline = time.time() + 90
        while pending and time.time() < deadline:
            pending = [t for t in pending if not is_final(self.store.get(t["job_id"]))]
            time.sleep(self.cfg.poll if pending else 0)
        for t in trials:
            if t["status"] in (*ACTIVE, "paused"):
                t["status"] = "stopped" if t["status"] == "paused" else "cancelled"
                if t["run_id"]:
                    self.tracker.finish(t["run_id"], "KILLED")
                if t["job_id"] is not None:
                    t["device_s"] = device_seconds(self.store, self.store.get(t["job_id"]))
        values = [t["value"] if t["status"] == "succeeded" else None for t in trials if t["phase"] == "search"]
        try:
            self.tracker.best_so_far_plot(state["parent_run"], values, self.spec.direction, self.spec.metric)
        except Exception as exc:  # a plot is not worth failing the session over
            self._event("warning", state, message=f"best-so-far plot failed: {exc}")
        return {"trials": trials, "phase": "done", "route": "end"}


def reports(history: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(report number, value) from (step, value): one report per distinct step (a resumed job may re-log one)."""
    seen: dict[int, float] = {}
    for step, value in history:
        seen.setdefault(step, value)
    return [(i + 1, seen[step]) for i, step in enumerate(sorted(seen))]


def _project(obs: Observation, searched: Any) -> Observation:
    import dataclasses

    return dataclasses.replace(obs, params=search.project(obs.params, searched.space))


def _repo_root() -> str:
    """Where the bundled experiments' modules resolve (`python -m experiments.<name>.train`)."""
    from pathlib import Path

    import experiments

    return str(Path(experiments.__file__).resolve().parent.parent)


def build(agent: Agent, checkpointer: Any) -> Any:
    """The compiled graph for `agent`, checkpointed by `checkpointer`."""
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(State)
    for name in ("propose", "submit", "monitor", "analyse", "decide", "finish"):
        graph.add_node(name, getattr(agent, name))
    graph.add_edge(START, "propose")
    graph.add_edge("propose", "submit")
    graph.add_edge("submit", "monitor")
    graph.add_edge("monitor", "analyse")
    graph.add_edge("analyse", "decide")
    graph.add_conditional_edges("decide", lambda s: s["route"], {"propose": "propose", "monitor": "monitor",
                                                                 "finish": "finish"})
    graph.add_edge("finish", END)
    return graph.compile(checkpointer=checkpointer)
