"""Leases on lost hosts: which services stopped heart-beating, and which one live service settles each.

The election is store-level and backend-specific, so it lives next to the store: on PostgreSQL the reaper
holds the dead host's `services` row lock (`FOR UPDATE SKIP LOCKED`) while it works; on SQLite, which only
services of one machine can share and where a long write transaction would block the store's own, an atomic
UPDATE gives it a short lease on that row (the row looks fresh to other reapers for `LEASE` seconds).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from sqlalchemy import delete, update
from sqlmodel import Session, select

from orchestrator.queue.models import ServiceRecord
from orchestrator.queue.store import JobStore

LEASE = 5.0  # seconds a SQLite reaper owns a dead host's row


@dataclass
class Lease:
    """The right to settle one lost host's jobs. Set `settled` when it holds nothing any more: its service
    record is then deleted (otherwise the next pass tries again)."""

    host: str
    home: Optional[str]
    last_heartbeat: float
    settled: bool = False


def stale_hosts(store: JobStore, self_host: str, cutoff: float) -> list[str]:
    """Hosts other than `self_host` whose last heartbeat is older than `cutoff` (epoch seconds)."""
    with Session(store.db.engine) as session:
        return list(session.exec(select(ServiceRecord.host).where(
            ServiceRecord.host != self_host, ServiceRecord.heartbeat_at < cutoff)))


@contextmanager
def reaping(store: JobStore, host: str, cutoff: float) -> Iterator[Optional[Lease]]:
    """A lease on `host` while it is still stale, or None when another service holds it or it came back."""
    if store.db.is_postgres:
        with Session(store.db.engine) as session, session.begin():
            record = session.exec(select(ServiceRecord).where(
                ServiceRecord.host == host, ServiceRecord.heartbeat_at < cutoff)
                .with_for_update(skip_locked=True)).first()
            if record is None:
                yield None
                return
            lease = Lease(host, record.home, record.heartbeat_at)
            yield lease
            if lease.settled:
                session.delete(record)
        return
    with store.db.engine.begin() as conn:
        won = conn.execute(update(ServiceRecord).where(ServiceRecord.host == host,
                                                       ServiceRecord.heartbeat_at < cutoff)
                           .values(heartbeat_at=cutoff + LEASE)).rowcount
    if not won:
        yield None
        return
    with Session(store.db.engine) as session:
        record = session.get(ServiceRecord, host)
        home = record.home if record is not None else None
    lease = Lease(host, home, cutoff)
    yield lease
    if lease.settled:
        with store.db.engine.begin() as conn:
            conn.execute(delete(ServiceRecord).where(ServiceRecord.host == host,
                                                     ServiceRecord.heartbeat_at <= cutoff + LEASE))


def lease_age(lease: Lease) -> float:
    """Seconds since the lost host's last heartbeat."""
    return time.time() - lease.last_heartbeat
