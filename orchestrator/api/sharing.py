"""The library behind `autoresearch projects` and `usage`, and the parsing of `--deadline` and `--since`.

The CLI, `top` and the MCP tools call these; the rules live in `orchestrator.queue.projects` (declarations)
and `orchestrator.queue.usage` (the ledger), the policy in `orchestrator.queue.policy`.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import Any, Optional

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.queue import projects as proj
from orchestrator.queue import usage as ledger_rules
from orchestrator.queue.store import JobStore
from orchestrator.queue.policy import DEFAULT_PROJECT

_RELATIVE = re.compile(r"\s*(?:\+|in\s+)?(\d+(?:\.\d+)?)\s*([smhdw])\s*", re.I)
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_deadline(text: Any, now: Optional[float] = None) -> float:
    """A `--deadline` as UNIX seconds: `2026-12-03 18:00` or any ISO 8601 time (local time unless it names a
    zone), a UNIX time, or relative (`2h`, `+90m`, `in 3d`). BadInput when unparseable or not in the future."""
    now = time.time() if now is None else now
    raw = str(text).strip()
    when: Optional[float] = None
    m = _RELATIVE.fullmatch(raw)
    if m:
        when = now + float(m.group(1)) * _UNIT[m.group(2).lower()]
    else:
        try:
            when = float(raw) if re.fullmatch(r"\d{9,}(\.\d+)?", raw) else \
                dt.datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise BadInput(f"bad --deadline {text!r}: expected e.g. \"2026-12-03 18:00\", an ISO time or 2h") from None
    if when <= now:
        stamp = dt.datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S")
        raise BadInput(f"--deadline {text!r} ({stamp}) is in the past")
    return when


def parse_since(text: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """`--since 7d` (or an ISO time) as UNIX seconds; None: from the beginning."""
    if text is None or str(text).strip() == "":
        return None
    now = time.time() if now is None else now
    m = _RELATIVE.fullmatch(str(text))
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2).lower()]
    try:
        return dt.datetime.fromisoformat(str(text).strip()).timestamp()
    except ValueError:
        raise BadInput(f"bad --since {text!r}: expected e.g. 7d, 12h or an ISO time") from None


def known_devices(store: JobStore) -> int:
    """Devices of every live service of the queue (what a quota may not exceed; 0: none known)."""
    from orchestrator.queue.inventory import SERVICE_STALE_AFTER

    return sum(store.hosts.live_capacities(SERVICE_STALE_AFTER))


def resolve_project(name: Optional[str], settings: Settings, store: JobStore) -> str:
    """The project a submit or session goes to (BadInput for an undeclared one while projects are declared)."""
    if name is None or name == "" or name == DEFAULT_PROJECT:
        return DEFAULT_PROJECT
    return proj.resolve(name, proj.declared(store, settings.extra))


def set_project(settings: Settings, name: str, *, share: Optional[float] = None, quota: Optional[int] = None,
                borrow_limit: Optional[int] = None, store: Optional[JobStore] = None) -> dict:
    """Declare or change a project (`projects set`); returns it as `projects --json` shows it."""
    store = store or JobStore.from_settings(settings)
    done = proj.set_project(store, name, share=share, quota=quota, borrow_limit=borrow_limit,
                            devices=known_devices(store), extra=settings.extra)
    from orchestrator.core.wakeup import notify

    notify(settings.home)  # the service plans with it from its next pass
    return done.to_dict()


def projects_table(settings: Settings, store: Optional[JobStore] = None, now: Optional[float] = None) -> list[dict]:
    """Every project (declared, or with jobs holding or waiting): share, quota, borrow limit, decayed usage in
    device-hours, devices held now and jobs queued."""
    store = store or JobStore.from_settings(settings)
    now = time.time() if now is None else now
    known = proj.declared(store, settings.extra)
    held = proj.held_by_project(store)
    queued = proj.queued_by_project(store)
    half = settings.usage_half_life
    decayed = ledger_rules.decayed_by_project(ledger_rules.attempts(store, since=now - 10 * half, now=now),
                                              now, half)
    names = sorted(set(known) | set(held) | {k for k in queued if not k.startswith("(")} | {DEFAULT_PROJECT})
    out = []
    for name in names:
        d = known.get(name, proj.Declared(name, source="implicit"))
        out.append({**d.to_dict(), "usage_device_hours": round(decayed.get(name, 0.0) / 3600, 4),
                    "running_devices": held.get(name, 0), "queued": queued.get(name, 0)})
    if queued.get("(scavenger)"):
        out.append({"name": "(scavenger)", "share": None, "quota": None, "borrow_limit": None,
                    "source": "scavenger", "usage_device_hours": 0.0, "running_devices": None,
                    "queued": queued["(scavenger)"]})
    return out
