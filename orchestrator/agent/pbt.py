"""Population-based training as an agent: `start --proposer pbt --population N --perturbation-interval K`.

The graph is the agent's (`orchestrator.agent.graph`); this is its strategy (`orchestrator.agent.strategy`),
in place of the default `Search`:

- propose: the population first, N members at once (member 0 the experiment's defaults, the others with their
  mutable params drawn from the space); in the confirm phase, the baseline and the replays of the winner.
- monitor: each member's progress history is read; reaching an unjudged interval (a multiple of K steps below
  the budget) wakes the loop.
- analyse: once every live member has reported at interval b, the bottom quantile exploits the top
  (`orchestrator.agent.schedule.pairs`): the loser's job is cancelled (it checkpoints; its trial ends
  stopped) and a child trial, recorded with its key before anything happens, takes the loser's slot with the
  donor's params perturbed (`perturb`). The interval is recorded as judged in the same checkpointed step.
- submit: a child's donor checkpoint (the one at the judged interval) is copied once into the child's fork
  dir (`Layout.fork_dir(key)`: a copy under a temporary name, renamed; one that exists is never copied
  again), then the child is queued with `AUTORESEARCH_INIT_CHECKPOINT` (its job starts from that copy),
  `AUTORESEARCH_SCHEDULE` (its lineage) and `AUTORESEARCH_CHECKPOINT_EVERY=K` (every member keeps a
  checkpoint at each interval for donors).
- decide: when every member's last trial has ended, the best finished member's schedule is replayed from
  scratch on `confirm_seeds` fresh seeds beside the baseline's `baseline_seeds` runs; the session's gate
  judges those replays alone (the lineage that found the schedule only ranks it), so a lucky lineage is
  never a win.

The budget is the population's: N members, each to the experiment's full step budget, however often they fork.
Crash safety is the graph's: every decision is in the checkpointed state before it acts, cancels and submits
are idempotent, and decisions are seeded by the session, so a `kill -9` and `resume` make the same ones.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments.common import CHECKPOINT_EVERY_ENV, INIT_CHECKPOINT_ENV, SCHEDULE_ENV
from orchestrator.agent import schedule as sched
from orchestrator.agent import search
from orchestrator.agent.strategy import Host
from orchestrator.agent.phases import ACTIVE, FINAL
from orchestrator.agent.trial import Phase, State, Trial, TrialStatus, dump, load
from orchestrator.core.errors import BadInput

if TYPE_CHECKING:
    from orchestrator.queue.models import Job

S, P = TrialStatus, Phase
METADATA = ".metadata"  # a DCP checkpoint counts once this is committed (runtime.checkpoint)
TAG = "autoresearch.pbt."


def check(spec: Any) -> None:
    """BadInput unless `spec` declares what may change mid-training (`mutable`)."""
    if not getattr(spec, "mutable", ()):
        raise BadInput(f"--proposer pbt: experiment {spec.name} declares no mutable params (what may change "
                       "mid-training: `mutable` in its spec or its autoresearch.toml)")
    if spec.run is not None and not (spec.steps and spec.resume):
        missing = " and ".join(k for k, v in (("steps", spec.steps), ("resume", spec.resume)) if not v)
        raise BadInput(f"--proposer pbt: config-file experiment {spec.name} needs {missing} in [experiment] (the "
                       "parameter where the script stops, e.g. steps = \"max_iters\", and its resume flag): PBT runs "
                       "it in segments that resume from its checkpoint dir")
    if spec.run is not None and "{checkpoint_dir}" not in spec.run:
        raise BadInput(f"--proposer pbt: config-file experiment {spec.name}'s run must pass {{checkpoint_dir}} (where "
                       "the script keeps its state: each member has its own, and forks copy it)")


class PBT:
    """Population-based training as the agent's strategy (`orchestrator.agent.strategy`; see the module doc)."""

    proposes = False  # members are drawn once, then copied and perturbed: no proposer is asked

    def __init__(self, host: Host):
        from orchestrator.core.layout import Layout

        self.host = host
        check(host.spec)
        self.mutable = [m for m in host.spec.mutable if m in host.searched.space]
        self.population = int(host.cfg.population or 2)
        self.interval = int(host.cfg.perturbation_interval or 1)
        self.layout = Layout(host.settings.home) if host.settings is not None else None
        self._held: dict[int, Trial] = {}  # children waiting for their donor's checkpoint -> the donor

    # -- propose ---------------------------------------------------------------------------------------------

    def propose(self, state: State) -> State:
        """The population (once), then in the confirm phase the baseline and the winner's replays (once)."""
        self.host._elapsed(state)
        trials = load(state["trials"])
        candidates = list(state.get("candidates") or [])
        if state["phase"] == "search" and not trials and not self.host._time_up(state):
            for m in range(self.population):
                host = self.host
                params = dict(host.baseline) if m == 0 else sched.sample(
                    host.spec.space, self.mutable, host.baseline, sched.rng(host.session_id, "member", m))
                params = search.full(self.host.spec, params, self.host.fixed)
                t = self.host._record(len(trials), "search", params, "pbt",
                                      "population member 0: the experiment's defaults" if m == 0 else
                                      f"population member {m}: mutable params drawn from the space")
                t.update(member=m, schedule=[[0, {k: params[k] for k in self.mutable}]])
                trials.append(t)
        elif state["phase"] == "confirm" and not state.get("confirm_planned"):
            candidates, state["confirm_planned"] = self._plan_replays(trials, state.get("best")), True
        return {"trials": dump(trials), "elapsed": state["elapsed"], "candidates": candidates,
                "confirm_planned": bool(state.get("confirm_planned"))}

    def _plan_replays(self, trials: list[Trial], best: dict | None) -> list[int]:
        """The baseline's runs and `confirm_seeds` fresh-seed replays of the best member's schedule."""
        for seed in self.host.seeds[: self.host.cfg.baseline_seeds]:
            params = search.seeded(self.host.spec, self.host.baseline, seed)
            why = "the baseline: the experiment's defaults"
            trials.append(self.host._record(len(trials), "baseline", params, "baseline", why))
        if best is None:
            return []
        winner = next(t for t in trials if t.n == best["n"])
        start = {**winner.params, **winner.schedule[0][1]}
        for seed in self.host.seeds[1: 1 + self.host.cfg.confirm_seeds]:
            t = self.host._record(len(trials), "confirm", search.seeded(self.host.spec, start, seed), "confirm",
                                  f"replay of trial {winner.n}'s schedule from scratch on a fresh seed")
            t.update(schedule=winner.schedule, lineage={"replays": winner.n})
            trials.append(t)
        return [winner.n]

    # -- submit: the fork's copy first, once -----------------------------------------------------------------

    def submit(self, state: State) -> State:
        """Copy each new child's donor checkpoint (once), then queue every proposed trial (the graph's submit). A
        child whose donor is still writing the checkpoint of the judged interval (its report there can reach
        MLflow first) is held, proposed, until it is there (`_ready`, `_wakes`)."""
        trials = load(state["trials"])
        self._held = {}
        for t in trials:
            if t.status is S.PROPOSED and t.lineage.get("parent") is not None and t.lineage.get("fork_step") is None:
                donor = next(d for d in trials if d.n == t.lineage["parent"])
                try:
                    forked = self._fork(t, donor)
                except NothingToFork as e:  # the donor ended before it kept any checkpoint: no state to copy
                    t.update(status=S.CANCELLED, error=str(e))
                    self.host._event("fork_failed", {**state, "trials": trials}, trial=t.n, parent=donor.n,
                                     message=f"trial {t.n} cancelled: {e}")
                    continue
                if forked is None:
                    self._held[t.n] = donor
                    continue
                step, copied = forked
                t.lineage["fork_step"] = step
                t.schedule = [*donor.schedule, [step, dict(t.lineage["after"])]]
                self.host._event("forked", {**state, "trials": trials}, trial=t.n, parent=donor.n, step=step,
                                 copied=copied, message=f"trial {t.n} forked from trial {donor.n} at step {step}"
                                 f"{' (checkpoint copied)' if copied else ''}")
        return self.host.queue_proposed({**state, "trials": dump(trials)})

    def ready(self, t: Trial) -> bool:
        return t.n not in self._held

    def wakes(self, trials: list[Trial]) -> bool:
        """A held child's donor checkpoint is now there (or its donor ended): the loop comes back to submit it."""
        live = {t.n: t for t in trials}
        for n, donor in self._held.items():
            child = live.get(n)
            try:
                if child is None or self._source(child, live.get(donor.n, donor)) is not None:
                    return True
            except NothingToFork:
                return True
        return False

    def _source(self, child: Trial, donor: Trial) -> Path | None:
        """The donor checkpoint the child copies (`_pick`), or None while the donor still runs and has not yet
        committed one at the judged interval or later (the report of a step can be read before the save that
        follows it is done). NothingToFork when the donor ended with no checkpoint at all."""
        steps = [p for p in self.layout.checkpoint_dir(donor.job_id).glob("step_*") if (p / METADATA).exists()]
        at = child.lineage.get("at")
        running = donor.status not in FINAL and not donor.ended
        if running and at is not None and not any(int(p.name.split("_")[1]) >= at for p in steps):
            return None
        pick = _pick(steps, at, donor.total)
        if pick is None:
            raise NothingToFork(f"trial {donor.n} (job {donor.job_id}) ended with no checkpoint to fork from")
        return pick

    def _fork(self, child: Trial, donor: Trial) -> tuple[int, bool] | None:
        """(step, copied now) of the donor checkpoint in the child's fork dir, or None while it is not yet there
        to copy (`_source`); a dir already there is the copy made before a crash and is kept. If the donor's
        retention deletes the checkpoint mid-copy, the pick is made again."""
        target = self.layout.fork_dir(child.key)
        if target.exists():
            return _step_of(target), False
        for _ in range(5):
            pick = self._source(child, donor)
            if pick is None:
                return None
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                shutil.copytree(pick, tmp / pick.name)
            except (FileNotFoundError, shutil.Error):
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            if not (tmp / pick.name / METADATA).exists():
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, target)
            return _step_of(target), True
        return None  # each pick vanished under the copy: the next pass picks again

    def env(self, t: Trial) -> dict[str, str]:
        env = {CHECKPOINT_EVERY_ENV: str(self.interval)} if t.phase is P.SEARCH else {}
        if t.schedule:
            env[SCHEDULE_ENV] = sched.text(t.schedule)
        if t.lineage.get("fork_step") is not None:
            env[INIT_CHECKPOINT_ENV] = str(self.layout.fork_dir(t.key))
        return env

    def tags(self, t: Trial) -> dict[str, Any]:
        tags: dict[str, Any] = {}
        if t.member is not None:
            tags[TAG + "member"] = t.member
        if t.schedule:
            tags[TAG + "schedule"] = sched.text(t.schedule)
        lin = t.lineage
        if lin.get("parent") is not None:
            tags.update({TAG + "parent_trial": lin["parent"], TAG + "parent_run": lin.get("parent_run") or "",
                         TAG + "fork_step": lin.get("fork_step"), TAG + "replaced_trial": lin.get("replaced"),
                         TAG + "params_before": json.dumps(lin["before"], sort_keys=True),
                         TAG + "params_after": json.dumps(lin["after"], sort_keys=True)})
        if lin.get("replays") is not None:
            tags[TAG + "replays_trial"] = lin["replays"]
        return tags

    # -- monitor and analyse -----------------------------------------------------------------------------------

    def watch(self, t: Trial, job: Job) -> bool:
        """A running member's history (in `rungs`: step -> value); True when it reached the next interval."""
        if t.status is not S.RUNNING or t.phase is not P.SEARCH or not t.run_id:
            return False
        if self.host.spec.run is not None:  # a config-file member: the reports its segments' ends recorded
            from orchestrator.core import outputmetrics

            outputmetrics.sync(self.host.tracker, job, self.host.spec.metric)
        history = self.host.tracker.history(t.run_id, self.host.progress_metric)
        if not history:
            return False
        if t.total is None:
            spec = self.host.spec  # a config-file run's stop, or the log
            total = (t.params.get(spec.steps) or spec.fixed.get(spec.steps) if spec.steps
                     else self.host.tracker.params(t.run_id).get("total_steps"))
            t.total = int(float(total)) if total else None
        seen = max((int(k) for k in t.rungs), default=-1)
        t.rungs = {str(int(step)): value for step, value in history}
        t.last_step = int(history[-1][0])
        return t.last_step // self.interval > max(seen, 0) // self.interval

    def analyse(self, state: State) -> State:
        """Record ended trials and the best member; exploit and explore at every interval all members reached."""
        trials = load(state["trials"])
        # (Every member has ended before the replays begin, so the graph's search-phase rule for the best holds.)
        best = self.host._record_ends(state, trials, early_stopping=False)
        pbt = dict(state.get("pbt") or {"judged": []})
        if state["phase"] == "search" and not self.host._time_up(state):
            while self._exploit(trials, pbt, state):
                pass
        done = [t for t in trials if t.status in FINAL]
        metrics = {"trials_done": len(done), "trials_running": sum(t.status is S.RUNNING for t in trials),
                   "forks": sum(1 for t in trials if t.lineage.get("parent") is not None)}
        if best:
            metrics["best_so_far"] = best["value"]
        self.host.tracker.log_metrics(state["parent_run"], metrics, step=len(done))
        return {"trials": dump(trials), "best": best, "pbt": pbt}

    def _exploit(self, trials: list[Trial], pbt: dict, state: State) -> bool:
        """Judge the next interval if every live member has reported there; True when it was judged."""
        b = (len(pbt["judged"]) + 1) * self.interval
        members = _members(trials)
        live = {m: t for m, t in members.items() if t.status is not S.FAILED and t.status is not S.CANCELLED}
        totals = [t.total for t in live.values() if t.total]
        if not live or not totals or b >= min(totals):
            return False
        values: dict[int, float] = {}
        for m, t in live.items():
            v = sched.value_at([(int(k), x) for k, x in sorted(t.rungs.items(), key=lambda kv: int(kv[0]))], b)
            if v is None:
                if t.status not in FINAL:
                    return False  # a member has not reached it yet: wait for it
                continue
            values[m] = v
        pbt["judged"] = [*pbt["judged"], b]
        rng = sched.rng(self.host.session_id, "exploit", b)
        for loser_m, donor_m in sched.pairs(values, self.host.spec.direction, rng):
            loser, donor = live[loser_m], live[donor_m]
            if loser.status in FINAL or donor.status in FINAL or donor.job_id is None:
                continue
            n = len(trials)
            before = {k: donor.params[k] for k in self.mutable}
            explore = sched.rng(self.host.session_id, "explore", n)
            params = sched.perturb(self.host.spec.space, self.mutable, donor.params, explore)
            params = self.host.spec.space.validate(params)
            after = {k: params[k] for k in self.mutable}
            loser.stopped_at = b
            self.host._cancel(loser, f"PBT: bottom {sched.QUANTILE:g} at step {b}; trial {n} takes its place from "
                              f"trial {donor.n}'s checkpoint")
            child = self.host._record(n, "search", params, "pbt", f"exploit trial {donor.n} at step {b} (replacing "
                                      f"trial {loser.n}), explore {sched.changed(before, after)}")
            child.update(member=loser_m, lineage={"parent": donor.n, "parent_run": donor.run_id, "fork_step": None,
                                                  "replaced": loser.n, "at": b, "before": before, "after": after})
            trials.append(child)
            self.host._event("exploit", {**state, "trials": trials}, trial=n, parent=donor.n, replaced=loser.n, step=b,
                             message=f"step {b}: trial {loser.n} (member {loser_m}, {values[loser_m]:.4g}) "
                             f"copies trial {donor.n} ({values[donor_m]:.4g}) as trial {n}: "
                             f"{sched.changed(before, after)}")
        return True

    # -- decide ------------------------------------------------------------------------------------------------

    def decide(self, state: State) -> State:
        """search (until every member has ended) -> confirm (the baseline and the winner's replays) -> done."""
        self.host._elapsed(state)
        trials = load(state["trials"])
        phase, reason = state["phase"], state.get("stop_reason", "")
        best = state.get("best")
        if self.host._time_up(state) and phase != "done":
            self._stop_all(trials, "time budget reached")
            phase, reason = "done", "time budget reached"
        elif phase == "search" and trials and self._late(state, trials):
            # Only the replays' time is left: the members stop where they are, the leader at the furthest step
            # they all reached is replayed (its schedule so far, then to the full budget) beside the baseline.
            best = self._leader(trials)
            self._stop_all(trials, "time left only for the baseline and the replays")
            phase = "confirm" if best else "done"
            reason = ("time left only for the baseline and the replays" if best else
                      "time budget reached before any member reported")
            self.host._event("phase", {**state, "trials": trials, "best": best}, phase=phase, reason=reason)
        elif phase == "search" and trials and all(t.status in FINAL for t in _members(trials).values()):
            phase, reason = "confirm", "every member finished its budget"
            self.host._event("phase", {**state, "trials": trials}, phase=phase, reason=reason)
        elif phase == "confirm" and state.get("confirm_planned") and all(
                t.status in FINAL for t in trials if t.phase in (P.CONFIRM, P.BASELINE)):
            phase = "done"
        if phase == "done":
            route = "finish"
        elif (not trials or any(t.status is S.PROPOSED for t in trials)
              or phase == "confirm" and not state.get("confirm_planned")):
            route = "propose"
        else:
            route = "monitor"
        return {"trials": dump(trials), "phase": phase, "stop_reason": reason, "route": route,
                "elapsed": state["elapsed"], "best": best}

    def _stop_all(self, trials: list[Trial], reason: str) -> None:
        for t in trials:
            if t.status in (*ACTIVE, S.PAUSED) and t.job_id is not None:
                self.host._cancel(t, f"session {self.host.session_id}: {reason}")
            if t.status is S.PROPOSED:
                t.status = S.CANCELLED

    def _late(self, state: State, trials: list[Trial]) -> bool:
        """Whether only the confirm phase's time is left of `--budget-minutes`: its baseline and replay runs, at
        full length, in rounds of `parallel`, a run's length estimated from the members' pace (x1.25 for a busy
        machine). False until a member has reported: there is nothing to replay yet."""
        minutes = self.host.cfg.budget_minutes
        if minutes is None:
            return False
        now, runs = time.time(), []
        for t in _members(trials).values():
            start = t.lineage.get("fork_step") or 0
            if t.status is S.RUNNING and t.total and t.last_step and t.last_step > start and t.submitted_at:
                runs.append((now - t.submitted_at) / (t.last_step - start) * t.total)
        if not runs:
            return False
        rounds = -(-(self.host.cfg.baseline_seeds + self.host.cfg.confirm_seeds) // max(1, self.host.parallel))
        return state["elapsed"] >= minutes * 60 - 1.25 * sorted(runs)[len(runs) // 2] * rounds

    def _leader(self, trials: list[Trial]) -> dict | None:
        """The best member at the furthest step every reporting member reached (None when none reported)."""
        members = [t for t in _members(trials).values() if t.rungs and t.status is not S.FAILED]
        if not members:
            return None
        step = min(max(int(k) for k in t.rungs) for t in members)
        best = None
        for t in members:
            v = sched.value_at([(int(k), x) for k, x in sorted(t.rungs.items(), key=lambda kv: int(kv[0]))], step)
            if v is not None and (best is None or self.host.spec.better(v, best["value"])):
                best = {"n": t.n, "value": v, "params": t.params, "job_id": t.job_id, "at_step": step}
        return best


class NothingToFork(Exception):
    """A child's donor ended before it kept any checkpoint."""


def _members(trials: list[Trial]) -> dict[int, Trial]:
    """Each population slot's current trial (its newest)."""
    out: dict[int, Trial] = {}
    for t in trials:
        if t.member is not None and t.phase is P.SEARCH and (t.member not in out or t.n > out[t.member].n):
            out[t.member] = t
    return out


def _pick(steps: list[Path], at: int | None, total: int | None) -> Path | None:
    """The donor checkpoint a child starts from: the one at the judged interval `at` (what the donor was
    when it was judged, whenever the copy is made), else the newest with training left after it (the donor may
    have moved on and its retention dropped that one), else the newest."""
    by_step = {int(p.name.split("_")[1]): p for p in steps}
    if not by_step:
        return None
    if at is not None and at in by_step:
        return by_step[at]
    left = [n for n in by_step if total is None or n < total]
    return by_step[max(left)] if left else by_step[max(by_step)]


def _step_of(fork: Path) -> int:
    return max(int(p.name.split("_")[1]) for p in fork.glob("step_*"))



def agent(**kwargs: Any) -> Any:
    """An agent (`orchestrator.agent.graph.Agent`, same keywords) whose strategy is population-based training."""
    from orchestrator.agent.graph import Agent

    return Agent(strategy=PBT, **kwargs)
