"""Build a proposer by name: Optuna samplers (tpe, cmaes, random), the LLM, or the hybrid of the two."""

from __future__ import annotations

from typing import Any

from experiments.registry import ExperimentSpec
from orchestrator.agent.proposers.base import Proposer, llm_configured
from orchestrator.agent.proposers.hybrid import HybridProposer
from orchestrator.agent.proposers.llm import LLMProposer
from orchestrator.agent.proposers.optuna_ import SamplerProposer
from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput

PROPOSERS = ("llm", "tpe", "cmaes", "random", "hybrid")  # what `make` builds
NAMES = (*PROPOSERS, "pbt")  # what --proposer takes (pbt is a strategy: orchestrator.agent.pbt)
__all__ = ["NAMES", "PROPOSERS", "default_name", "llm_configured", "make"]


def default_name(settings: Settings | None = None) -> str:
    """`llm` when an endpoint or key is configured, else `tpe`."""
    return "llm" if llm_configured(settings) else "tpe"


def make(name: str, spec: ExperimentSpec, goal: str, *, seed: int = 0, model: str | None = None,
         llm_options: dict[str, Any] | None = None, hybrid_share: float = 0.3,
         baseline: dict[str, Any] | None = None, settings: Settings | None = None) -> Proposer:
    """Build the proposer called `name` for experiment `spec`; samplers start near `baseline` (params of
    `spec`'s space). BadInput for an unknown name."""
    if name not in NAMES:
        raise BadInput(f"unknown proposer {name!r}; choose from {', '.join(NAMES)}")
    if name == "pbt":
        raise BadInput("pbt is not a proposer: population-based training copies and perturbs its members "
                       "(orchestrator.agent.pbt runs it)")
    if name in ("tpe", "cmaes", "random"):
        return SamplerProposer(spec, name, seed=seed, baseline=baseline)
    sampler = SamplerProposer(spec, "tpe", seed=seed, baseline=baseline)
    llm = LLMProposer(spec, goal, model=model, fallback=sampler, settings=settings, **(llm_options or {}))
    if name == "llm":
        return llm
    return HybridProposer(sampler, llm, share=hybrid_share)
