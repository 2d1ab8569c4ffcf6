"""Projects sharing the devices: their records, the rules a declaration must meet, and what a pass needs of them.

A project has a fair-share weight (`share`), a number of guaranteed devices (`quota`) and, optionally, a cap on
the devices it may borrow beyond its quota (`borrow_limit`). Projects come from `config.toml`
(`[projects.NAME] share = 2, quota = 4, borrow_limit = 2`) and from `autoresearch projects set` (the `projects`
table of the queue database, which wins over the file for the same name: it is what a person set last). With
none declared every job is in the project `default` (`orchestrator.queue.policy.DEFAULT_PROJECT`).

The policy that uses them is `orchestrator.queue.policy.plan`; the usage it weighs comes from the event log
(`orchestrator.queue.usage`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from sqlalchemy import func, select as core_select
from sqlmodel import select

from orchestrator.core.errors import BadInput
from orchestrator.queue.models import Job, ProjectRecord
from orchestrator.queue.states import HOLDING
from orchestrator.queue.policy import DEFAULT_PROJECT

if TYPE_CHECKING:  # annotations only: the store module is the heavier import
    from orchestrator.queue.store import JobStore

JOBS = Job.__table__
MAX_SHARE = 1_000_000.0


@dataclass(frozen=True)
class Declared:
    """One project as declared (file or table): the policy's numbers, and where they came from."""

    name: str
    share: float = 1.0
    quota: int = 0
    borrow_limit: Optional[int] = None
    source: str = "config"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "share": self.share, "quota": self.quota, "borrow_limit": self.borrow_limit,
                "source": self.source}


def check(name: Any, share: Any, quota: Any, borrow_limit: Any, *, devices: int = 0, where: str = "") -> Declared:
    """A validated declaration (BadInput, one line naming `where`, otherwise). `devices`: the devices the live
    services know (0: none known, then any quota is accepted)."""
    at = f"{where}: " if where else ""
    if not isinstance(name, str) or not name.strip() or len(name) > 100 or any(c.isspace() for c in name):
        raise BadInput(f"{at}a project name is a non-empty word, got {name!r}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) \
            or not 0 < share <= MAX_SHARE:
        raise BadInput(f"{at}--share must be a number more than 0 (a weight), got {share!r}")
    for flag, value in (("--quota", quota), ("--borrow-limit", borrow_limit)):
        if value is None and flag == "--borrow-limit":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadInput(f"{at}{flag} must be a whole number of devices, at least 0, got {value!r}")
    if devices and quota > devices:
        raise BadInput(f"{at}--quota {quota} is more than the {devices} devices the live services have")
    return Declared(name, float(share), quota, borrow_limit)


def from_config(extra: Mapping[str, Any]) -> dict[str, Declared]:
    """The `[projects.NAME]` tables of config.toml (a Settings' `extra`), validated."""
    table = extra.get("projects") or {}
    if not isinstance(table, dict):
        raise BadInput("config.toml: [projects] must be tables like [projects.vision] share = 2")
    out = {}
    for name, body in table.items():
        if not isinstance(body, dict):
            raise BadInput(f"config.toml: [projects.{name}] must be a table (share, quota, borrow_limit)")
        unknown = set(body) - {"share", "quota", "borrow_limit"}
        if unknown:
            raise BadInput(f"config.toml: [projects.{name}] has unknown keys: {', '.join(sorted(unknown))}")
        out[name] = check(name, body.get("share", 1.0), body.get("quota", 0), body.get("borrow_limit"),
                          where=f"config.toml [projects.{name}]")
    return out


def declared(store: JobStore, extra: Mapping[str, Any]) -> dict[str, Declared]:
    """Every declared project by name: config.toml's, then the table's (which wins for the same name)."""
    out = from_config(extra)
    with store.db.read() as session:
        for row in session.exec(select(ProjectRecord).order_by(ProjectRecord.name)):
            out[row.name] = Declared(row.name, row.share, row.quota, row.borrow_limit, source="table")
    return out


def set_project(store: JobStore, name: str, *, share: Any = None, quota: Any = None, borrow_limit: Any = None,
                clear_borrow_limit: bool = False, devices: int = 0, extra: Mapping[str, Any] = {}) -> Declared:
    """Declare or change a project in the table (what is not given keeps its current value, or the file's)."""
    now = declared(store, extra).get(name)
    share = (now.share if now else 1.0) if share is None else share
    quota = (now.quota if now else 0) if quota is None else quota
    if borrow_limit is None and not clear_borrow_limit:
        borrow_limit = now.borrow_limit if now else None
    project = check(name, share, quota, borrow_limit, devices=devices)
    with store.db.tx() as session:
        row = session.get(ProjectRecord, name) or ProjectRecord(name=name)
        row.share, row.quota, row.borrow_limit, row.updated_at = project.share, project.quota, \
            project.borrow_limit, time.time()
        session.add(row)
    return Declared(project.name, project.share, project.quota, project.borrow_limit, source="table")


def resolve(name: Optional[str], known: Mapping[str, Declared]) -> str:
    """The project a submit goes to: `name`, or the default one; BadInput for a name not declared while
    projects are declared (a typo must not open a project of its own)."""
    if name is None or name == "":
        return DEFAULT_PROJECT
    if known and name not in known and name != DEFAULT_PROJECT:
        raise BadInput(f"unknown project {name!r}; declared: {', '.join(sorted(known))} "
                       "(add one with `autoresearch projects set NAME --share W`)")
    return name


def held_by_project(store: JobStore, *, exclude_host: Optional[str] = None) -> dict[str, int]:
    """Devices the jobs of each project hold (scavengers apart: not counted), on every host or all but one."""
    stmt = (core_select(JOBS.c.project, func.sum(JOBS.c.gpus))
            .where(JOBS.c.state.in_([s.value for s in HOLDING]), JOBS.c.scavenger.isnot(True))
            .group_by(JOBS.c.project))
    if exclude_host is not None:
        stmt = stmt.where(JOBS.c.host != exclude_host)
    with store.db.lone_read() as conn:
        return {(name or DEFAULT_PROJECT): int(n or 0) for name, n in conn.execute(stmt)}


def others_active(store: JobStore) -> bool:
    """Whether any waiting or holding job is in a project other than the default one (one indexed read)."""
    from orchestrator.queue.states import ACTIVE

    stmt = (core_select(JOBS.c.id).where(JOBS.c.state.in_([s.value for s in ACTIVE]),
                                         JOBS.c.project != DEFAULT_PROJECT).limit(1))
    with store.db.lone_read() as conn:
        return conn.execute(stmt).first() is not None


def queued_by_project(store: JobStore) -> dict[str, int]:
    """QUEUED jobs of each project (scavengers counted apart, under `(scavenger)`)."""
    stmt = (core_select(JOBS.c.project, JOBS.c.scavenger, func.count())
            .where(JOBS.c.state == "QUEUED").group_by(JOBS.c.project, JOBS.c.scavenger))
    out: dict[str, int] = {}
    with store.db.lone_read() as conn:
        for name, scavenger, n in conn.execute(stmt):
            key = "(scavenger)" if scavenger else (name or DEFAULT_PROJECT)
            out[key] = out.get(key, 0) + int(n)
    return out
