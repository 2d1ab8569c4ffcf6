"""What every proposer shares: the observations it learns from, the proposals it makes, and the factory.

A proposer turns the history of an experiment (every finished trial, hand-submitted runs included, plus the
session's trials still running) into `n` new parameter sets, each already validated against the experiment's
typed search space. Proposers hold no state worth saving: after a crash they are rebuilt from the history.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from experiments.registry import ExperimentSpec
from orchestrator.errors import BadInput

NAMES = ("llm", "tpe", "cmaes", "random", "hybrid")


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


def llm_configured() -> bool:
    """Whether an OpenAI-compatible endpoint or key is configured in the environment."""
    return bool(os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_KEY"))


def default_name() -> str:
    """`llm` when an endpoint or key is configured, else `tpe`."""
    return "llm" if llm_configured() else "tpe"


def make(name: str, spec: ExperimentSpec, goal: str, *, seed: int = 0, model: str | None = None,
         llm_options: dict[str, Any] | None = None, hybrid_share: float = 0.3) -> Proposer:
    """Build the proposer called `name` for experiment `spec`. BadInput for an unknown name."""
    if name not in NAMES:
        raise BadInput(f"unknown proposer {name!r}; choose from {', '.join(NAMES)}")
    from orchestrator.agent.proposers.optuna_ import SamplerProposer

    if name in ("tpe", "cmaes", "random"):
        return SamplerProposer(spec, name, seed=seed)
    from orchestrator.agent.proposers.llm import LLMProposer

    sampler = SamplerProposer(spec, "tpe", seed=seed)
    llm = LLMProposer(spec, goal, model=model, fallback=sampler, **(llm_options or {}))
    if name == "llm":
        return llm
    from orchestrator.agent.proposers.hybrid import HybridProposer

    return HybridProposer(sampler, llm, share=hybrid_share)
