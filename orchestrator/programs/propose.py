"""Asking the model for code edits: one step's prompt, bounded re-asks with the reasons, validated results.

The chat itself (retries with backoff, usage and cost accounting, no key in state) is the experiment agent's
`LLMProposer`, reused as a client: only the prompt and the validation differ for code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from orchestrator.programs import answers, edits
from orchestrator.programs.spec import ProgramSpec


@dataclass(frozen=True)
class Variant:
    """A proposal that passed every check: its parent commit, the new file texts and the edits."""

    parent: str
    files: dict[str, str]  # program-relative name -> new text
    rationale: str
    edits: list
    kind: str


def fingerprint(files: dict[str, str]) -> str:
    """A short hash of a variant's new file texts (same parent and same texts: the same experiment)."""
    return hashlib.sha1(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]


class ProgramLLM:
    """The chat endpoint, through `LLMProposer`'s client (retries, backoff, usage)."""

    def __init__(self, goal: str, *, model: str | None = None, options: dict[str, Any] | None = None):
        from orchestrator.agent.proposers.llm import LLMProposer

        opts = {k: v for k, v in (options or {}).items() if k in ("retries", "backoff", "timeout")}
        self._llm = LLMProposer(None, goal, model=model, fallback=None, **opts)  # type: ignore[arg-type]

    def chat(self, messages: list[dict[str, str]]) -> str:
        return self._llm._chat(messages)  # the shared client: retries, backoff and usage live there

    def take_usage(self) -> dict[str, float]:
        return self._llm.take_usage()


def ask(llm: Any, *, goal: str, spec: ProgramSpec, step: answers.Step, history: list[str], best: str,
        resolve: Callable[[str], str | None], read: Callable[[str, str], str | None],
        tried: set[tuple], max_reasks: int) -> tuple[list[Variant], list[str]]:
    """Up to `step.n` valid variants, re-asking at most `max_reasks` times; also every rejection reason.

    `resolve` maps a proposal's parent ("best" is the step's parent) to a commit of the session or None;
    `read(commit, file)` is a file's text at a commit; `tried` holds (parent, files) already run.
    """
    from orchestrator.agent.proposers.llm import LLMUnavailable

    messages = [{"role": "system", "content": answers.SYSTEM},
                {"role": "user", "content": answers.prompt(goal, spec, step, history, best)}]
    got: list[Variant] = []
    reasons: list[str] = []
    for round_ in range(max_reasks + 1):
        try:
            text = llm.chat(messages)
        except LLMUnavailable as exc:
            reasons.append(f"the LLM endpoint failed: {exc}")
            break
        proposals, errors = answers.parse(text, step.n - len(got))
        for i, p in enumerate(proposals):
            parent = step.parent if p.parent in ("best", "") else resolve(p.parent)
            if parent is None:
                errors.append(f"proposal {i}: parent {p.parent!r} is not a commit of this session; use \"best\"")
                continue
            try:
                files = edits.apply(spec, lambda f, c=parent: read(c, f), p.edits)
            except edits.EditRejected as exc:
                errors.append(f"proposal {i}: {exc}")
                continue
            key = (parent, fingerprint(files))
            if key in tried or all(read(parent, f) == t for f, t in files.items()):
                errors.append(f"proposal {i}: it changes nothing new (already tried, or a no-op)")
                continue
            tried.add(key)
            got.append(Variant(parent, files, p.rationale, p.edits, step.kind))
        reasons += errors
        if len(got) >= step.n:
            break
        if round_ < max_reasks:
            why = ("That answer was rejected: " + "; ".join(errors)[:3000] if errors
                   else "That answer had too few proposals")
            messages += [{"role": "assistant", "content": (text or "")[:6000]},
                         {"role": "user", "content": f"{why}. Reply again with JSON only, {step.n - len(got)} "
                                                     f"more proposal(s)."}]
    return got[:step.n], reasons
