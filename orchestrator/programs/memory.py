"""What earlier program sessions on the same program and start commit tried: their variants' fingerprints (never
run again) and a compact prompt section (kept, discarded and crashed variants with their effect).

    memory = Memory.of(trees, session_id, program=str(spec.root), root=root_commit, chars=4000)
    tried |= memory.tried               # (parent commit, files fingerprint) pairs already measured
    lines = memory.lines                # the prompt's "earlier sessions" section, at most `chars` long

A session is the same program's when its state names the same program folder and root commit (the commit
its baseline ran): its parents are then this session's commits too, so its fingerprints mean the same thing.
Past the size, the oldest variants are summarised as counts instead of one line each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.programs import tree
from orchestrator.programs.trial import Kind

HEADER = "Earlier sessions on this program and start commit (commit | parent | step | metric | outcome | rationale):"


@dataclass
class Memory:
    """Earlier sessions' variants: fingerprints and prompt lines."""

    tried: set = field(default_factory=set)
    lines: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, trees: tree.TreeStore, session: str, *, program: str, root: str, chars: int) -> "Memory":
        memory = cls()
        rows: list[str] = []
        outcomes: list[str] = []
        for other, state in trees.states():
            if other == session or state.get("program") != program or state.get("root") != root:
                continue
            trials = trees.trials(other)
            variants = [t for t in tree.nodes(trials) if t.kind is Kind.VARIANT]
            memory.tried |= {(t.parent, t.fingerprint) for t in variants if t.fingerprint}
            base = tree.summary_of(trials, 0)["mean"] if trials else None
            for t in variants:
                mean = tree.summary_of(trials, t.n)["mean"]
                effect = "-" if mean is None else f"{mean:.5g}" + (f" ({mean - base:+.3g} vs baseline)"
                                                                   if base is not None else "")
                outcome = tree.state_of(t)
                outcomes.append(outcome)
                rows.append(f"{other} {(t.commit or '')[:10]} | {(t.parent or '-')[:10]} | {t.step} | "
                            f"{effect} | {outcome} | {t.rationale[:160]}")
        if not rows:
            return memory
        kept: list[str] = []
        used = len(HEADER)
        for i in range(len(rows) - 1, -1, -1):  # the newest first, within the size
            if used + len(rows[i]) + 1 > chars - 120:
                counts: dict[str, int] = {}
                for o in outcomes[:i + 1]:
                    counts[o] = counts.get(o, 0) + 1
                kept.append(f"... and {i + 1} older variant(s): "
                            + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
                break
            kept.append(rows[i])
            used += len(rows[i]) + 1
        memory.lines = [HEADER, *reversed(kept)]
        return memory
