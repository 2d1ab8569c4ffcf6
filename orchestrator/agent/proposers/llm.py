"""The LLM proposer: any OpenAI-compatible chat endpoint, answers validated as data against the search space.

The prompt carries the goal, the typed space, the history table, the best so far and recent failures; the
answer must be JSON `{"proposals": [{"params": {...}, "rationale": "..."}]}`. Anything else (invalid JSON,
unknown keys, out-of-range or mistyped values, repeats of tried configurations) is rejected with the reason
and re-asked at most `max_reasks` times; slots still empty then fall back to the sampler. Only the validated,
coerced params leave this module (plus a clipped, printable rationale): nothing the model says is ever run.

The endpoint, retries, usage and budget are `orchestrator.agent.llmclient`'s, shared with program mode.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from experiments.registry import ExperimentSpec
from experiments.space import SpaceError
from orchestrator.agent.llmclient import LLMClient, LLMUnavailable, ask, clean, load_json, proposals_of
from orchestrator.agent.proposers.base import Observation, Proposal, Proposer
from orchestrator.core.config import Settings

__all__ = ["LLMProposer", "LLMUnavailable", "baseline_line", "parse_answer"]
log = logging.getLogger(__name__)

SYSTEM = (
    "You are a careful ML research assistant choosing the next hyperparameter configurations to try. "
    "Reply with a single JSON object and nothing else: "
    '{"proposals": [{"params": {<name>: <value>, ...}, "rationale": "<one short sentence>"}]}. '
    "Use only the parameter names listed, values inside their ranges or choices, and do not repeat a "
    "configuration already tried."
)


class LLMProposer:
    """Proposals from a chat model (through `LLMClient`), with bounded re-asks and a sampler fallback."""

    name = "llm"

    def __init__(self, spec: ExperimentSpec, goal: str, *, model: str | None = None, fallback: Proposer,
                 max_reasks: int = 2, history_rows: int = 30, settings: Settings | None = None,
                 client: LLMClient | None = None, **options: Any):
        self.spec = spec
        self.goal = goal
        self.client = client or LLMClient.from_settings(settings, model=model, **options)
        self.fallback = fallback
        self.max_reasks = max_reasks
        self.history_rows = history_rows
        self.budget_hit: str | None = None  # why the last propose stopped short (the session's LLM budget)

    @property
    def model(self) -> str:
        return self.client.model

    @property
    def usage(self) -> dict[str, float]:
        return self.client.usage

    def take_usage(self) -> dict[str, float]:
        """Usage since the last call (calls, tokens, cost, retries, rejected answers, fallbacks), then reset."""
        return self.client.take_usage()

    # -- proposing -------------------------------------------------------------------------------------------------

    def propose(self, n: int, history: Sequence[Observation], *, context: str = "") -> list[Proposal]:
        """`n` proposals: as many valid ones as the model gives within the re-asks, the rest from the sampler."""
        if n <= 0:
            return []
        seen = [self.spec.space.validate(o.params) for o in history if _fits(self.spec, o.params)]

        def parse(text: str, wanted: int) -> tuple[list[Proposal], list[str]]:
            accepted, errors = parse_answer(text, self.spec, wanted, seen)
            seen.extend(p.params for p in accepted)  # a re-ask must not repeat what an earlier round gave
            return accepted, errors

        asked = ask(self.client, SYSTEM, self.prompt(n, history, context), parse, n, max_reasks=self.max_reasks)
        got = asked.got
        self.budget_hit = asked.budget_hit
        if asked.budget_hit:  # no call past the cap, and no sampler fallback: the session pauses
            return got
        if asked.unavailable:
            log.warning("LLM unavailable (%s); the sampler fills %d slot(s)", asked.unavailable, n - len(got))
        if len(got) < n:
            self.usage["fallbacks"] += n - len(got)
            fallback = self.fallback.propose(n - len(got), list(history) + [
                Observation(params=p.params, state="running") for p in got])
            got += [Proposal(p.params, p.proposer, "LLM gave no valid answer; sampler fallback")
                    for p in fallback]
        return got[:n]

    def prompt(self, n: int, history: Sequence[Observation], context: str = "") -> str:
        """The user message: goal, space, baseline and its noise, history table, best so far, recent failures."""
        spec = self.spec
        done = [o for o in history if o.state == "complete" and o.value is not None]
        ranked = sorted(done, key=lambda o: spec.direction.key(o.value))
        shown = ranked[: self.history_rows // 2] + [o for o in history if o not in ranked[: self.history_rows // 2]][
            -self.history_rows // 2:]
        rows = [f"{json.dumps(o.params, sort_keys=True)} | {'' if o.value is None else f'{o.value:.6g}'} | {o.state}"
                for o in shown]
        failures = [f"{json.dumps(o.params, sort_keys=True)}: {o.error or 'failed'}"
                    for o in history if o.state == "failed"][-5:]
        parts = [
            f"Goal: {self.goal}",
            f"Experiment: {spec.name}: {spec.description}",
            f"Metric: {spec.metric} ({spec.direction})",
            "Search space (JSON):\n" + json.dumps(spec.space.describe(), indent=1),
            f"History ({len(history)} trials; params | {spec.metric} | status):\n" + ("\n".join(rows) or "(none)"),
            "Best so far: " + (f"{json.dumps(ranked[0].params, sort_keys=True)} -> {ranked[0].value:.6g}"
                               if ranked else "(none yet)"),
            "Recent failures:\n" + ("\n".join(failures) or "(none)"),
        ]
        parts.insert(4, baseline_line(history, spec.metric))
        if context:
            parts.append(context)
        parts.append(f"Propose {n} new configuration(s).")
        return "\n\n".join(parts)


def baseline_line(history: Sequence[Observation], metric: str) -> str:
    """The baseline (the experiment's defaults, run first on several seeds) and the seed noise it shows."""
    runs = [o for o in history if o.proposer == "baseline"]
    done = [o.value for o in runs if o.state == "complete" and o.value is not None]
    if not runs:
        return "Baseline: (none)"
    params = json.dumps(runs[0].params, sort_keys=True)
    if not done:
        return f"Baseline (the experiment's defaults, still running on {len(runs)} seeds): {params}"
    mean = sum(done) / len(done)
    std = (sum((v - mean) ** 2 for v in done) / (len(done) - 1)) ** 0.5 if len(done) > 1 else None
    noise = (f" ± {std:.3g} (seed-to-seed standard deviation). A difference smaller than about {2 * std:.3g} "
             "is noise, not an improvement" if std is not None else " (one seed so far: the noise is unknown)")
    return (f"Baseline (the experiment's defaults, {len(done)} seeds): {params} -> {metric} {mean:.6g}{noise}. "
            "Only a configuration that beats the baseline by more than the noise counts as a win.")


def parse_answer(text: str, spec: ExperimentSpec, n: int, tried: Sequence[dict[str, Any]]
                 ) -> tuple[list[Proposal], list[str]]:
    """Valid proposals in `text` (at most `n`) and the reasons the rest were rejected."""
    data, error = load_json(text)
    items, error = (None, error) if error else proposals_of(data, "params")
    if items is None:
        return [], [error or ""]
    out: list[Proposal] = []
    errors: list[str] = []
    seen = list(tried)
    for i, item in enumerate(items):
        if len(out) >= n:
            break
        if not isinstance(item, dict) or not isinstance(item.get("params"), dict):
            errors.append(f"proposal {i}: expected an object with a \"params\" object")
            continue
        try:
            params = spec.space.validate(item["params"])
        except SpaceError as exc:
            errors.append(f"proposal {i}: {str(exc)[:300]}")
            continue
        if params in seen:
            errors.append(f"proposal {i}: this configuration was already tried")
            continue
        seen.append(params)
        out.append(Proposal(params=params, proposer="llm", rationale=clean(item.get("rationale"))))
    return out, errors


def _fits(spec: ExperimentSpec, params: dict[str, Any]) -> bool:
    try:
        spec.space.validate(params)
        return True
    except SpaceError:
        return False

