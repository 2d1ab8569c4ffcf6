"""Between the store and the executor: what the service does about the attempts it (or a lost host) started.

- exits the executor reports are buffered and recorded in one batch per dispatch pass; an attempt's records
  are dropped (`Executor.forget`) only once the store has its exit, so a crash in between loses nothing;
- stops: a job marked PREEMPTING/CANCELLING gets SIGTERM once, and SIGKILL when its grace has passed since
  (the time of the SIGTERM is in the store, so a restarted service keeps the schedule);
- reconcile after a restart: strays (attempts the queue gave to another host meanwhile) are stopped, jobs
  still running are adopted, jobs that ended get the state their exit code earned;
- reaping lost hosts (`orchestrator.service.reaper`), asking this service's executor.
The supervisor decides nothing about processes (the executor does) nor about states (the store does).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from orchestrator.service.reaper import reap_dead_hosts
from orchestrator.executors.base import Executor, Exit, owed_signal
from orchestrator.queue.models import Job
from orchestrator.queue.policy import Plan, Waiting
from orchestrator.queue.rows import Held
from orchestrator.queue.states import HOLDING, JobState
from orchestrator.queue.store import JobStore

log = logging.getLogger(__name__)
S = JobState


class Supervisor:
    """Records exits, enforces stops, reconciles and reaps for the service on `host`."""

    def __init__(self, store: JobStore, host: str, wake: Callable[[], None]):
        self.store = store
        self.host = host
        self.wake = wake
        self.executor: Executor | None = None
        self._exits: list[Exit] = []
        self._lock = threading.Lock()

    def on_exit(self, exit_: Exit) -> None:
        """The executor's callback (from its watcher thread): buffer the exit and wake the dispatcher."""
        with self._lock:
            self._exits.append(exit_)
        self.wake()

    def fresh_inventory(self, names: list[str]) -> list[str]:
        """The executor's devices when they changed from `names` (a Slurm partition that grew or shrank), made
        this host's inventory in the store, with a wake-up for a pass that plans with them; else `names`."""
        if self.executor is None or not self.executor.refreshes_inventory:
            return names
        fresh = self.executor.inventory()
        if fresh is None or fresh == names:
            return names
        log.info("%s: the executor's devices are now %s (were %s)", self.host, ",".join(fresh) or "none",
                 ",".join(names) or "none")
        self.store.hosts.sync_devices(self.host, fresh)
        self.wake()
        return fresh

    def take_exits(self) -> list[Exit]:
        """The buffered exits, to record (`record`); then `settled` once committed, else `put_back`."""
        with self._lock:
            exits, self._exits = self._exits, []
        return exits

    def record(self, exits: list[Exit]) -> list:
        """Record these exits in one batch (in the caller's transaction when it holds one)."""
        if not exits:
            return []
        finished = self.store.finish_many([(ex.job_id, ex.attempt, ex.code, ex.detail) for ex in exits], self.host)
        for job in finished:
            log.info("job %s -> %s (%s)", job.id, job.state, job.reason)
        return finished

    def put_back(self, exits: list[Exit]) -> None:
        """Exits the store could not take: kept for the next pass (the database may be back by then)."""
        with self._lock:
            self._exits[:0] = exits

    def settled(self, exits: list[Exit]) -> None:
        """The store has these exits: the executor drops what it kept of their attempts."""
        for ex in exits:
            self.executor.forget(ex.job_id, ex.attempt)

    def send_stop(self, job: Job) -> None:
        """SIGTERM a job just marked PREEMPTING/CANCELLING (a job not spawned yet is stopped as soon as
        its pid is recorded, by the next `enforce_stops`)."""
        if job.pid is None:
            return
        self.executor.stop(job)
        self.store.mark_stop_sent(job.id)

    def expire(self, mine: list[Job | Held]) -> list[Job | Held]:
        """Jobs running past their time limit start stopping (`mine` returned, those jobs updated)."""
        now = time.time()
        out = []
        for job in mine:
            if (job.time_limit and job.started_at and job.job_state is S.RUNNING
                    and now - job.started_at >= job.time_limit):
                job = self.store.expire(job.id, now) or job
            out.append(job)
        return out

    def enforce_stops(self, mine: list[Job | Held]) -> None:
        """Stops owed to this host's stopping jobs: the first SIGTERM, or SIGKILL after the grace."""
        for job in mine:
            if job.job_state not in (S.PREEMPTING, S.CANCELLING) or job.pid is None:
                continue
            if owed_signal(job.stop_sent_at, job.grace) is None:
                continue  # SIGTERM sent, grace not over
            if not isinstance(job, Job):  # a pass's light row (`Held`): signalling needs the whole job
                job = self.store.get(job.id)
            if job.stop_sent_at is None:
                self.send_stop(job)
            else:
                self.executor.stop(job, since=job.stop_sent_at)

    def reconcile(self) -> None:
        """Adopt or settle every job this host held when the last service stopped or died, and stop attempts
        still running here that the queue has since given back to the line (another host reaped us)."""
        held = self.store.list(HOLDING, host=self.host)
        for job_id in self.executor.stop_strays({(j.id, j.attempts) for j in held}):
            log.warning("reconcile: stopped a stray attempt of job %s (no longer ours in the queue)", job_id)
        for job in held:
            if job.pid is None:
                found = self.executor.find_attempt(job)
                if found is None:
                    self.store.requeue(job.id, "service restarted before the job was spawned", self.host)
                    continue
                job = self.store.mark_running(job.id, found.pid, found.proc_start, self.host)
            alive = self.executor.adopt(job)
            log.info("reconcile: job %s %s", job.id, "adopted" if alive else "had ended")

    def reap(self, stale_after: float) -> bool:
        """Settle the jobs of hosts that stopped heart-beating; whether any job changed state."""
        return bool(reap_dead_hosts(self.store, self.host, stale_after, self.executor))


_WHY = {"reclaim": "its project borrowed devices another project's quota reclaims",
        "scavenger": "a scavenger gives way to any waiting job"}


def preemption_reasons(plan: Plan, waiting: Sequence[Waiting]) -> dict[int, str]:
    """Each victim's event reason, by victim id: the job it yields to and, for a reclaim or a scavenger, why
    (`preempted for #9 (priority 0): its project borrowed devices another project's quota reclaims`)."""
    priority = {w.id: w.priority for w in waiting}
    yields = dict(plan.preempt_for)
    out = {}
    for victim, why in zip(plan.preempt, plan.why or ("priority",) * len(plan.preempt)):
        job_id = yields.get(victim)
        named = f"preempted for #{job_id} (priority {priority[job_id]})" if job_id in priority else "preempted"
        out[victim] = f"{named}: {_WHY[why]}" if why in _WHY else named
    return out
