"""Talking to the model about code: the prompt for one step, and the parsing of its JSON answers.

The answer shape is fixed by the program format (docs/guides/program-mode.md):

    {"proposals": [{"parent": "best" | "<commit>", "rationale": "one sentence",
                    "edits": [{"file": "train.py", "search": "exact text", "replace": "new text"}]}]}

Steps follow AIDE: `draft` (a fresh idea from the incumbent or the root), `improve` (one change to a good
node), `debug` (fix a crashed node, given its log tail). Parsing only checks the shape here; whether the edits
apply is `edits.apply`'s business, against the parent the proposal names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.agent.llmclient import clean, load_json, proposals_of

SYSTEM = (
    "You are an ML research engineer improving a training program by editing its code. "
    "Reply with a single JSON object and nothing else: "
    '{"proposals": [{"parent": "best" or a commit id, "rationale": "<one sentence>", '
    '"edits": [{"file": "<editable file>", "search": "<exact text that occurs once in the parent file>", '
    '"replace": "<new text>"}]}]}. '
    "Edit only the editable files; never the protected ones. Keep each proposal one idea, small and runnable."
)
TAIL_CHARS = 3000


@dataclass(frozen=True)
class Proposal:
    """One shape-checked proposal: which parent, why, and the raw edit blocks."""

    parent: str
    rationale: str
    edits: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Step:
    """What to ask the model for: the step kind, the default parent, its files, and the context."""

    kind: str  # draft | improve | debug
    parent: str  # commit id
    files: dict[str, str]
    n: int = 1
    log_tail: str = ""
    note: str = ""


def parse(text: str, n: int) -> tuple[list[Proposal], list[str]]:
    """Well-shaped proposals in `text` (at most `n`) and the reasons the others were refused."""
    data, error = load_json(text)
    items, error = (None, error) if error else proposals_of(data, "edits")
    if items is None:
        return [], [error or ""]
    out, errors = [], []
    for i, item in enumerate(items[:n]):
        if not isinstance(item, dict) or not isinstance(item.get("edits"), list):
            errors.append(f"proposal {i}: expected an object with an \"edits\" list")
            continue
        parent = item.get("parent", "best")
        if not isinstance(parent, str) or not parent.strip():
            parent = "best"
        out.append(Proposal(parent=parent.strip(), rationale=clean(item.get("rationale")), edits=item["edits"]))
    return out, errors


def prompt(goal: str, spec: Any, step: Step, history: list[str], best: str) -> str:
    """The user message for one step."""
    parts = [
        f"Goal: {goal}",
        f"Program: {spec.name}. Run: `{spec.run}`. Metric: {spec.metric} ({spec.direction}); "
        f"each run is stopped after {spec.time_limit:.0f} s.",
        f"Editable files: {', '.join(spec.edit)}. Protected (read-only, do not edit): "
        f"{', '.join(spec.protected) or '(none)'}.",
        "History (commit | parent | step | metric | outcome | rationale):\n" + ("\n".join(history) or "(none yet)"),
        f"Incumbent: {best}",
    ]
    for name, text in step.files.items():
        parts.append(f"--- {name} at commit {step.parent[:10]} ---\n{text}")
    if step.kind == "debug":
        parts.append(f"Commit {step.parent[:10]} crashed. The end of its log:\n{step.log_tail[-TAIL_CHARS:]}\n"
                     f"Propose {step.n} fix(es) of that commit: parent \"{step.parent[:10]}\".")
    elif step.kind == "draft":
        parts.append(f"Propose {step.n} new idea(s) (draft step), each one clear change of the program "
                     f"above (parent \"best\" unless you name another commit).")
    else:
        parts.append(f"Propose {step.n} improvement(s) (improve step), each one atomic change of the program "
                     f"above (parent \"best\" unless you name another commit).")
    if step.note:
        parts.append(f"Note: {step.note}")
    return "\n\n".join(parts)
