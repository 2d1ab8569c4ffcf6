"""Asking the model for code edits: one step's prompt, bounded re-asks with the reasons, validated results.

The chat itself (retries with backoff, re-asks, usage and cost accounting, no key in state) is the one LLM
client, `orchestrator.agent.llmclient`, as for experiments: only the prompt and the validation differ for code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from orchestrator.agent import llmclient
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


def ask(llm: Any, *, goal: str, spec: ProgramSpec, step: answers.Step, history: list[str], best: str,
        resolve: Callable[[str], str | None], read: Callable[[str, str], str | None],
        tried: set[tuple], max_reasks: int) -> tuple[list[Variant], list[str]]:
    """Up to `step.n` valid variants, re-asking at most `max_reasks` times; also every rejection reason.

    `llm` is an `LLMClient` (or anything with its `chat` and `take_usage`). `resolve` maps a proposal's parent
    ("best" is the step's parent) to a commit of the session or None; `read(commit, file)` is a file's text at a
    commit; `tried` holds (parent, files) already run.
    """

    def parse(text: str, wanted: int) -> tuple[list[Variant], list[str]]:
        proposals, errors = answers.parse(text, wanted)
        got = []
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
        return got, errors

    asked = llmclient.ask(llm, answers.SYSTEM, answers.prompt(goal, spec, step, history, best), parse, step.n,
                          max_reasks=max_reasks, reason_chars=3000, answer_chars=6000,
                          short=lambda k: "That answer had too few proposals")
    reasons = asked.reasons + ([f"the LLM endpoint failed: {asked.unavailable}"] if asked.unavailable else [])
    return asked.got, reasons
