"""The hybrid proposer: the sampler proposes, the LLM may replace at most a set share of the proposals.

Published head-to-heads find classical samplers matching or beating pure LLM proposers, and a sampler with an
LLM overriding a minority of its points doing best; this is that arrangement. The share is counted over the
whole history (trials already proposed by the LLM included), so it holds across batches and resumes.
"""

from __future__ import annotations

import json
import math
from typing import Sequence

from orchestrator.agent.proposers.base import Observation, Proposal
from orchestrator.agent.proposers.llm import LLMProposer
from orchestrator.agent.proposers.optuna_ import SamplerProposer


class HybridProposer:
    """Sampler proposals, of which the LLM may replace up to `share`."""

    name = "hybrid"

    def __init__(self, sampler: SamplerProposer, llm: LLMProposer, share: float = 0.3):
        if not 0.0 <= share <= 1.0:
            raise ValueError("share must be in [0, 1]")
        self.sampler = sampler
        self.llm = llm
        self.share = share

    @property
    def usage(self) -> dict:
        return self.llm.usage

    def take_usage(self) -> dict:
        """The LLM's usage since the last call."""
        return self.llm.take_usage()

    def propose(self, n: int, history: Sequence[Observation]) -> list[Proposal]:
        """`n` sampler proposals; the LLM replaces the last k, k keeping its share of all trials <= `share`."""
        proposals = self.sampler.propose(n, history)
        mine = [o for o in history if o.proposer]  # agent-made trials; hand-submitted runs have none
        used = sum(1 for o in mine if o.proposer == "llm")
        k = min(n, math.floor(self.share * (len(mine) + n) + 1e-9) - used)
        if k <= 0:
            return proposals
        keep = proposals[: n - k]
        candidates = "\n".join(json.dumps(p.params, sort_keys=True) for p in proposals)
        context = (f"A sampler suggested these next configurations:\n{candidates}\nPropose {k} configuration(s) "
                   "you expect to do better than the sampler's, using what the history shows.")
        pending = list(history) + [Observation(params=p.params, state="running") for p in keep]
        # The LLM's own fallback is the sampler, so a failed LLM still yields n valid proposals.
        replaced = self.llm.propose(k, pending, context=context)
        return keep + [p if p.proposer == "llm" else Proposal(q.params, q.proposer)
                       for p, q in zip(replaced, proposals[n - k:])]
