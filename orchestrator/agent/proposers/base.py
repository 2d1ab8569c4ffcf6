"""What every proposer shares: the observations it learns from and the proposals it makes.

A proposer turns the history of an experiment (every finished trial, hand-submitted runs included, plus the
session's trials still running) into `n` new parameter sets, each already validated against the experiment's
typed search space. Proposers hold no state worth saving: after a crash they are rebuilt from the history.
The factory that builds one by name is `orchestrator.agent.proposers.factory` (kept apart: it imports every
proposer, and every proposer imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


@dataclass(frozen=True)
class Observation:
    """One trial of the experiment as a proposer sees it.

    `state` is "complete" (value set), "failed", "pruned" (stopped early; `intermediate` holds what it reached)
    or "running" (in flight; samplers treat it as a pending point so parallel asks spread out).
    """

    params: dict[str, Any]
    state: str
    value: float | None = None
    intermediate: dict[int, float] = field(default_factory=dict)
    proposer: str = ""
    source: str = ""
    error: str = ""


@dataclass(frozen=True)
class Proposal:
    """Validated params for one new trial, who proposed them and (from an LLM) why."""

    params: dict[str, Any]
    proposer: str
    rationale: str = ""


class Proposer(Protocol):
    """Anything that proposes trials."""

    name: str

    def propose(self, n: int, history: Sequence[Observation]) -> list[Proposal]:
        """`n` new, valid proposals given the history."""
        ...


def llm_configured(settings: Any = None) -> bool:
    """Whether an OpenAI-compatible endpoint (`llm_base_url`: flag, environment or config.toml) or a key is
    configured."""
    from orchestrator.core.config import Settings

    return (settings or Settings.load()).llm_configured
