"""A session's phases: search -> confirm (fresh-seed re-runs of the top candidates) -> done.

A collaborator of `orchestrator.agent.graph.Agent`, handed the agent as its `host` (what it reads and calls there
is declared by `Host`), kept apart so the graph module holds the nodes' plumbing and this one the rules for moving
between phases: when the search
stops (trial budget, target, time left only for the re-runs), which candidates are re-run on which seeds, and
when the session is done. The winner is decided afterwards by the noise gate against the baseline
(`orchestrator.agent.report`), on the re-runs alone: the search run that selected a candidate never gates it.
"""

from __future__ import annotations

from typing import Any, Protocol

from orchestrator.agent import search
from orchestrator.agent.trial import Phase, State, Trial, TrialStatus, dump, load

S, P = TrialStatus, Phase

ACTIVE = tuple(s for s in TrialStatus if s.active)
FINAL = tuple(s for s in TrialStatus if s.final)


class Host(Protocol):
    """What the phase rules need of the agent they serve (`orchestrator.agent.graph.Agent`)."""

    session_id: str
    cfg: Any  # SessionConfig: budgets, confirm_top, confirm_seeds, early_stopping, target
    spec: Any  # ExperimentSpec: direction, better()
    baseline: dict[str, Any]
    seeds: list[int]
    parallel: int
    capacity: int
    asha: Any

    def _record(self, n: int, phase: str, params: dict, proposer: str, rationale: str) -> Trial: ...

    def _cancel(self, t: Trial, reason: str) -> None: ...

    def _elapsed(self, state: State) -> float: ...

    def _time_up(self, state: State) -> bool: ...

    def _event(self, kind: str, state: State, **data: Any) -> None: ...


class Phases:
    """Phase changes and confirmation planning for `host`'s session."""

    def __init__(self, host: Host):
        self.host = host

    def plan_confirmation(self, trials: list[Trial], n_confirm: int) -> list[int]:
        """Record up to `n_confirm` re-runs of the top `confirm_top` candidates by mean, `confirm_seeds` fresh
        seeds each (the seeds the baseline ran on first), appended to `trials`; the candidates' trial numbers."""
        candidates, left = [], n_confirm
        host = self.host
        for rep, used in search.top_candidates(trials, host.baseline, host.spec.direction, host.cfg.confirm_top):
            if left <= 0:
                break
            fresh = [s for s in self.host.seeds[1:] if s not in used][: min(self.host.cfg.confirm_seeds, left)]
            for seed in fresh:
                trials.append(self.host._record(len(trials), "confirm", search.seeded(self.host.spec, rep.params, seed),
                                           "confirm", f"re-run of trial {rep.n} on a fresh seed"))
            left -= len(fresh)
            candidates.append(rep.n)
        return candidates

    def stop_paused(self, trials: list[Trial], reason: str) -> None:
        """Stop the ASHA-paused trials among `trials` while they wait in line (QUEUED -> CANCELLED at once), before
        anything else of the session is cancelled: a device that a cancel frees must never restart a paused
        trial only for it to be cancelled a moment later. A paused trial whose job an idle device resumed
        meanwhile is cancelled like any running one."""
        for t in trials:
            if t.status is S.PAUSED and t.job_id is not None:
                self.host._cancel(t, reason)

    def _full_trial_s(self, trials: list[Trial]) -> float | None:
        """What a whole trial costs here: the median device time of the finished ones (the baseline's count: they
        run the full budget too), or None before any has finished."""
        took = sorted(t.device_s for t in trials if t.status is S.SUCCEEDED)
        return took[len(took) // 2] if took else None

    def _confirm_reserve(self, trials: list[Trial], n_confirm: int) -> float:
        """Seconds to keep for the confirmation re-runs (they share the devices): a typical finished trial per
        round, with a margin for a busy machine; 0 before any trial has finished."""
        full = self._full_trial_s(trials)
        rounds = -(-n_confirm // max(1, self.host.parallel))
        return 1.25 * full * rounds if full and n_confirm else 0.0

    def winding_down(self, state: State, trials: list[Trial]) -> bool:
        """Whether a time-budgeted ASHA search must now finish what it has rather than widen: no search trial has
        finished, and only the time for one whole trial and the confirmation re-runs is left. Promotions would
        wait on peers that no longer come, so the session would reach its end with nothing to confirm."""
        minutes, (_, n_confirm) = self.host.cfg.budget_minutes, self.host.cfg.split()
        if not (minutes and n_confirm and self.host.cfg.early_stopping and state["phase"] == "search"):
            return False
        if any(t.phase is P.SEARCH and t.status is S.SUCCEEDED for t in trials):
            return False
        full = self._full_trial_s(trials)
        left = minutes * 60 - state["elapsed"]
        return bool(full) and left <= self._confirm_reserve(trials, n_confirm) + 1.25 * full

    def to_finish(self, trials: list[Trial], free: int) -> tuple[list[Trial], int]:
        """While winding down: the paused trials to resume now (the furthest and best first), and how many new
        ones may still start (only when none is paused), so that `confirm_top` search trials are on their way to
        a final value; the devices this leaves idle are the price of having a candidate at all."""
        inflight = sum(1 for t in trials if t.phase is P.SEARCH and t.status in ACTIVE)
        room = max(0, min(free, self.host.cfg.confirm_top - inflight))
        paused = [t for t in trials if t.status is S.PAUSED and not t.ended]
        by_n = {t.n: t for t in paused}
        resume = [by_n[v["n"]] for v in self.host.asha.most_promising([t.config_values() for t in paused])][:room]
        return resume, (0 if paused else room)

    def _hopeless(self, trials: list[Trial]) -> list[Trial]:
        """Paused trials no later report can promote: the search proposes nothing more, and every peer without
        a value at the rung where one was stopped has finished, so its rank there is final."""
        peers = [t for t in trials if t.phase in (P.BASELINE, P.SEARCH)]
        paused = [t for t in trials if t.status is S.PAUSED and not t.ended]
        promotable = {v["n"] for v in self.host.asha.promotable([t.config_values() for t in paused],
                                                            [p.config_values() for p in peers])}
        return [t for t in paused if t.n not in promotable and t.stopped_at is not None
                and all(str(t.stopped_at) in p.rungs or p.status in FINAL for p in peers)]

    def decide(self, state: State) -> State:
        """Phase changes (search -> confirm -> done) and the route to take next."""
        self.host._elapsed(state)
        trials = load(state["trials"])
        phase, reason = state["phase"], state.get("stop_reason", "")
        search_max, n_confirm = self.host.cfg.split()
        active = [t for t in trials if t.status in ACTIVE]
        best = state.get("best")
        if phase == "search":
            target = self.host.cfg.target
            hit = target is not None and best is not None and not self.host.spec.better(target, best["value"])
            n_search = sum(1 for t in trials if t.phase is P.SEARCH)
            exhausted = search_max is not None and n_search >= search_max
            # Until a search trial has finished there is nothing to confirm, so the search goes on (winding down
            # near the end: `winding_down`).
            reserve = self._confirm_reserve(trials, n_confirm) if self.host.cfg.budget_minutes and best else 0.0
            minutes = self.host.cfg.budget_minutes
            late = minutes is not None and state["elapsed"] >= minutes * 60 - reserve
            searching = [t for t in active if t.phase is not P.BASELINE]
            if exhausted and self.host.cfg.early_stopping:
                self.stop_paused(self._hopeless(trials), "ASHA: no later trial can promote it")
            if hit or late or (exhausted and not searching):
                reason = ("target reached" if hit else "time budget reached" if self.host._time_up(state)
                          else "time left only for the confirmation re-runs" if late else "trial budget used")
                # The baseline runs on (it is what the winner is judged against) unless time is up.
                keep = not self.host._time_up(state)
                self.stop_paused(trials, f"session {self.host.session_id}: {reason}")
                for t in trials:
                    if t.status in ACTIVE and t.job_id is not None and not (keep and t.phase is P.BASELINE):
                        self.host._cancel(t, f"session {self.host.session_id}: {reason}")
                    if t.status is S.PROPOSED:
                        t.status = S.CANCELLED
                phase = "confirm" if n_confirm and best and not self.host._time_up(state) else "done"
                self.host._event("phase", {**state, "trials": trials}, phase=phase, reason=reason)
        elif phase == "confirm":
            waiting = [t for t in trials if t.phase in (P.CONFIRM, P.BASELINE)]
            if self.host._time_up(state):
                for t in waiting:
                    if t.status in ACTIVE and t.job_id is not None:
                        self.host._cancel(t, f"session {self.host.session_id}: time budget reached")
                phase, reason = "done", "time budget reached during the confirmation re-runs"
            elif state.get("confirm_planned") and all(t.status in FINAL for t in waiting):
                phase = "done"
        active = [t for t in trials if t.status in ACTIVE]
        if phase != "done" and any(t.status is S.PROPOSED for t in trials):
            route = "propose"  # one recorded but not queued (a trial a `stop` cut short, run again): submit it
        elif phase == "search" and state.get("budget_stop"):
            # The LLM budget is spent: no new proposal; what is in flight finishes and is judged, then pause.
            route = "monitor" if active else "pause"
        elif phase == "done":
            route = "finish"
        elif phase == "confirm" and not state.get("confirm_planned"):
            route = "propose"
        elif phase == "search" and len(active) < self.host.capacity and (
                search_max is None or sum(t.phase is P.SEARCH for t in trials) < search_max
                or any(t.status is S.PAUSED for t in trials)):
            route = "propose"
        else:
            route = "monitor"
        return {"trials": dump(trials), "phase": phase, "stop_reason": reason, "route": route,
                "elapsed": state["elapsed"]}
