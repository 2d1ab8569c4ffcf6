"""A program session's durable record: its trials (one row each) and its loop state, in the agent database.

Every change is written before the step that depends on it (a trial row before its commit, its commit before
its job, its job key before anything waits on it), so a session killed at any point resumes without losing a
trial or a commit and without running one twice: jobs are found again by their idempotency key, runs by their
tag, commits by their ref.

A trial is one job (`trial.ProgramTrial`, stored as its plain dict). The first run of a commit is its node;
re-runs on other seeds point at it (`node`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable

from orchestrator.agent.session import connect
from orchestrator.programs.trial import Kind, ProgramTrial, S


def new_trial(session: str, n: int, *, kind: Kind, step: str, parent: str | None, parent_node: int | None,
              node: int | None = None, commit: str | None = None, seed: int = 0, rationale: str = "",
              edits: list[dict[str, Any]] | None = None, depth: int = 0) -> ProgramTrial:
    """A trial in its first state (`pending`: recorded, not yet submitted)."""
    return ProgramTrial(n=n, key=f"{session}:{n}", kind=kind, step=step, node=n if node is None else node,
                        commit=commit, parent=parent, parent_node=parent_node, seed=seed, rationale=rationale,
                        edits=edits or [], depth=depth)


class TreeStore:
    """Trials and loop state of program sessions (SQLite, the agent database of the home)."""

    def __init__(self, home: Path):
        self.conn = connect(home)
        with self.conn:
            self.conn.execute("CREATE TABLE IF NOT EXISTS program_trials (session TEXT, n INTEGER, data TEXT, "
                              "PRIMARY KEY (session, n))")
            self.conn.execute("CREATE TABLE IF NOT EXISTS program_state (session TEXT PRIMARY KEY, data TEXT)")

    def save(self, session: str, trial: ProgramTrial) -> None:
        """Write one trial (insert or replace), as the plain dict rows have always held."""
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO program_trials VALUES (?, ?, ?)",
                              (session, trial.n, json.dumps(trial.to_dict(), default=str)))

    def trials(self, session: str) -> list[ProgramTrial]:
        """A session's trials, in order (trial n at index n)."""
        rows = self.conn.execute("SELECT data FROM program_trials WHERE session = ? ORDER BY n", (session,))
        return [ProgramTrial.from_dict(json.loads(r[0])) for r in rows]

    def save_state(self, session: str, state: dict[str, Any]) -> None:
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO program_state VALUES (?, ?)",
                              (session, json.dumps(state, default=str)))

    def state(self, session: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT data FROM program_state WHERE session = ?", (session,)).fetchone()
        return json.loads(row[0]) if row else None

    def states(self) -> list[tuple[str, dict[str, Any]]]:
        """(session, loop state) of every program session of the home."""
        rows = self.conn.execute("SELECT session, data FROM program_state ORDER BY rowid")
        return [(r[0], json.loads(r[1])) for r in rows]

    def has(self, session: str) -> bool:
        return self.state(session) is not None

    def close(self) -> None:
        self.conn.close()


def runs_of(trials: Iterable[ProgramTrial], node: int) -> list[ProgramTrial]:
    """Every run (trial) of one node."""
    return [t for t in trials if t.node == node]


def values_of(trials: Iterable[ProgramTrial], node: int) -> list[float]:
    """The metric values of a node's succeeded runs."""
    return [t.value for t in runs_of(trials, node) if t.status is S.SUCCEEDED and t.value is not None]


def summary_of(trials: list[ProgramTrial], node: int) -> dict[str, Any]:
    """A node's mean, spread and run count."""
    values = values_of(trials, node)
    return {"n": len(values), "mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None}


def nodes(trials: list[ProgramTrial]) -> list[ProgramTrial]:
    """The node trials (first run of each commit), in order."""
    return [t for t in trials if t.is_node]


def state_of(t: ProgramTrial) -> str:
    """A node's state as it is shown and counted: its verdict once judged, else its job's status."""
    return (t.verdict or t.status).value


def history_lines(trials: list[ProgramTrial], last: int = 30) -> list[str]:
    """The latest nodes as prompt lines: commit | parent | step | metric | outcome | rationale."""
    rows = []
    for t in nodes(trials)[-last:]:
        s = summary_of(trials, t.n)
        value = "-" if s["mean"] is None else f"{s['mean']:.5g}" + (f"±{s['std']:.2g}" if s["std"] else "")
        rows.append(f"{(t.commit or '')[:10]} | {(t.parent or '-')[:10]} | {t.step} | {value} | "
                    f"{state_of(t)} | {t.rationale[:200]}")
    return rows


def best_line(trials: list[ProgramTrial], n: int, metric: str) -> str:
    """The incumbent, as the prompt shows it."""
    best = trials[n]
    s = summary_of(trials, n)
    value = "not measured yet" if s["mean"] is None else f"{metric} {s['mean']:.5g} over {s['n']} run(s)"
    return f"commit {(best.commit or '')[:10]} ({best.step}): {value}"
