"""Proposers: Optuna samplers (tpe, cmaes, random), an OpenAI-compatible LLM, and a hybrid of the two."""

from orchestrator.agent.proposers.base import Observation, Proposal, Proposer
from orchestrator.agent.proposers.factory import NAMES, default_name, make

__all__ = ["NAMES", "Observation", "Proposal", "Proposer", "default_name", "make"]
