"""Judging a program session's nodes: crashed (ask for a debug step), re-run on fresh seeds, then kept or
discarded by the noise gate against the nearest measured ancestor; every outcome goes to the governor.

The children of one parent are a family of tests, as the agent's confirmed candidates are
(`orchestrator.tracking.client.leaderboard`): each is gated at the Bonferroni-corrected level 1 - ALPHA/k, k being the
parent's children that reach the gate (succeeded or still running, crashes left out), so with several drafts
judged against the baseline the chance that any of them is kept by seed noise stays at most ALPHA.

A collaborator of `Loop`, handed the loop as its `host`: what it reads and calls there is declared by `Host`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from orchestrator.core.gate import gate
from orchestrator.programs import tree
from orchestrator.programs.governor import CHANGE, STOP
from orchestrator.programs.trial import ACTIVE, Kind, ProgramTrial, S, Verdict

ALPHA = 0.05  # family-wise error rate of the gate over one parent's children


class Host(Protocol):
    """What the judge needs of the loop it judges for (`orchestrator.programs.loop.Loop`)."""

    sid: str
    spec: Any  # ProgramSpec: repeats, max_debug, direction, metric
    trials: list[ProgramTrial]
    state: dict[str, Any]  # the loop's saved state: incumbent, pending_debug, stop_reason, note, drafts_left
    gov: Any  # the Governor that turns outcomes into "go on", "change course" or "stop"
    parallel: int
    tracker: Any
    repo: Any
    say: Callable[[str], None]

    def _add(self, t: ProgramTrial) -> ProgramTrial: ...

    def _save(self, t: ProgramTrial | None = None) -> None: ...


class Judge:
    """Verdicts on the nodes of `host`'s session."""

    def __init__(self, host: Host):
        self.host = host

    def __call__(self) -> None:
        """Judge every node that has no verdict yet (those still running wait)."""
        for node in tree.nodes(self.host.trials):
            if node.verdict is None:
                self._judge_node(node)

    def _judge_node(self, node: ProgramTrial) -> None:
        runs = tree.runs_of(self.host.trials, node.n)
        if node.kind is Kind.BASELINE:
            if any(r.status in ACTIVE for r in runs):
                return
            values = tree.values_of(self.host.trials, 0)
            if not values:
                self._verdict(node, Verdict.CRASHED, "the baseline failed: " + runs[0].error)
                self.host.state["stop_reason"] = f"the unmodified program failed: {runs[0].error}"
                return
            s = tree.summary_of(self.host.trials, 0)
            self._verdict(node, Verdict.BASELINE, f"baseline {s['mean']:.5g} over {s['n']} run(s)")
            return
        if node.status in ACTIVE:
            return
        if node.status is not S.SUCCEEDED:
            self._verdict(node, Verdict.CRASHED, node.error)
            if node.status is S.FAILED and node.depth < self.host.spec.max_debug:
                self.host.state["pending_debug"].append(node.n)
            self.govern("failed")
            return
        if len(runs) < self.host.spec.repeats:  # fresh seeds: one good run is not a result
            for seed in range(len(runs), self.host.spec.repeats):
                self.host._add(tree.new_trial(self.host.sid, len(self.host.trials), kind=Kind.RERUN, step="rerun",
                                         parent=node.parent, parent_node=node.parent_node, node=node.n,
                                         commit=node.commit, seed=seed, rationale=node.rationale))
            return
        if any(r.status in ACTIVE for r in runs):
            return
        base = self._gate_parent(node)
        if base is None or base.verdict is None:
            return  # the parent is still being measured
        values = tree.values_of(self.host.trials, node.n)
        if len(values) < 2:
            self._verdict(node, Verdict.DISCARDED, "its re-runs failed: the result does not reproduce")
            self.govern("failed")
            return
        k = len(siblings(self.host.trials, node, base))
        v = gate(tree.values_of(self.host.trials, base.n), values, direction=self.host.spec.direction,
                 level=1.0 - ALPHA / k)
        if k > 1:
            v = dataclasses.replace(v, method=f"{v.method}, Bonferroni-corrected for {k} children")
        against = f" (vs {(base.commit or '')[:10]})"
        if not v.win:
            self._verdict(node, Verdict.DISCARDED, v.describe() + against)
            self.govern("discarded")
            return
        self._verdict(node, Verdict.KEPT, v.describe() + against)
        best = self.host.trials[self.host.state["incumbent"]]
        mean = tree.summary_of(self.host.trials, node.n)["mean"]
        if self.host.spec.better(mean, tree.summary_of(self.host.trials, best.n)["mean"]):
            self.host.state["incumbent"] = node.n
            self.host.repo.set_ref(self.host.repo.branch(self.host.sid), node.commit)
            self.host.say(f"new incumbent: trial {node.n} commit {(node.commit or '')[:10]}, {self.host.spec.metric} "
                     f"{mean:.5g} ({v.describe()})")
        self.govern("improved")

    def _gate_parent(self, node: ProgramTrial) -> ProgramTrial | None:
        return gate_parent(self.host.trials, node)

    def _verdict(self, node: ProgramTrial, verdict: Verdict, text: str) -> None:
        node.verdict, node.verdict_text = verdict, text
        if node.run_id:
            self.host.tracker.set_tags(node.run_id, {"autoresearch.verdict": verdict.value,
                                                "autoresearch.verdict_text": text})
        self.host._save(node)

    def govern(self, outcome: str) -> None:
        """Tell the governor of an outcome, and follow its call (change course, or stop)."""
        action = self.host.gov.record(outcome)
        if action == CHANGE:
            self.host.state["note"] = (f"The session {self.host.gov.reason}. Go back to the incumbent and try a "
                                       "different, simpler idea; keep edits small and make sure the program still "
                                       "runs.")
            self.host.state["drafts_left"] = self.host.parallel
            self.host.state["pending_debug"] = []
            self.host.say(self.host.gov.reason)
        elif action == STOP:
            self.host.state["stop_reason"] = self.host.gov.reason
            self.host.say(f"stopping: {self.host.gov.reason}")
        self.host._save()


def gate_parent(trials: list[ProgramTrial], node: ProgramTrial) -> ProgramTrial | None:
    """The nearest measured ancestor (a debug fix is judged against what its crashed parent came from); one
    not judged yet counts (the caller waits for its verdict)."""
    n = node.parent_node
    while n is not None:
        parent = trials[n]
        if parent.verdict is not Verdict.CRASHED:
            return parent
        n = parent.parent_node
    return None


def siblings(trials: list[ProgramTrial], node: ProgramTrial, base: ProgramTrial) -> list[ProgramTrial]:
    """The nodes gated against `base` (`node` among them): its non-baseline descendants through crashed
    nodes that have not crashed themselves (succeeded or still running)."""
    out = []
    for m in tree.nodes(trials):
        if m.n == node.n or (m.kind is not Kind.BASELINE and m.verdict is not Verdict.CRASHED
                             and m.status in (S.SUCCEEDED, *ACTIVE)):
            parent = gate_parent(trials, m)
            if parent is not None and parent.n == base.n:
                out.append(m)
    return out
