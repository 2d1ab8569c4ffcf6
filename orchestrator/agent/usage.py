"""`autoresearch usage` (and MCP `usage`): device-seconds per project, owner or session from the queue's event
log (`orchestrator.queue.usage`), and by session the agent's LLM calls, tokens and cost from the sessions'
records; and the GPUs' busy share: device-hours held and busy, as the service sampled them
(`orchestrator.queue.gpuuse`). Here, above the API, because the LLM side is the agent's."""

from __future__ import annotations

import time
from typing import Optional

from orchestrator.api.sharing import parse_since
from orchestrator.core.config import Settings
from orchestrator.queue import usage as ledger_rules
from orchestrator.queue.gpuuse import GpuUse
from orchestrator.queue.store import JobStore


def usage(settings: Settings, *, by: str = "project", since: Optional[str] = None,
          store: Optional[JobStore] = None, now: Optional[float] = None) -> list[dict]:
    """`autoresearch usage`: device-seconds per project, owner or session from the event log (scavengers
    apart); by session, the agent's LLM calls, tokens and estimated cost where the session recorded them."""
    store = store or JobStore.from_settings(settings)
    now = time.time() if now is None else now
    start = parse_since(since, now)
    rows = ledger_rules.ledger(ledger_rules.attempts(store, since=start, now=now), by=by, since=start)
    _busy_share(rows, GpuUse(store.db).totals(by, since=start), by)
    if by == "session":
        llm = _llm_usage(settings)
        for row in rows:
            row.update(llm.pop(row["session"], {}))
        rows += [{"session": sid, "device_seconds": 0.0, "scavenger_device_seconds": 0.0, "attempts": 0,
                  "jobs": 0, "running": 0, "device_hours": 0.0, "held_hours": 0.0, "busy_hours": 0.0,
                  "busy_share": None, **u} for sid, u in sorted(llm.items())]
    return rows


def _busy_share(rows: list[dict], figures: dict, by: str) -> None:
    """Each row's GPU device-hours held and busy (sampled; 0 on cpu slots) and busy / held (None: none held).
    With --since, a job's figures count whole when it ran at all since then (they are kept per job)."""
    for row in rows:
        fig = figures.get(row[by])
        held, busy = (fig.held, fig.busy) if fig is not None else (0.0, 0.0)
        row.update(held_hours=round(held / 3600, 4), busy_hours=round(busy / 3600, 4),
                   busy_share=round(busy / held, 4) if held > 0 else None)


def _llm_usage(settings: Settings) -> dict[str, dict]:
    """LLM calls, tokens and cost per session, from the sessions' summaries (empty when none recorded any)."""
    path = settings.home / "agent" / "agent.db"
    if not path.exists():
        return {}
    from orchestrator.agent.session import Registry

    registry = Registry(settings.home)
    try:
        out = {}
        for row in registry.all():
            # The spend recorded as it went (a running session's too), else a finished session's summary.
            u = row.get("llm_usage") or (row.get("summary") or {}).get("usage") or {}
            if u.get("calls"):
                out[row["id"]] = {"llm_calls": u.get("calls", 0), "prompt_tokens": u.get("prompt_tokens", 0),
                                  "completion_tokens": u.get("completion_tokens", 0),
                                  "cost_usd": round(float(u.get("cost_usd") or 0.0), 6)}
        return out
    finally:
        registry.close()
