"""`tree SESSION`, and the program-mode halves of `start --program` and `resume` (called from `cli.agent`).

Thin: parse, call `orchestrator.programs.session`, print.
"""

from __future__ import annotations

from typing import Any, Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, print_json, print_table


def _fmt(value: object) -> str:
    return f"{value:.5g}" if isinstance(value, float) else ("" if value is None else str(value))


def start(config: Any, *, devices: Optional[str], as_json: bool) -> None:
    """`autoresearch start --program DIR`: run a program session (a `ProgramConfig`) and print its summary."""
    from orchestrator.agent.session import new_id
    from orchestrator.programs.session import check

    check(config, devices)
    from orchestrator.programs import session

    def registered(session_id: str) -> None:  # named once `resume` can continue it
        info(f"session {session_id} on program {config.program} (branch autoresearch/{session_id})")
        info(f"resume it with `autoresearch resume {session_id}` if this process is interrupted")

    summary = session.start(config, session_id=new_id(), devices=devices, say=info, on_registered=registered)
    _summary(summary, as_json)


def resume(session_id: str, devices: Optional[str], as_json: bool) -> bool:
    """Resume `session_id` if it is a program session; False when it is an experiment session."""
    from orchestrator.programs import session

    if not session.is_program(session_id):
        return False
    info(f"resuming program session {session_id}")
    _summary(session.resume(session_id, devices=devices, say=info), as_json)
    return True


def _summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print_json(summary)
        return
    info(f"session {summary['session']} finished ({summary['stop_reason']}): {summary['trials']} runs, variants "
         f"{summary['variants']}, {summary['elapsed_s']} s, {summary['device_seconds']} device-s")
    best = summary.get("best") or {}
    print(f"baseline {summary['metric']}: {_fmt(summary['baseline'])}")
    if best.get("trial"):
        print(f"best: {summary['metric']} {_fmt(best['mean'])} ± {_fmt(best['std'])} over {best['runs']} runs, "
              f"commit {best['commit'][:10]} on branch {summary['branch']}: {best['rationale']}")
        print(f"      {best['verdict']}")
    else:
        print(f"no variant beat the baseline through the noise gate; branch {summary['branch']} is the baseline")
    held = summary.get("holdout") or {}
    if held:  # the protected evaluator's score on data no search run could read
        print(f"holdout {held['metric']}: trial {held['trial']} {_fmt(held['value'])}, baseline "
              f"{_fmt(held['baseline'])} ({held['device_s']} device-s){' ' + held['error'] if held['error'] else ''}")


@app.command()
def tree(session: str = typer.Argument(..., metavar="SESSION"),
         as_json: bool = typer.Option(False, "--json", help="Print the lineage as JSON.")) -> None:
    """A program session's lineage: every commit with its parent, step, runs, metric and verdict."""
    from orchestrator.programs.session import lineage

    rows = lineage(session)
    if as_json:
        print_json(rows)
        return
    children: dict = {}
    for row in rows:
        children.setdefault(row["parent_trial"], []).append(row)
    table = []

    def walk(parent, depth: int) -> None:
        for row in children.get(parent, []):
            spread = f" ± {_fmt(row['std'])}" if row["std"] is not None else ""
            table.append((("  " * depth) + ("└ " if depth else "") + (row["commit"] or "")[:10], row["trial"],
                          row["step"], row["state"], row["runs"], _fmt(row["mean"]) + spread,
                          (row["rationale"] or row["detail"])[:60]))
            walk(row["trial"], depth + 1)

    walk(None, 0)
    print_table(f"session {session}", ["commit", "trial", "step", "state", "runs", "metric", "why"], table)
    held = [r for r in rows if r.get("holdout") is not None]
    if held:  # read once at the end, by the protected evaluator: the search never saw it
        print("holdout: " + ", ".join(f"trial {r['trial']} ({r['state']}) {_fmt(r['holdout'])}" for r in held))
