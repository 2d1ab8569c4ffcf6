"""The one LLM client: any OpenAI-compatible chat endpoint, asked for JSON, with retries, re-asks, usage and cost
accounting and the session's budget. Experiment proposals (`proposers/llm.py`) and code edits (`programs/`)
differ only in their prompt and in how an answer is validated; both go through `ask` here.

    client = LLMClient.from_settings(settings, model="gpt-4o-mini", retries=4)
    asked = ask(client, SYSTEM, user_prompt, parse, n=2, max_reasks=2)   # parse(text, wanted) -> (ok, errors)

The endpoint, model and price come from `Settings` (`llm_base_url`, `llm_model`, `llm_price`: flag, environment
or config.toml); the key stays in the environment (`OPENAI_API_KEY`), where the openai client reads it itself,
and is never copied into state, logs or runs. Rate limits, server errors, timeouts and dropped connections are
retried with exponential backoff (a server's Retry-After honoured up to `MAX_RETRY_AFTER`); other 4xx are not.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from orchestrator.agent.budget import DEFAULT_MODEL, PRICES, added
from orchestrator.core.config import Settings

MAX_RETRY_AFTER = 30.0  # seconds: a server asking for longer gets this (a session should not stall for minutes)
_sleep = time.sleep  # the wait between retries (tests record it instead of waiting)
OPTIONS = ("retries", "backoff", "timeout")  # what a session's `llm` options may set on the client


class LLMUnavailable(RuntimeError):
    """The endpoint kept failing after every retry."""


def zero_usage() -> dict[str, float]:
    """A fresh usage counter: calls, tokens, cost, retries, rejected answers, sampler fallbacks."""
    return {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0, "retries": 0,
            "rejected": 0, "fallbacks": 0}


def price_of(model: str, price: Optional[str]) -> Optional[tuple[float, float]]:
    """USD per million (prompt, completion) tokens: `price` ("in,out") when set, else the model's listed price;
    None when neither is known or `price` is unreadable."""
    try:
        return tuple(float(x) for x in price.split(",")) if price else PRICES[model]  # type: ignore[return-value]
    except (KeyError, ValueError):
        return None


@dataclass
class LLMClient:
    """A chat endpoint with its accounting. `budget` (an `LLMBudget`) and `spent` (what the session had spent
    before this client's own counter) are checked before every call by `ask`."""

    model: str = DEFAULT_MODEL
    base_url: Optional[str] = None
    price: Optional[str] = None  # "in,out" USD per million tokens (the llm_price setting); else PRICES
    key_set: bool = False  # whether OPENAI_API_KEY is set (local servers often need none; the client insists)
    retries: int = 4
    backoff: float = 0.5
    timeout: float = 60.0
    temperature: float = 0.7
    usage: dict[str, float] = field(default_factory=zero_usage)
    budget: Any = None
    spent: dict[str, float] = field(default_factory=dict)
    _client: Any = None

    @classmethod
    def from_settings(cls, settings: Optional[Settings] = None, *, model: Optional[str] = None,
                      **options: Any) -> "LLMClient":
        """A client for the configured endpoint; `model` (a session's own) wins over the `llm_model` setting.
        `options` may set `retries`, `backoff` and `timeout`; other keys are ignored (they are the caller's)."""
        settings = settings or Settings.load()
        return cls(model=model or settings.llm_model or DEFAULT_MODEL, base_url=settings.llm_base_url,
                   price=settings.llm_price, key_set=settings.llm_key_set,
                   **{k: v for k, v in options.items() if k in OPTIONS})

    def client(self) -> Any:
        """The openai client (built once; its own retries off, because ours log and count them)."""
        if self._client is None:
            import openai

            self._client = openai.OpenAI(api_key=None if self.key_set else "unused", base_url=self.base_url,
                                         max_retries=0, timeout=self.timeout)
        return self._client

    def chat(self, messages: list[dict[str, str]]) -> str:
        """The model's answer to `messages` (a JSON object is requested); LLMUnavailable after every retry."""
        import openai

        for attempt in range(self.retries + 1):
            try:
                resp = self.client().chat.completions.create(
                    model=self.model, messages=messages, response_format={"type": "json_object"},
                    temperature=self.temperature)
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
        price = price_of(self.model, self.price)
        return 0.0 if price is None else (prompt_tokens * price[0] + completion_tokens * price[1]) / 1e6

    def over_budget(self) -> Optional[str]:
        """Why no further call may be made under the session's budget, or None while there is room."""
        return None if self.budget is None else self.budget.reached(added(self.spent, self.usage))

    def take_usage(self) -> dict[str, float]:
        """Usage since the last call (calls, tokens, cost, retries, rejected answers, fallbacks), then reset."""
        out, self.usage = self.usage, zero_usage()
        return out


def load_json(text: Optional[str]) -> tuple[Any, Optional[str]]:
    """The JSON value in a model's answer (a fenced code block is unwrapped), or None and the reason."""
    body = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", text or "")
    try:
        return json.loads(body), None
    except (json.JSONDecodeError, RecursionError):
        return None, "the answer is not valid JSON"


def proposals_of(data: Any, single_key: str) -> tuple[Optional[list], Optional[str]]:
    """The `proposals` list of an answer (one bare proposal, recognised by `single_key`, counts as a list of
    one), or None and the reason."""
    if isinstance(data, dict) and single_key in data and "proposals" not in data:
        data = {"proposals": [data]}
    items = data.get("proposals") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return None, 'expected an object with a "proposals" list'
    return items, None


def clean(text: Any) -> str:
    """A short, printable, single-line rationale (it is shown to people and stored as a tag, never run)."""
    if not isinstance(text, str):
        return ""
    return " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())[:500]


@dataclass
class Asked:
    """What `ask` got: the accepted items, every rejection reason, and why it stopped short (the endpoint
    failed: `unavailable`; the budget was reached before a call: `budget_hit`)."""

    got: list
    reasons: list[str]
    unavailable: Optional[str] = None
    budget_hit: Optional[str] = None


Parse = Callable[[str, int], "tuple[list, list[str]]"]


def ask(llm: Any, system: str, prompt: str, parse: Parse, n: int, *, max_reasks: int,
        reason_chars: int = 2000, answer_chars: int = 4000,
        short: Callable[[int], str] = lambda k: f"That answer had {k} usable proposal(s)") -> Asked:
    """Up to `n` accepted items from `llm` (an `LLMClient`, or anything with `chat`), re-asking with the
    rejection reasons at most `max_reasks` times. `parse(text, wanted)` returns (accepted, errors); `short(k)`
    is the re-ask's reason when an answer was valid but had too few (k) items."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    got: list = []
    reasons: list[str] = []
    over_budget = getattr(llm, "over_budget", lambda: None)
    for round_ in range(max_reasks + 1):
        hit = over_budget()
        if hit:  # no call past the cap
            return Asked(got, reasons, budget_hit=hit)
        try:
            text = llm.chat(messages)
        except LLMUnavailable as exc:
            return Asked(got, reasons, unavailable=str(exc))
        accepted, errors = parse(text, n - len(got))
        got += accepted
        reasons += errors
        if len(got) >= n:
            break
        if errors and isinstance(getattr(llm, "usage", None), dict):
            llm.usage["rejected"] += 1
        if round_ < max_reasks:
            why = ("That answer was rejected: " + "; ".join(errors)[:reason_chars] if errors
                   else short(len(accepted)))
            messages += [{"role": "assistant", "content": (text or "")[:answer_chars]},
                         {"role": "user", "content": f"{why}. Reply again with JSON only, {n - len(got)} more "
                                                     "proposal(s)."}]
    return Asked(got[:n], reasons)

