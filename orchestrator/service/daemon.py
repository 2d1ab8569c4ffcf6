"""The queue service: places queued jobs on free, healthy devices, preempts, reaps, and recovers after crashes.

Threads:
- the dispatcher: woken by a submit/cancel datagram, by a job's exit, or by APScheduler's tick; each pass
  records, in one transaction, the last pass's starts and the exits since, asks the pure policy
  (`orchestrator.queue.policy.plan`) for starts and preemptions and claims them; then it enforces stops
  (SIGTERM, then SIGKILL after the grace) and has the executor start the claimed attempts (the local
  executor's spawner processes start them, `orchestrator.executors.local.spawner`);
- APScheduler jobs: the tick (a fallback wake-up), housekeeping (retry backoffs, heartbeat, reaping), and the
  device guard's run-time monitor and periodic re-check of idle devices (`orchestrator.service.guard`), and the
  GPU sampler (`orchestrator.service.gpuwatch`: utilisation and memory into the busy-share records);
- the executor's watcher, which reports exits.

Restart semantics (documented choice): stopping the service (SIGINT/SIGTERM) or losing it (`kill -9`) leaves
running jobs running; the next service on the same home adopts them, or records how they ended from the exit
code their wrapper wrote. No job is lost, none runs twice, every job ends in the state its process earned.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from orchestrator.core import devices as devspec, wakeup
from orchestrator.service import homelock
from orchestrator.queue import policy as scheduling
from orchestrator.api.jobs import SERVICE_STALE_AFTER, live_services, note_unplaceable
from orchestrator.core.gpushare import MAX_SHARERS
from orchestrator.core.config import Settings
from orchestrator.executors import executor_class
from orchestrator.executors.base import Exit, Executor, StartLost, cpu_threads, job_env
from orchestrator.queue.fairshare import ProjectBook
from orchestrator.core.diskfull import log_failure
from orchestrator.service.diskspace import DiskWatch
from orchestrator.service.gpuwatch import GpuWatch, is_gpu
from orchestrator.service.guard import DeviceGuard
from orchestrator.service.notices import ServiceNotices
from orchestrator.service.health import Health, HealthConfig
from orchestrator.core.layout import Layout, node_name
from orchestrator.queue.models import Job
from orchestrator.queue.store import JobStore
from orchestrator.api.intake import IntakeServer
from orchestrator.service.rungate import RunGate
from orchestrator.tracking.worker import TrackingWorker
from orchestrator.service.supervisor import Supervisor, preemption_reasons
from runtime.protocol import EX_TEMPFAIL

log = logging.getLogger(__name__)
HEARTBEAT_EVERY = 2.0
FULL_DISK_RETRY_S = 2.0  # a service started on a full disk tries its first writes again this often
SWITCH_INTERVAL = 0.0005  # seconds (sys.setswitchinterval) in `autoresearch serve`; see serve_forever
# Seconds a started attempt may wait for a pass to record it RUNNING: soon, not at once (a pass right away
# takes the CPU from the jobs starting up; any wake-up meanwhile, an exit or a submit, records it sooner).
RECORD_STARTS_WITHIN = 0.02
BACKFILL_WINDOW = 32  # queued jobs read past the first blocked one, as backfill candidates


def embedded(settings: Settings, store: JobStore, devices: Optional[str] = None) -> tuple[Optional["Service"], int]:
    """For a session (`start`, `resume`): a service of its own when none runs for this home, and the number of
    device slots the session can fill. The caller stops the returned service (None when one already ran)."""
    if not Service.running(settings):
        service = Service(settings, devices=devices).start()
        return service, len(service.device_names)
    return None, sum(len(s.devices) for s in live_services(store)) or 1


class Service:
    """One queue service for one home. `start()` runs it in background threads; `serve_forever()` blocks."""

    def __init__(self, settings: Settings, *, devices: Optional[str] = None, executor: Optional[str] = None,
                 preempt_after: Optional[float] = None, tick: float = 0.5,
                 executor_factory: Optional[Callable[["Service"], Executor]] = None,
                 health: Optional["HealthConfig"] = None):
        # Arguments given here are flags: they go through the same merge as the CLI's and win over the rest.
        settings = settings.with_flags(devices=devices, executor=executor, preempt_after=preempt_after)
        self.settings = settings
        self.home = Path(settings.home)
        self.store = JobStore.from_settings(settings)
        self.host = node_name(self.home, settings.node)
        self.preempt_after = settings.preempt_after
        self.tick = tick
        self.device_spec = settings.devices
        self._executor_name = settings.executor
        self._executor_factory = executor_factory
        self.layout = Layout(self.home)
        self._local_devices = executor_class(self._executor_name).local_devices
        self.executor: Optional[Executor] = None
        self.supervisor = Supervisor(self.store, self.host, self.wake)
        self.device_names: list[str] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._home_lock = homelock.HomeLock(self.home)
        self._listeners: list = []
        self._scheduler = None
        self._dispatcher: Optional[threading.Thread] = None
        self._started_at = time.time()
        # Dispatch passes completed: an observable "the dispatcher has looked at the queue" (tests wait on
        # it rather than sleeping and hoping a pass ran).
        self.passes = 0
        self._base_env = dict(os.environ)
        self._cores = len(os.sched_getaffinity(0))  # the host's cores this service may use, shared by its jobs
        # For executors whose starts block on something else (Ray's job submission): several at once.
        self._launchers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="launch")
        config = health or HealthConfig.from_settings(settings)
        if not self._local_devices:
            # Devices of a cluster live on other nodes: Ray places jobs and watches its nodes itself.
            config = replace(config, preflight="off", hang_timeout=0, recheck_every=0, monitor_every=0)
        self.health = Health(config, paths=[self.layout.checkpoints_dir])
        self.recheck_every = self.health.config.recheck_every
        self.guard = DeviceGuard(self.store, self.host, self.health, heartbeat_file=self.layout.heartbeat_file,
                                 stop_job=self.supervisor.send_stop, wake=self.wake)
        # MLflow runs are made by a child process started when tracked jobs wait: the service never imports it.
        self.tracking = TrackingWorker(settings.tracking_uri, settings.artifacts_dir)
        self.runs = RunGate(self.store, self.tracking)  # tracked jobs are claimed once their MLflow run exists
        # The GPUs' busy share: sampled through the guard's NVML session, on its own scheduler thread.
        self.gpuwatch = GpuWatch(self.store, self.host, interval=settings.gpu_sample_interval,
                                 session=self.guard.nvml_session, log_runs=self.tracking.log_metrics)
        self._launched: list = []  # (job, its start's outcome) of the last pass, for the next to record
        self._capacity = 0  # usable devices at the last dispatch pass (what the run preparer looks ahead for)
        self.projects = ProjectBook(self.store, settings.extra, self.host, settings.usage_half_life)
        self._backfill = settings.backfill == "on"
        from orchestrator.service.gc import Collector  # retention: its own scheduler job, never in a dispatch pass

        self.collector = Collector(settings, self.store, tag_runs=self.tracking.set_tags)
        self.notices = ServiceNotices(settings, self.store, self.host)  # announced off the dispatcher
        self.notifier = self.notices.notifier
        self.disk = DiskWatch([self.layout.checkpoints_dir, self.layout.logs_dir, self.home],
                              settings.disk_min_free_mb, collect=self.collect_garbage, on_low=self.notices.disk_low)
        self.guard.on_quarantine = self.notices.quarantined

    # ---- life cycle -------------------------------------------------------------------------------------

    @staticmethod
    def running(settings: Settings) -> bool:
        """Whether a service holds this home's lock right now."""
        return homelock.held(Path(settings.home))

    def start(self) -> "Service":
        """Take the home, reconcile what the last service left, and start the threads."""
        self.device_names = devspec.parse(self.device_spec) if self._local_devices else []
        self._home_lock.take()
        try:
            self.layout.ensure()
            self.executor = self.supervisor.executor = self._make_executor()
            inventory = self.executor.inventory()
            if inventory is not None:
                self.device_names = inventory
            self._through_full_disk(self._take_over)
            self.projects.refresh_if_due()  # the first pass plans with the projects
            threading.Thread(target=self._warm_up, name="warm-up", daemon=True).start()
            self._capacity = len(self.device_names)
            self.runs.start(lambda: self._capacity, self._wake.set)
            self._listeners = wakeup.listen(self.home, self.settings.db_url if self.store.db.is_postgres else None,
                                            self.wake)
            self._listeners.append(IntakeServer(self.settings, self.store, self.wake))
            self._start_scheduler()
            self._dispatcher = threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True)
            self._dispatcher.start()
            self.wake()
        except BaseException:
            self._home_lock.release()
            raise
        log.info("service %s on %s: devices %s", self.host, self.home, ",".join(self.device_names))
        return self

    def _take_over(self) -> None:
        """The start's writes: this host's devices and first heartbeat, then what the last service left."""
        self.store.hosts.sync_devices(self.host, self.device_names)
        self.store.hosts.heartbeat(self.host, os.getpid(), str(self.home), self.device_names, self._started_at,
                                   preempt_after=self.preempt_after, disk=self.disk.line(),
                                   executor=self.executor.name)
        self.supervisor.reconcile()

    def _through_full_disk(self, write: Callable[[], None]) -> None:
        """Run the start's `write`; while it fails for a full disk, say so once and try again every
        FULL_DISK_RETRY_S (a service started on a full disk, by hand or by systemd, comes up once space returns
        instead of exiting; each try is a transaction of its own, rolled back whole). A stop meanwhile ends the
        wait with the error."""
        said = False
        while True:
            try:
                write()
                break
            except Exception as exc:
                if not self.disk.write_failed(exc):
                    raise
                if not said:
                    log.warning("the disk under %s is full (%s); the service starts once a write succeeds",
                                self.home, str(exc).splitlines()[0][:160])
                    said = True
                if self._stop.wait(FULL_DISK_RETRY_S):
                    raise
        if said:
            log.warning("the queue database takes writes again; the service starts")

    def _make_executor(self) -> Executor:
        if self._executor_factory is not None:
            return self._executor_factory(self)
        return executor_class(self._executor_name).create(replace(self.settings, devices=self.device_spec),
                                                          self.layout, self._on_exit)

    def _start_scheduler(self) -> None:
        from apscheduler.schedulers.background import BackgroundScheduler

        # A tick skipped because the last one still runs is expected under load, not worth a warning.
        logging.getLogger("apscheduler").setLevel(logging.ERROR)
        sched = BackgroundScheduler(daemon=True, job_defaults={"coalesce": True, "max_instances": 1,
                                                               "misfire_grace_time": 5})
        sched.add_job(self.wake, "interval", seconds=self.tick, id="tick")
        sched.add_job(self._housekeeping, "interval", seconds=1.0, id="housekeeping")
        if self.settings.gc_every:
            sched.add_job(self.collect_garbage, "interval", seconds=self.settings.gc_every, id="gc")
        if self.recheck_every:
            sched.add_job(self.guard.recheck_idle, "interval", seconds=self.recheck_every, id="recheck")
        if self.health.config.monitor_every:  # its own thread: a slow NVML must not delay the heartbeat
            sched.add_job(self.guard.monitor, "interval", seconds=self.health.config.monitor_every, id="monitor")
        if self.settings.gpu_sample_interval and self._local_devices and any(map(is_gpu, self.device_names)):
            sched.add_job(self.gpuwatch.tick, "interval", seconds=self.settings.gpu_sample_interval, id="gpuwatch")
        sched.start()
        self._scheduler = sched

    def stop(self) -> None:
        """Stop dispatching. Running jobs keep running; the next service on this home adopts them."""
        self._stop.set()
        self._wake.set()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=10)
        for listener in self._listeners:
            listener.close()
        self._launchers.shutdown(wait=True)
        self.gpuwatch.close()  # a sample under way must not start a tracking worker once it is closed
        self.runs.close()
        if self.executor is not None:
            self.executor.close()
        if self._launched:  # the last pass's starts: their processes run, so the store gets their pids
            try:
                self._record(self._launched, [])
                self.notices.flush()
            except Exception as exc:  # the next service finds them by their wrappers' environment
                log_failure(log, "could not record the last starts (the next service adopts them)", exc)
        self.guard.close()
        self.notices.close()
        try:
            self.store.hosts.remove_service(self.host)
        except Exception as exc:  # the database may be gone; the heartbeat row then simply goes stale
            log_failure(log, "could not remove the service record", exc)
        self._home_lock.release()

    def serve_forever(self, on_started: Optional[Callable[[], None]] = None) -> None:
        """Run until SIGINT or SIGTERM. `on_started` is called once the service holds the home and runs (so
        `serve` says "serving" only when it is: a second service on a home is refused before that)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._stop.set())
        # The service's threads make many short SQLite and MLflow calls that release the GIL; with the default
        # switch interval each one waits for a whole interval to get it back while another thread computes (a
        # convoy: benchmarks/RESULTS.md, "The switch interval"). A whole process of our own: set here.
        sys.setswitchinterval(SWITCH_INTERVAL)
        self.start()
        try:
            if on_started is not None:
                on_started()
            while not self._stop.wait(1.0):
                pass
        finally:
            self.stop()

    def wake(self) -> None:
        """Run a dispatch pass soon. (The pass wakes the run preparer when tracked jobs in its window lack an
        MLflow run: waking it on every submit and exit cost a query of the queue each, for every job.)"""
        self._wake.set()

    # ---- events from the executor -----------------------------------------------------------------------

    def _on_exit(self, exit_: Exit) -> None:
        self.supervisor.on_exit(exit_)

    def _record(self, launched: list, exits: list[Exit]) -> None:
        """Record the last pass's starts (RUNNING, or failed: a `StartLost` one requeued free), then the exits."""
        self.store.mark_running_many([(job.id, out.pid, out.proc_start, out.how) for job, out in launched
                                      if not isinstance(out, Exception)], self.host)
        ended = self.store.finish_many([(job.id, job.attempts, EX_TEMPFAIL if isinstance(out, StartLost) else 127,
                                         f"could not start: {out}")
                                        for job, out in launched if isinstance(out, Exception)], self.host)
        # Announced once the caller's transaction has committed (`notices.flush`): a pass rolled back records
        # these exits again later.
        self.notices.ended(list(ended or []) + list(self.supervisor.record(exits) or []))
        self.notices.nodes_failed(exits)

    # ---- the dispatcher ---------------------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=RECORD_STARTS_WITHIN if self._launched else self.tick * 4)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                with self.guard.placing():  # devices under an idle check stay out of the pass, to its claim
                    self.dispatch_once()
                self.disk.write_ok()
            except Exception as exc:
                first = self.disk.full_error is None
                if self.disk.write_failed(exc):  # one line per episode, not a traceback per pass
                    if first:
                        log.error("dispatch pass failed: the disk is full (%s); retrying until space returns",
                                  str(exc).splitlines()[0][:200])
                    time.sleep(0.5)
                    continue
                log.exception("dispatch pass failed; retrying on the next wake-up")
                time.sleep(0.2)

    def dispatch_once(self) -> None:
        """One pass (under `guard.placing()`). In one transaction: record the last pass's starts and the exits
        since, read the queue, plan, preempt and claim. Then signal stops and start the claimed attempts,
        whose outcomes the next pass records."""
        launched, self._launched = self._launched, []
        exits = self.supervisor.take_exits()
        try:
            with self.store.db.transaction():
                self._record(launched, exits)
                mine, preempted, claimed = self._plan_and_claim()
        except Exception:
            self._launched[:0] = launched
            self.supervisor.put_back(exits)
            self.notices.discard()
            raise
        self.notices.flush()
        self.supervisor.settled(exits)
        self.supervisor.enforce_stops(mine)
        for job in preempted:
            self.supervisor.send_stop(job)
        self._start_claimed(claimed, busy={d for held in mine for d in held.devices or ()})
        self.passes += 1

    def _plan_and_claim(self) -> tuple[list, list[Job], list[Job]]:
        """Read the queue, plan, and write the plan's preemptions and claims (in the pass's transaction).
        Returns the jobs this host holds (as read), those preempted and those claimed."""
        usable = self.guard.schedulable(self.store.hosts.available_devices(self.host))
        # The window: jobs that can never run here are left out in SQL, and of the rest the policy can act on
        # at most one per usable device plus the first it must stop at (each start or reservation uses at least
        # one device that is free, being released, or preemptible; a job that finds none ends the pass), and
        # fair sharing picks each project's head: so a window of the whole line and one of each declared
        # project's line (orchestrator.queue.queries.snapshot). The pass reads O(devices x projects) rows
        # whatever the queue's length.
        capacity = self._capacity = len(set(usable))
        projects = self.projects.projects()
        # Backfill looks past the first blocked job: a few more rows than the devices.
        # Shares of a GPU pack up to MAX_SHARERS jobs onto one device: so many starts per device, at most.
        window = capacity * MAX_SHARERS + 1 + (BACKFILL_WINDOW if self._backfill else 0)
        queued, mine = self.store.snapshot(self.host, capacity=capacity, limit=window,
                                           skip=self.runs.skipped(), projects=self.projects.names)
        queued = self.disk.gate(queued, self.store.note)  # none start while disk space is short
        self.runs.look_ahead(queued)  # the preparer makes their runs, and those of the next jobs in line
        mine = self.supervisor.expire(mine)  # time limits first: those jobs stop in this pass
        now = time.time()
        waiting = [scheduling.Waiting.of(row) for row in queued]
        running = [scheduling.Running.of(j, now) for j in mine]
        plan = scheduling.plan(waiting, running, usable, now, self.preempt_after, projects, backfill=self._backfill,
                               device_memory=self.guard.memory_totals(usable))
        # Each victim's event says why and names the job it yields to (what `show` on the victim says).
        reasons = preemption_reasons(plan, waiting)
        preempted = self.store.preempt(plan.preempt, reasons, self.host) if plan.preempt else []
        if plan.expired:
            self.store.miss_deadlines(plan.expired)
        claimed = self._claim(plan.starts, {row.id for row in queued if row.needs_run}) if plan.starts else []
        return mine, preempted, claimed

    def _claim(self, starts, need_runs: set[int]) -> list[Job]:
        """Claim the starts that can be (each claim is an attempt). `need_runs`: ids of jobs that are tracked
        and have no MLflow run yet (they wait for it: `RunGate`)."""
        starts = self.runs.claimable(list(starts), need_runs)
        return self.store.claim(starts, self.host, checkpoint_root=str(self.layout.checkpoints_dir),
                                log_root=str(self.layout.logs_dir))

    def _start_claimed(self, claimed: list[Job], busy: set[str] = frozenset()) -> None:
        """Check the claimed attempts' devices and start them (the spawns waited for: several at once). The
        outcomes are recorded by the next pass, in its transaction (within RECORD_STARTS_WITHIN). `busy`: the
        devices jobs already held before this pass (a job joining its sharers there is not preflighted)."""
        batch = []
        shared = set(busy)
        for job in claimed:
            try:
                # A share of a device that already runs jobs: their processes would fail the quick checks as
                # foreign, and the run-time monitor already watches it. The first sharer was checked.
                joins = job.shares_gpu and set(job.devices or ()) <= shared
                if joins or self.guard.preflight_ok(job):
                    if job.shares_gpu:
                        shared.update(job.devices or ())
                    # This host's cores, for the jobs this host runs (a cluster's nodes have cores of their own).
                    threads = cpu_threads(job, self.device_names, self._cores) if self._local_devices else None
                    batch.append((job, job_env(job, base=self._base_env, layout=self.layout,
                                               tracking_uri=self.settings.tracking_uri, threads=threads)))
            except Exception as exc:
                log.exception("could not prepare job %s", job.id)
                self.store.finish(job.id, 127, self.host, detail=f"could not start: {exc}")
        if not batch:
            return
        outcomes = self.executor.launch_many(batch, pool=self._launchers)
        for (job, _), outcome in zip(batch, outcomes):
            if isinstance(outcome, Exception):
                log.error("could not start job %s: %s", job.id, outcome)
        self._launched.extend((job, outcome) for (job, _), outcome in zip(batch, outcomes))

    def _warm_up(self) -> None:
        """Start-up costs paid off the dispatch path: a first preflight of every device (passes are trusted
        for the TTL, failures quarantined). Nothing here imports torch or MLflow (GPUs are checked in a child
        process, cpu slots with the standard library; runs are made by the tracking worker)."""
        if self._local_devices:
            self.guard.warm_up()

    # ---- retention ----------------------------------------------------------------------------------------

    def collect_garbage(self) -> None:
        """One retention pass (the scheduler's `gc` job, on its own thread: the queue never waits for it)."""
        self.collector.run_pass()

    @property
    def gc_passes(self) -> int:
        """Retention passes completed (tests and the soak benchmark wait on it)."""
        return self.collector.passes

    # ---- recovery and housekeeping ------------------------------------------------------------------------

    def _housekeeping(self) -> None:
        try:
            requeued = self.store.requeue_due()
            self.store.miss_deadlines()  # deep in the line too: a job that cannot meet its deadline ends
            self.projects.refresh_if_due()
            self.device_names = self.supervisor.fresh_inventory(self.device_names)  # a Slurm partition resized
            self.store.hosts.heartbeat(self.host, os.getpid(), str(self.home), self.device_names, self._started_at,
                                       preempt_after=self.preempt_after, disk=self.disk.line(),
                                       executor=self.executor.name)
            if requeued:
                self.wake()
            if self.supervisor.reap(SERVICE_STALE_AFTER):  # a crashed host's jobs
                self.wake()
            note_unplaceable(self.store)  # the monitor runs on its own thread (guard), never behind this
        except Exception as exc:
            if not self.disk.write_failed(exc):
                log.exception("housekeeping failed")
