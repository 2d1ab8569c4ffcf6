"""A session's LLM budget: a cap in dollars or tokens, checked before every call to the model.

At the cap the session stops proposing, lets the trials in flight finish and be judged, and ends `paused` with
the reason; `autoresearch resume SESSION --llm-budget-usd Y` (or `--llm-budget-tokens N`) continues it under a
higher cap. A check happens before each call, so a session stops within one call of its cap: the call that
crosses it is the last one.

Dollars need a price: a model in `PRICES`, or the `llm_price` setting
("in,out" USD per million prompt and completion tokens). A dollar budget without one is refused at start,
since the spend could never be measured against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from orchestrator.core.errors import BadInput
from orchestrator.core.config import Settings

USES_LLM = ("llm", "hybrid")


@dataclass(frozen=True)
class LLMBudget:
    """A cap on a session's LLM spend; None on a side means no cap there."""

    usd: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if self.usd is not None and not self.usd > 0:
            raise BadInput(f"--llm-budget-usd must be > 0, got {self.usd}")
        if self.tokens is not None and not self.tokens > 0:
            raise BadInput(f"--llm-budget-tokens must be > 0, got {self.tokens}")

    @property
    def capped(self) -> bool:
        return self.usd is not None or self.tokens is not None

    def reached(self, usage: Mapping[str, Any]) -> str | None:
        """Why no further call may be made after spending `usage`, or None while there is room."""
        tokens = tokens_of(usage)
        if self.tokens is not None and tokens >= self.tokens:
            return f"LLM token budget reached ({tokens:,} of {self.tokens:,} tokens)"
        cost = float(usage.get("cost_usd") or 0.0)
        if self.usd is not None and cost >= self.usd:
            return f"LLM budget reached (${cost:.4f} of ${self.usd:g})"
        return None

    def describe(self) -> str:
        parts = ([f"${self.usd:g}"] if self.usd is not None else []) + (
            [f"{self.tokens:,} tokens"] if self.tokens is not None else [])
        return " or ".join(parts) or "none"


DEFAULT_MODEL = "gpt-4o-mini"  # the LLM proposer's model when none is set
# USD per million (prompt, completion) tokens; the llm_price setting ("in,out") overrides for other models.
PRICES = {"gpt-4o-mini": (0.15, 0.60), "gpt-4o": (2.50, 10.0), "gpt-4.1-mini": (0.40, 1.60),
          "gpt-4.1": (2.00, 8.00), "gpt-4.1-nano": (0.10, 0.40)}


def of(config: Any) -> LLMBudget:
    """The budget a SessionConfig asks for."""
    return LLMBudget(getattr(config, "llm_budget_usd", None), getattr(config, "llm_budget_tokens", None))


def tokens_of(usage: Mapping[str, Any]) -> int:
    """Prompt plus completion tokens."""
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)


def added(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two usage counters summed key by key."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def price_known(model: str | None, llm_price: str | None) -> bool:
    """Whether the cost of `model`'s tokens can be computed (a listed model, or an `llm_price` "in,out")."""
    price = llm_price
    if price:
        try:
            p_in, p_out = (float(x) for x in price.split(","))
            return p_in >= 0 and p_out >= 0
        except ValueError:
            return False
    return (model or DEFAULT_MODEL) in PRICES


def check(config: Any, settings: Settings) -> None:
    """BadInput for a dollar budget on an LLM session whose model has no known price."""
    budget = of(config)
    if budget.usd is None or config.proposer not in USES_LLM:
        return
    model = config.model or settings.llm_model
    if not price_known(model, settings.llm_price):
        raise BadInput(f"--llm-budget-usd: no price is known for model {model or DEFAULT_MODEL!r}; set llm_price "
                       "(AUTORESEARCH_LLM_PRICE=\"IN,OUT\", USD per million tokens) or use --llm-budget-tokens")
