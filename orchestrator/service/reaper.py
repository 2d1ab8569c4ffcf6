"""Several services sharing one queue: settling the jobs of a host that died.

Dead-host semantics (a documented choice). A service heart-beats every 2 s into the `services` table. When a
host's heartbeat is older than `stale_after`, any live service may reap it; exactly one does at a time (a lease,
`orchestrator.queue.hosts`). For each job the dead host held, the reaper asks its own executor about the
attempt (`Executor.probe`, given the dead host's home so exit records and process trees there are found):
- RUNNING (the service died, not the machine, or a Ray job still runs on the cluster): it is stopped like a
  preemption, SIGTERM then SIGKILL after the job's grace (`Executor.stop`), and settled on a later pass once
  gone. It checkpoints and runs again elsewhere; it never runs twice at once;
- ENDED with a recorded exit code: the job gets the state that code earns, except that the code of a job this
  reaper stopped requeues it without spending an attempt (the loss was not the job's fault);
- UNKNOWN (a cluster that does not answer): the job waits, rather than risk a rerun;
- GONE (another machine that stopped answering, or a job not yet spawned): it is requeued, like Slurm
  requeues the jobs of a node that went down. A job whose machine is alive but unreachable from here would
  then run twice: the stale limit (10 s, five missed heartbeats) is the guard, as in every lease-based queue.
When such a machine's service comes back, it does not adopt the jobs it lost (they are no longer its own):
its reconcile step stops their processes (`Executor.stop_strays`).
Once the dead host holds nothing, its `services` row is deleted. A service that stopped cleanly removes its
own row and its jobs wait for it to come back (they are adopted), so only crashed hosts are reaped.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from orchestrator.executors.base import Executor, Liveness
from orchestrator.core.layout import Layout
from orchestrator.queue import hosts
from orchestrator.queue.models import Job
from orchestrator.queue.states import HOLDING, JobState
from orchestrator.queue.store import JobStore

log = logging.getLogger(__name__)
S = JobState


def reap_dead_hosts(store: JobStore, self_host: str, stale_after: float, executor: Executor) -> list[Job]:
    """Settle the jobs of every host whose heartbeat is older than `stale_after` seconds, asking `executor`
    about their attempts; returns the jobs whose state changed (requeued or finished)."""
    cutoff = time.time() - stale_after
    changed: list[Job] = []
    for host in hosts.stale_hosts(store, self_host, cutoff):
        with hosts.reaping(store, host, cutoff) as lease:
            if lease is None:
                continue  # another service is reaping it, or it came back
            done, pending = _settle(store, executor, lease, self_host)
            changed.extend(done)
            lease.settled = not pending
            if lease.settled:
                log.warning("host %s is gone (no heartbeat since %.0fs ago); its jobs were settled",
                            host, hosts.lease_age(lease))
    return changed


def _settle(store: JobStore, executor: Executor, lease: hosts.Lease, self_host: str) -> tuple[list[Job], bool]:
    """One pass over the dead host's jobs: (jobs settled, whether some are still being stopped or unknown)."""
    layout: Optional[Layout] = Layout(Path(lease.home)) if lease.home else None
    changed: list[Job] = []
    pending = False
    reason = f"host {lease.host} lost (no heartbeat)"
    for job in store.list(HOLDING, host=lease.host):
        probe = executor.probe(job, layout)
        if job.job_state is S.STARTING and probe.found is not None:
            # Spawned, but the dead service never recorded it: record it, then stop or settle it as the rest.
            job = store.mark_running(job.id, probe.found.pid, probe.found.proc_start, self_host)
        if probe.state is Liveness.UNKNOWN:
            log.warning("reaper: job %s of %s: %s; trying again later", job.id, lease.host, probe.detail)
            pending = True
            continue
        if probe.state is Liveness.RUNNING:
            sent = executor.stop(job, since=job.stop_sent_at, layout=layout)
            if job.stop_sent_at is None:
                store.mark_stop_sent(job.id)
            if sent is not None:
                log.warning("job %s of a lost host still runs here: sent %s", job.id, sent.name)
            pending = True
            continue
        stopped_by_us = job.job_state is S.RUNNING and job.stop_sent_at is not None
        if probe.state is Liveness.ENDED and not (stopped_by_us and probe.code != 0):
            changed.append(store.finish(job.id, probe.code, self_host,
                                        detail=f"exit code {probe.code}, recorded after {reason}"))
        else:
            changed.append(store.requeue(job.id, reason, self_host))
        log.info("reaped job %s of %s -> %s", job.id, lease.host, changed[-1].state)
    return changed, pending
