"""Agent sessions as something to watch and stop from outside: the Python API, the MCP server and `top` use these.

`autoresearch start` runs a session in the foreground; the Python API's `start_session` runs the same in a
detached child process (`orchestrator.faces.pyapi.sessionapi`) whose output goes to `log_path`.
`stop_session` interrupts it (SIGINT, as Ctrl-C would: the session is left resumable) and cancels its unfinished
trials. `progress` reads what a session has recorded:
its trials in the queue (jobs owned by the session id) and, from its LangGraph checkpoint, the best value so
far and the baseline where the session records one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Optional

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.queue.store import JobStore

STOP_WAIT = 20.0  # seconds a session gets to leave after SIGINT before it is killed


def log_path(home: Path, session_id: str) -> Path:
    """Where a detached session's output goes."""
    path = Path(home) / "agent" / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path / f"{session_id}.log"


def progress(row: dict, store: JobStore, home: Path) -> dict:
    """A session's progress: its trials' jobs by state, and best/baseline where the session records them."""
    from orchestrator.agent import tally

    by_phase = _phase_counts(store, row)  # one GROUP BY, not a row per trial
    counts: dict[str, int] = {}
    for _, job_state, n in by_phase:
        counts[job_state] = counts.get(job_state, 0) + n
    phases = trial_counts(row, store, by_phase)
    summary = row.get("summary") or {}
    state = _checkpoint_state(home, row["id"]) if not summary else {}
    best = summary.get("winner") or summary.get("best") or state.get("best") or {}
    baseline = summary.get("baseline") or state.get("baseline") or _baseline_runs(state.get("trials") or [])
    metric, direction = summary.get("metric"), summary.get("direction")
    if not direction:
        metric, direction = _objective(row.get("experiment"))
    return {
        "session": row["id"], "experiment": row.get("experiment"), "goal": row.get("goal"),
        "status": row["status"], "stop_reason": summary.get("stop_reason") or state.get("stop_reason") or "",
        "trials": counts, "phases": phases, "tally": tally.text(phases),
        "best": _value(best), "baseline": _value(baseline),
        "metric": metric, "direction": direction,
        "headline": summary.get("headline"), "holdout": summary.get("holdout"),
        "usage": summary.get("usage") or state.get("usage") or {},
        "created_at": row.get("created_at"), "updated_at": row.get("updated_at"),
    }


def trial_counts(row: dict, store: JobStore, by_phase: Optional[list] = None) -> dict:
    """The session's trials by phase, done of planned (`orchestrator.agent.tally`), from its jobs in the queue."""
    from orchestrator.agent import tally

    rows = _phase_counts(store, row) if by_phase is None else by_phase
    return tally.count(rows, tally.planned(row.get("config") or {}))


def _phase_counts(store: JobStore, row: dict) -> list:
    """The session's jobs by phase and state. The jobs that its `stop` cancelled are left out (its `resume` runs
    those trials again: neither done nor lost), but for those whose result `resume` kept (done)."""
    from orchestrator.agent.session import stopped_reason

    return store.phase_counts(row["id"], skip_cancelled=stopped_reason(row["id"]))


def _baseline_runs(trials: list) -> Optional[float]:
    """Mean of the finished runs of the baseline (the experiment's defaults) a running session has recorded."""
    values = [t.get("value") for t in trials if isinstance(t, dict) and t.get("phase") == "baseline"]
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def _objective(experiment: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(metric, direction) of a bundled experiment, or (None, None)."""
    try:
        from experiments import registry

        spec = registry.get(experiment or "")
        return spec.metric, spec.direction
    except Exception:  # a custom `package.module:SPEC` experiment: not worth importing for a view
        return None, None


def _value(record: Any) -> Optional[float]:
    if isinstance(record, (int, float)) and not isinstance(record, bool):
        return float(record)
    if isinstance(record, dict):
        for key in ("mean", "value"):
            if isinstance(record.get(key), (int, float)):
                return float(record[key])
    return None


def _checkpoint_state(home: Path, session_id: str) -> dict:
    """The session's latest LangGraph state (best so far, trials), or {} when it has none or cannot be read."""
    try:
        from langgraph.checkpoint.sqlite import SqliteSaver

        from orchestrator.agent.session import connect

        conn = connect(home)
        try:
            saved = SqliteSaver(conn).get_tuple({"configurable": {"thread_id": session_id}})
        finally:
            conn.close()
        return dict(saved.checkpoint.get("channel_values") or {}) if saved else {}
    except Exception:  # a view must not fail because a checkpoint is mid-write or of an older shape
        return {}


def sessions(settings: Optional[Settings] = None, store: Optional[JobStore] = None,
             session_id: Optional[str] = None) -> list[dict]:
    """Progress of every session (newest first), or of one (BadInput when it does not exist)."""
    from orchestrator.agent.session import Registry

    settings = settings or Settings.load()
    store = store or JobStore.from_settings(settings)
    registry = Registry(settings.home)
    try:
        rows = [registry.get(session_id)] if session_id else registry.all()
    finally:
        registry.close()
    return [progress(r, store, settings.home) for r in rows]


def stop_session(session_id: str, settings: Optional[Settings] = None) -> dict:
    """Interrupt a running session (it stays resumable) and cancel its unfinished trials."""
    from orchestrator.api import jobs as api
    from orchestrator.agent.session import Registry, stopped_reason

    settings = settings or Settings.load()
    registry = Registry(settings.home)
    try:
        row = registry.get(session_id)
    finally:
        registry.close()
    if row["status"] == "finished":
        raise BadInput(f"session {session_id} already finished")
    if row["status"] == "running" and row["pid"]:
        _interrupt(int(row["pid"]))
    store = JobStore.from_settings(settings)
    cancelled = []
    for job in store.unfinished():
        if job.owner == session_id:
            try:
                cancelled.append(api.cancel(job.id, settings, store, reason=stopped_reason(session_id)).id)
            except BadInput:
                pass  # it finished meanwhile
    return {**sessions(settings, store, session_id)[0], "cancelled_jobs": cancelled}


def _interrupt(pid: int) -> None:
    """SIGINT (Ctrl-C: the session stops cleanly and stays resumable), then SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, STOP_WAIT / 2), (signal.SIGTERM, STOP_WAIT / 2), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if _gone(pid, wait):
            return


def _gone(pid: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # our own child (started here): reap it, or it lingers as a zombie
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except (ProcessLookupError, OSError):
            return True
        time.sleep(0.1)
    return False
