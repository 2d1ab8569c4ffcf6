"""The LLM proposer: any OpenAI-compatible chat endpoint, answers validated as data against the search space.

The prompt carries the goal, the typed space, the history table, the best so far and recent failures; the
answer must be JSON `{"proposals": [{"params": {...}, "rationale": "..."}]}`. Anything else (invalid JSON,
unknown keys, out-of-range or mistyped values, repeats of tried configurations) is rejected with the reason
and re-asked at most `max_reasks` times; slots still empty then fall back to the sampler. Only the validated,
coerced params leave this module (plus a clipped, printable rationale): nothing the model says is ever run.

The client reads `OPENAI_API_KEY`/`OPENAI_BASE_URL` itself; the key is never copied into state, logs or runs.
Rate limits, server errors, timeouts and dropped connections are retried here with exponential backoff.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from typing import Any, Sequence

from experiments.registry import ExperimentSpec
from experiments.space import SpaceError
from orchestrator.agent.budget import DEFAULT_MODEL, PRICES  # noqa: F401 - the prices live with the budget
from orchestrator.agent.proposers.base import Observation, Proposal, Proposer

log = logging.getLogger(__name__)

MAX_RETRY_AFTER = 30.0  # seconds: a server asking for longer gets this (a session should not stall for minutes)
_sleep = time.sleep  # the wait between retries (tests record it instead of waiting)
SYSTEM = (
    "You are a careful ML research assistant choosing the next hyperparameter configurations to try. "
    "Reply with a single JSON object and nothing else: "
    '{"proposals": [{"params": {<name>: <value>, ...}, "rationale": "<one short sentence>"}]}. '
    "Use only the parameter names listed, values inside their ranges or choices, and do not repeat a "
    "configuration already tried."
)


class LLMUnavailable(RuntimeError):
    """The endpoint kept failing after every retry."""


class LLMProposer:
    """Proposals from a chat model, with bounded re-asks and a sampler fallback."""

    name = "llm"

    def __init__(self, spec: ExperimentSpec, goal: str, *, model: str | None = None, fallback: Proposer,
                 max_reasks: int = 2, retries: int = 4, backoff: float = 0.5, timeout: float = 60.0,
                 history_rows: int = 30):
        self.spec = spec
        self.goal = goal
        self.model = model or os.environ.get("AUTORESEARCH_LLM_MODEL") or DEFAULT_MODEL
        self.fallback = fallback
        self.max_reasks = max_reasks
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self.history_rows = history_rows
        self.usage = _zero_usage()
        self._client: Any = None
        self.price: str | None = None  # "in,out" USD per million tokens (the llm_price setting); else PRICES
        # The session's cap (orchestrator.agent.budget.LLMBudget) and what it had spent before this proposer's
        # own counter; checked before every call. `budget_hit` says why the last propose stopped short.
        self.budget: Any = None
        self.spent: dict[str, float] = {}
        self.budget_hit: str | None = None

    # -- the endpoint ----------------------------------------------------------------------------------------------

    def client(self) -> Any:
        """The openai client (built once; its own retries off, because ours log and count them)."""
        if self._client is None:
            import openai

            # Local OpenAI-compatible servers often need no key, but the client insists on one.
            key = None if os.environ.get("OPENAI_API_KEY") else "unused"
            self._client = openai.OpenAI(api_key=key, max_retries=0, timeout=self.timeout)
        return self._client

    def _chat(self, messages: list[dict[str, str]]) -> str:
        import openai

        for attempt in range(self.retries + 1):
            try:
                resp = self.client().chat.completions.create(
                    model=self.model, messages=messages, response_format={"type": "json_object"},
                    temperature=0.7)
            except (openai.RateLimitError, openai.InternalServerError, openai.APITimeoutError,
                    openai.APIConnectionError) as exc:
                if attempt == self.retries:
                    raise LLMUnavailable(f"{type(exc).__name__} after {attempt + 1} tries") from None
                self.usage["retries"] += 1
                _sleep(self._delay(attempt, exc))
                continue
            except openai.APIStatusError as exc:  # other 4xx: retrying will not help
                raise LLMUnavailable(f"HTTP {exc.status_code}") from None
            self.usage["calls"] += 1
            if resp.usage is not None:
                self.usage["prompt_tokens"] += resp.usage.prompt_tokens or 0
                self.usage["completion_tokens"] += resp.usage.completion_tokens or 0
                self.usage["cost_usd"] = self.cost(self.usage["prompt_tokens"], self.usage["completion_tokens"])
            choice = resp.choices[0] if resp.choices else None
            return (choice.message.content or "") if choice else ""
        raise LLMUnavailable("no answer")  # unreachable; keeps type checkers content

    def _delay(self, attempt: int, exc: Exception) -> float:
        """Exponential backoff with jitter; a server's Retry-After is honoured up to `MAX_RETRY_AFTER` s."""
        response = getattr(exc, "response", None)
        retry_after = response.headers.get("retry-after") if response is not None else None
        try:
            if retry_after is not None:
                return min(MAX_RETRY_AFTER, max(0.0, float(retry_after)))
        except ValueError:
            pass
        return self.backoff * (2 ** attempt) * (0.5 + random.random() / 2)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Estimated USD for the tokens used (0 for a model with no known price)."""
        price = self.price or os.environ.get("AUTORESEARCH_LLM_PRICE")
        try:
            p_in, p_out = (float(x) for x in price.split(",")) if price else PRICES[self.model]
        except (KeyError, ValueError):
            return 0.0
        return (prompt_tokens * p_in + completion_tokens * p_out) / 1e6

    def take_usage(self) -> dict[str, float]:
        """Usage since the last call (calls, tokens, cost, retries, rejected answers, fallbacks), then reset."""
        out, self.usage = self.usage, _zero_usage()
        return out

    # -- proposing -------------------------------------------------------------------------------------------------

    def propose(self, n: int, history: Sequence[Observation], *, context: str = "") -> list[Proposal]:
        """`n` proposals: as many valid ones as the model gives within the re-asks, the rest from the sampler."""
        if n <= 0:
            return []
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": self.prompt(n, history, context)}]
        tried = [self.spec.space.validate(o.params) for o in history if _fits(self.spec, o.params)]
        got: list[Proposal] = []
        self.budget_hit = None
        for round_ in range(self.max_reasks + 1):
            if self.budget is not None:
                from orchestrator.agent.budget import added

                self.budget_hit = self.budget.reached(added(self.spent, self.usage))
                if self.budget_hit:  # no call past the cap, and no sampler fallback: the session pauses
                    return got
            try:
                text = self._chat(messages)
            except LLMUnavailable as exc:
                log.warning("LLM unavailable (%s); the sampler fills %d slot(s)", exc, n - len(got))
                break
            accepted, errors = parse_answer(text, self.spec, n - len(got), tried + [p.params for p in got])
            got += accepted
            if len(got) >= n:
                break
            if errors:
                self.usage["rejected"] += 1
            if round_ < self.max_reasks:
                why = ("That answer was rejected: " + "; ".join(errors)[:2000] if errors
                       else f"That answer had {len(accepted)} usable proposal(s)")
                messages += [{"role": "assistant", "content": text[:4000]},
                             {"role": "user", "content": why + f". Reply again with JSON only, "
                              f"{n - len(got)} more proposal(s)."}]
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
        sign = 1 if spec.direction == "minimize" else -1
        ranked = sorted(done, key=lambda o: sign * o.value)
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
    body = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", text or "")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return [], ["the answer is not valid JSON"]
    if isinstance(data, dict) and "params" in data and "proposals" not in data:
        data = {"proposals": [data]}
    items = data.get("proposals") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return [], ['expected an object with a "proposals" list']
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
        out.append(Proposal(params=params, proposer="llm", rationale=_clean(item.get("rationale"))))
    return out, errors


def _clean(rationale: Any) -> str:
    """A short, printable, single-line rationale (it is shown to people and stored as a tag, never run)."""
    if not isinstance(rationale, str):
        return ""
    text = "".join(ch if ch.isprintable() else " " for ch in rationale)
    return " ".join(text.split())[:500]


def _fits(spec: ExperimentSpec, params: dict[str, Any]) -> bool:
    try:
        spec.space.validate(params)
        return True
    except SpaceError:
        return False


def _zero_usage() -> dict[str, float]:
    return {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0, "retries": 0,
            "rejected": 0, "fallbacks": 0}
