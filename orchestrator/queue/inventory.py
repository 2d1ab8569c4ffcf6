"""Each host's inventory in the queue's database: its devices (with their health state) and its service heartbeat."""

from __future__ import annotations

import time
from typing import Optional, Sequence

from sqlalchemy import bindparam, select as core_select
from sqlmodel import select

from orchestrator.core.errors import BadInput
from orchestrator.queue.db import Database
from orchestrator.queue.models import Device, ServiceRecord

DEVICE_STATES = ("available", "disabled", "quarantined")


_LIVE = core_select(ServiceRecord.__table__.c.devices).where(
    ServiceRecord.__table__.c.heartbeat_at >= bindparam("since"))
CAPACITIES_TTL = 1.0
_DEVICES = Device.__table__
_AVAILABLE = (core_select(_DEVICES.c.name).where(_DEVICES.c.host == bindparam("host"), _DEVICES.c.state == "available")
              .order_by(_DEVICES.c.position))  # built once: building a statement cost more than running it


SERVICE_STALE_AFTER = 10.0  # a service whose heartbeat is older than this is gone (submit, reaping)

class HostRecords:
    """Device inventories and service heartbeats, one row each (`JobStore.hosts`)."""

    def __init__(self, db: Database):
        self.db = db
        self._capacities: Optional[tuple[float, float, list[int]]] = None  # (max_age, when, answer)

    def sync_devices(self, host: str, names: Sequence[str]) -> list[Device]:
        """Make `names` this host's device inventory, keeping the state of devices already known."""
        with self.db.tx() as session:
            known = {d.name: d for d in session.exec(select(Device).where(Device.host == host))}
            for name in set(known) - set(names):
                session.delete(known[name])
            for pos, name in enumerate(names):
                dev = known.get(name) or Device(host=host, name=name)
                dev.position = pos
                session.add(dev)
        return self.devices(host)

    def devices(self, host: Optional[str] = None) -> list[Device]:
        """Devices of one host (or of every host), in inventory order."""
        with self.db.read() as session:
            stmt = select(Device)
            if host is not None:
                stmt = stmt.where(Device.host == host)
            return list(session.exec(stmt.order_by(Device.host, Device.position)))

    def set_device_state(self, host: str, name: str, state: str, reason: str = "",
                         check: Optional[dict] = None) -> Device:
        """available | disabled (by a person) | quarantined (by a check), with its reason."""
        if state not in DEVICE_STATES:
            raise BadInput(f"unknown device state {state!r}")
        with self.db.tx() as session:
            dev = session.get(Device, (host, name))
            if dev is None:
                raise BadInput(f"no device {name!r} on {host}; known: "
                               + ", ".join(d.name for d in session.exec(select(Device).where(Device.host == host))))
            dev.state, dev.reason = state, reason
            if check is not None:
                dev.last_check, dev.checked_at = check, time.time()
            session.add(dev)
            return dev

    def record_check(self, host: str, name: str, check: dict) -> None:
        """Keep a device's last check result (its state is unchanged)."""
        with self.db.tx() as session:
            dev = session.get(Device, (host, name))
            if dev is not None:
                dev.last_check, dev.checked_at = check, time.time()
                session.add(dev)

    def heartbeat(self, host: str, pid: int, home: str, devices: Sequence[str], started_at: float,
                  preempt_after: Optional[float] = None, disk: Optional[str] = None,
                  executor: Optional[str] = None) -> None:
        """Upsert this service's liveness row (with the minimum runtime it preempts after, when given; `disk`:
        why it starts no job for want of space, else None)."""
        with self.db.tx() as session:
            rec = session.get(ServiceRecord, host) or ServiceRecord(host=host)
            rec.pid, rec.home, rec.devices, rec.heartbeat_at = pid, home, list(devices), time.time()
            rec.started_at, rec.disk = started_at, disk
            if preempt_after is not None:
                rec.preempt_after = preempt_after
            if executor is not None:
                rec.executor = executor
            session.add(rec)

    def services(self, max_age: Optional[float] = None) -> list[ServiceRecord]:
        """Service rows; with `max_age`, only those whose heartbeat is that fresh."""
        with self.db.read() as session:
            stmt = select(ServiceRecord)
            if max_age is not None:
                stmt = stmt.where(ServiceRecord.heartbeat_at >= time.time() - max_age)
            return list(session.exec(stmt))

    def live_executors(self, max_age: float) -> list[str]:
        """The executors of the services whose heartbeat is `max_age` fresh (those of older releases: local)."""
        return [rec.executor or "local" for rec in self.services(max_age)]

    def live_capacities(self, max_age: float) -> list[int]:
        """How many devices each service whose heartbeat is `max_age` fresh has (what a submit checks; read
        without the ORM, which cost a third of a submit). A non-empty answer is reused for CAPACITIES_TTL
        seconds (a burst of submits asks once; services heartbeat every 2 s and count as gone after 10 s, so
        the answer is that old anyway); none found is asked again each time (a service may be starting)."""
        now = time.monotonic()
        cached = self._capacities
        if cached is not None and cached[0] == max_age and now - cached[1] < CAPACITIES_TTL:
            return list(cached[2])
        with self.db.lone_read() as conn:
            found = [len(devices or []) for (devices,) in conn.execute(_LIVE, {"since": time.time() - max_age})]
        self._capacities = (max_age, now, found) if found else None
        return found

    def available_devices(self, host: str) -> list[str]:
        """Names of this host's devices in the `available` state, in inventory order (each dispatch pass)."""
        with self.db.lone_read() as conn:
            return [name for (name,) in conn.execute(_AVAILABLE, {"host": host})]

    def remove_service(self, host: str) -> None:
        """Forget a service that said goodbye."""
        with self.db.tx() as session:
            rec = session.get(ServiceRecord, host)
            if rec is not None:
                session.delete(rec)
