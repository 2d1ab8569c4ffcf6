"""What the service tells the policy about projects: the declared ones, their decayed usage and the devices
their jobs hold on other hosts of a shared queue, read at most every REFRESH seconds (the usage changes slowly,
and within a pass the policy charges its own starts: `orchestrator.queue.policy`).

With no project declared and no job of another project, the policy gets no `Project` at all: every job is in
the default project and the plan is the single-line plan.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from orchestrator.queue import policy as scheduling
from orchestrator.queue import projects as proj
from orchestrator.queue import usage

log = logging.getLogger(__name__)
REFRESH = 5.0  # seconds between reads of the declarations, the usage and the other hosts' holdings
USAGE_HORIZON = 10  # half-lives of history read for the decayed usage (2^-10: the rest weighs nothing)


class ProjectBook:
    """The projects one service plans with, refreshed from the store every REFRESH seconds."""

    def __init__(self, store: Any, extra: dict, host: str, half_life: float):
        self.store, self.extra, self.host, self.half_life = store, extra, host, half_life
        self._at = -REFRESH
        self._projects: tuple[scheduling.Project, ...] = ()
        self.names: tuple[str, ...] = ()  # declared projects: each has its own window of the line

    def projects(self) -> tuple[scheduling.Project, ...]:
        """The `Project`s of the next pass: the last refresh's (a pass never reads the event log itself)."""
        return self._projects

    def refresh_if_due(self) -> None:
        """Read the declarations, usage and other hosts' holdings again when REFRESH has passed (housekeeping's
        thread, outside the dispatch pass's transaction: the usage reads the event log)."""
        if time.monotonic() - self._at < REFRESH:
            return
        try:
            self._refresh()
        except Exception:  # the queue still runs on the last known numbers
            log.exception("could not read the projects")
        self._at = time.monotonic()

    def _refresh(self) -> None:
        declared = proj.declared(self.store, self.extra)
        if not declared and not proj.others_active(self.store):
            self._projects, self.names = (), ()  # one default project: the single-line plan, no usage to read
            return
        now = time.time()
        spent = usage.decayed_by_project(usage.attempts(self.store, since=now - USAGE_HORIZON * self.half_life,
                                                        now=now), now, self.half_life)
        elsewhere = proj.held_by_project(self.store, exclude_host=self.host)
        names = sorted(set(declared) | set(spent) | set(elsewhere))
        self._projects = tuple(
            scheduling.Project(name, share=declared[name].share if name in declared else 1.0,
                               quota=declared[name].quota if name in declared else 0,
                               borrow_limit=declared[name].borrow_limit if name in declared else None,
                               usage=spent.get(name, 0.0), held_elsewhere=elsewhere.get(name, 0))
            for name in names)
        self.names = tuple(sorted(set(declared) | {scheduling.DEFAULT_PROJECT}))
