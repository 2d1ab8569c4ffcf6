"""The Slurm executor: each attempt is one Slurm batch job (`sbatch` of a small wrapper), so Slurm places it on
a node of the partition, under the cluster's own fair share and limits.

Why sbatch and not srun under one allocation: an allocation held by the service would keep its nodes busy
while our queue is empty and hide our work from the cluster's fair share; a batch job per attempt is what
a cluster admin expects, survives the service (slurmstepd keeps it running), and starts soon enough on an idle
cluster (benchmarks/slurm_submit.py; benchmarks/RESULTS.md, "Slurm executor").

Placement. The service plans with slots as on one host; Slurm decides where a job runs:
- `--devices auto` (the default): the slots are the GPUs the partition offers (`slurm:0`, ...; the sum of
  each node's `gpu` gres, read at start and again every `inventory_every` seconds by the watcher, one `sinfo`
  each time, so a partition that grows or shrinks is seen without a restart), and a job asks `--gres=gpu:N`
  on one node (`-N1`);
- `--devices cpu:N`: N slots of one Slurm CPU each; a job of `--gpus K` asks `--cpus-per-task=K`;
- a job that needs more than the largest node has is refused with one line; a job across nodes (`--nodes N`)
  is one gang: `sbatch --nodes=N --ntasks-per-node=1` whose `srun` starts a launcher on every node
  (`orchestrator.executors.slurm.nodelaunch`: the node's preflight, then torchrun with a c10d rendezvous).
  Its nodes are watched through their launchers' records (`orchestrator.executors.slurm.nodes`): a lost node
  (silent launcher), a failed preflight or device fault, or a node Slurm reports failed ends the attempt as 75
  with the node excluded from the job's next attempts (`--exclude`); a silent node's gang is cancelled at once,
  so no rank outlives it.

Each attempt: job name `autoresearch-ID-ATTEMPT-TAG` (how it is found again), `--output` appended to the
job's log under the home (the home must be on a filesystem the nodes share, as for checkpoints), the
job protocol's environment exported by sbatch, `--time` from the job's time limit plus its grace (the service
stops a job at its limit itself; Slurm's limit is the backstop), `--signal=B:TERM@GRACE` so Slurm's own end
of a job is announced like ours, and `--requeue` so Slurm may preempt it (`PreemptMode=REQUEUE`).

Stops: SIGTERM is `scancel --batch --signal=TERM` (the wrapper forwards it to the job's process group);
SIGKILL is `scancel` (Slurm's SIGTERM to every process, SIGKILL after its KillWait). Exit codes come from
the wrapper's exit file (`slurm_jobs`), else from `scontrol show job`. A Slurm-side requeue (`scontrol
requeue`, preemption by Slurm, a failed node) ends our attempt: the Slurm job is cancelled and the attempt
reported as exit 75 with Slurm's reason, so our queue runs it again (with its checkpoint) under a new attempt,
never twice at once and never lost.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orchestrator.core import devices as devspec
from orchestrator.core.errors import BadInput
from orchestrator.executors.slurm import gang
from orchestrator.executors.slurm import jobs as sj
from orchestrator.executors.slurm import nodes as sn
from orchestrator.executors.slurm.target import check_target, describe_target, placement_options
from orchestrator.executors.base import Executor, Exit, Launched, Liveness, OnExit, Probe, describe, job_argv
from orchestrator.core.layout import Layout
from orchestrator.queue.models import Job
from orchestrator.core.config import Settings
from runtime import protocol

log = logging.getLogger(__name__)
GPU_PREFIX = "slurm:"
INVENTORY_EVERY = 30.0  # seconds between two reads of the partition's nodes (one `sinfo`)


@dataclass
class _Watch:
    job_id: int
    attempt: int
    slurm_id: str
    restarts: int = 0  # Slurm's restart count when we started watching
    nodes: int = 1  # the nodes the job asked for: above 1, its nodes' records are watched too
    checked: float = 0.0  # when the nodes' heartbeats were last read (monotonic)


class SlurmExecutor(Executor):
    """Runs attempts as Slurm batch jobs in `settings.slurm_partition` (else the cluster's default)."""

    name = "slurm"
    local_devices = False  # Slurm places jobs on its nodes and watches them itself
    refreshes_inventory = True  # the partition's nodes are read again while the service runs

    def __init__(self, settings: Any, layout: Layout, on_exit: OnExit, *, poll: float = 0.25):
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.partition = getattr(settings, "slurm_partition", None)
        self.account = getattr(settings, "slurm_account", None)
        self.qos = getattr(settings, "slurm_qos", None)
        self.device_spec = str(settings.devices or "auto")
        self.cpu_slots = self.device_spec.startswith("cpu:")
        self.poll = poll
        self._on_exit = on_exit
        self.nodes = check_target(settings)
        self.inventory_every = INVENTORY_EVERY
        self._nodes_read = time.monotonic()
        self.layout.ensure()
        self.wrapper = sj.write_wrapper(self.layout.home / "slurm" / "wrapper.sh")
        self._watches: dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch_loop, name="slurm-executor-watch", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, settings: Settings, layout: Layout, on_exit: OnExit) -> "SlurmExecutor":
        return cls(settings, layout, on_exit)

    # ---- capacity -----------------------------------------------------------------------------------------

    def inventory(self) -> Optional[list[str]]:
        """cpu:N: N slots of one Slurm CPU each; auto: one slot per GPU of the partition (as last read)."""
        if self.cpu_slots:
            return devspec.parse(self.device_spec)
        return [f"{GPU_PREFIX}{i}" for i in range(sum(n[2] for n in self.nodes))]

    def _per_node(self) -> int:
        """The most slots one job can get on one node (CPUs on cpu slots, else GPUs)."""
        return max(((n[1] if self.cpu_slots else n[2]) for n in self.nodes), default=0)

    def _refresh_nodes(self) -> None:
        """Read the partition's nodes again once `inventory_every` has passed since the last read (a failed
        read keeps the last inventory: a briefly unreachable controller takes no slots away)."""
        if time.monotonic() - self._nodes_read < self.inventory_every:
            return
        self._nodes_read = time.monotonic()
        try:
            nodes = sj.partition_nodes(self.partition)
        except sj.SlurmError as exc:
            log.warning("slurm: cannot read the partition's nodes now (%s); keeping the last inventory", exc)
            return
        if nodes != self.nodes:
            log.info("slurm: %s changed: %s", self._describe_target(), nodes)
            self.nodes = nodes

    # ---- the Executor interface ---------------------------------------------------------------------------

    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        if job.image:
            raise BadInput(f"job {job.id}: --image jobs are not supported with --executor slurm yet")
        per_node = job.gpus_per_node if job.node_count > 1 else job.gpus
        if per_node > self._per_node():
            unit = "CPUs" if self.cpu_slots else "GPUs"
            fix = "; ask for fewer per node" if job.node_count > 1 else "; spread it across nodes with --nodes"
            raise BadInput(f"job {job.id} needs {per_node} {unit} on one node; the largest node of "
                           f"{self._describe_target()} has {self._per_node()}{fix}")
        if job.node_count > len(self.nodes) and not job.min_nodes:
            raise BadInput(f"job {job.id} needs {job.node_count} nodes; {self._describe_target()} has "
                           f"{len(self.nodes)}")
        name = sj.job_name(job)
        argv = job_argv(job) if job.node_count == 1 else gang.argv(self.layout.home, job)
        log_path = Path(job.log_path or self.layout.log_path(job.id))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            log_from = out.tell()  # where this attempt's part of the log starts (srun's word on failed nodes)
            out.write(f"=== autoresearch: attempt {job.attempts} of job {job.id} on slurm ({name}, "
                      f"{','.join(job.devices) or '-'}): {describe(argv)}\n".encode())
        if job.checkpoint_dir:
            os.makedirs(job.checkpoint_dir, exist_ok=True)  # visible to the nodes on a shared home
        exit_file = self.layout.exit_file(job.id, job.attempts)
        exit_file.unlink(missing_ok=True)
        options = [*placement_options(self.partition, self.account, self.qos), "-J", name,
                   *gang.shape(self.layout.home, job, self.nodes), f"--output={log_path}", f"--error={log_path}",
                   "--open-mode=append", "--requeue", "--export=ALL",
                   f"--signal=B:TERM@{max(1, int(math.ceil(job.grace)))}"]
        options += [f"--cpus-per-task={per_node}"] if self.cpu_slots else [f"--gres=gpu:{per_node}"]
        if job.time_limit:
            options.append(f"--time={max(1, math.ceil((job.time_limit + job.grace + 30) / 60))}")
        cwd = job.cwd if job.cwd and os.path.isdir(job.cwd) else str(Path.home())
        try:
            slurm_id = sj.submit(options, self.wrapper, [cwd, *argv], self._env(job, env, exit_file))
        except sj.SlurmError as exc:
            found = self.find_attempt(job)  # a submit that timed out may have got through
            if found is None:
                raise RuntimeError(f"sbatch refused job {job.id}: {exc}") from None
            slurm_id = sj.parse_handle(found.proc_start) or ""
        if job.node_count > 1:
            sn.note_attempt(self.layout.home, job.id, job.attempts, slurm=slurm_id, asked=job.node_count,
                            per_node=per_node, log=str(log_path), log_from=log_from,
                            min=job.min_nodes or job.node_count, excluded=sn.excluded(self.layout.home, job.id))
        self._watch(_Watch(job.id, job.attempts, slurm_id, nodes=job.node_count))
        return Launched(0, sj.handle(slurm_id))

    def signal(self, job: Job, sig: int, layout: Optional[Layout] = None) -> None:
        slurm_id = self._slurm_id(job)
        if slurm_id is None:
            return
        try:
            row = sj.queue([slurm_id]).get(slurm_id)
            if sig == signal.SIGKILL or (row is not None and row.state == "PENDING"):
                # Slurm's end of the job: every process on every node, however it forked; a pending job has no
                # shell to signal and is simply cancelled.
                sj.cancel(slurm_id)
            elif row is not None and not row.terminal:
                # A gang: the signal goes to every node's step (each node's launcher and ranks), not the batch shell.
                sj.cancel(slurm_id, sig, steps=job.node_count > 1)
        except sj.SlurmError as exc:  # the watcher reports what became of it
            log.warning("scancel of slurm job %s (job %s): %s", slurm_id, job.id, exc)

    def probe(self, job: Job, layout: Optional[Layout] = None) -> Probe:
        layout = layout or self.layout
        slurm_id = self._slurm_id(job)
        try:
            if slurm_id is None:
                rows = sj.queue(name=sj.job_name(job))
                slurm_id = next(iter(rows), None)
                if slurm_id is None:
                    return Probe(Liveness.GONE)
            row = sj.queue([slurm_id]).get(slurm_id)
        except sj.SlurmError as exc:  # an unreachable controller: wait rather than risk a rerun
            return Probe(Liveness.UNKNOWN, detail=f"cannot ask Slurm about job {job.id}: {exc}")
        found = Launched(0, sj.handle(slurm_id))
        if row is not None and not row.terminal and row.restarts == 0:
            return Probe(Liveness.RUNNING, found=found)
        code, detail = self._ending(job.id, job.attempts, slurm_id, row, layout)
        if job.node_count > 1 and layout.home == self.layout.home:  # a gang: a failed node's end is a requeue
            code, detail = self._gang_failure(_Watch(job.id, job.attempts, slurm_id, nodes=job.node_count),
                                              ended=True, fallback=(code, detail))
        if code is None:
            return Probe(Liveness.GONE, detail=detail)
        return Probe(Liveness.ENDED, code, detail, found=found)

    def adopt(self, job: Job) -> bool:
        slurm_id = self._slurm_id(job)
        watch = _Watch(job.id, job.attempts, slurm_id or "")
        try:
            row = sj.queue([slurm_id]).get(slurm_id) if slurm_id else None
        except sj.SlurmError as exc:
            log.warning("slurm: cannot look up job %s now (%s); watching it", job.id, exc)
            self._watch(watch)
            return True
        watch.nodes = job.node_count
        if row is not None and not row.terminal:
            self._watch(watch)  # a restart count above 0 is noticed (a requeue) by the watcher
            return True
        self._settle(watch, row)
        return False

    def find_attempt(self, job: Job) -> Optional[Launched]:
        try:
            rows = sj.queue(name=sj.job_name(job))
        except sj.SlurmError:
            return None
        return Launched(0, sj.handle(max(rows, key=int))) if rows else None

    def forget(self, job_id: int, attempt: int) -> None:
        self.layout.exit_file(job_id, attempt).unlink(missing_ok=True)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    # ---- watching -----------------------------------------------------------------------------------------

    def _watch(self, watch: _Watch) -> None:
        with self._lock:
            self._watches[watch.slurm_id] = watch

    def _watch_loop(self) -> None:
        """One `squeue` for every watched attempt each poll; ended and requeued ones are reported."""
        while not self._closed.wait(self.poll):
            self._refresh_nodes()
            with self._lock:
                watches = list(self._watches.values())
            if not watches:
                continue
            try:
                rows = sj.queue([w.slurm_id for w in watches])
            except sj.SlurmError as exc:  # the controller is briefly unreachable: keep watching
                log.warning("slurm: squeue failed: %s", exc)
                continue
            for watch in watches:
                row = rows.get(watch.slurm_id)
                if row is not None and not row.terminal and row.restarts <= watch.restarts:
                    if watch.nodes > 1 and self._gang_lost(watch):
                        self._settle_lost(watch)
                    continue
                with self._lock:
                    self._watches.pop(watch.slurm_id, None)
                try:
                    self._settle(watch, row)
                except Exception:  # (scancel of a requeued job failed): try again on the next poll
                    log.exception("slurm: could not settle job %s (slurm job %s)", watch.job_id, watch.slurm_id)
                    self._watch(watch)

    def _gang_lost(self, watch: _Watch) -> bool:
        """Whether a running gang lost a node (read at most once a heartbeat); notes the attempt's nodes."""
        now = time.monotonic()
        if now - watch.checked < sn.BEAT:
            return False
        watch.checked = now
        recs = sn.records(self.layout.home, watch.job_id, watch.attempt)
        return bool(recs and sn.lost(recs, {}, ended=False, silent_only=True))

    def _settle_lost(self, watch: _Watch) -> None:
        """A running gang lost a node: the whole Slurm job is ended (no rank outlives it: Slurm stops every
        node's processes) and the attempt reported as a node failure."""
        with self._lock:
            if self._watches.pop(watch.slurm_id, None) is None:
                return
        try:
            sj.cancel(watch.slurm_id)
        except sj.SlurmError as exc:
            log.warning("slurm: could not cancel job %s after a lost node: %s", watch.slurm_id, exc)
        self._report(watch, *self._gang_failure(watch, ended=False, fallback=(protocol.EX_TEMPFAIL, "")))

    def _failed_nodes(self, watch: _Watch) -> tuple[tuple[str, str], ...]:
        """The nodes the attempt's settling found failed (for the service's `node.failed`)."""
        failed = (sn.job_state(self.layout.home, watch.job_id).get("attempts") or {}).get(str(watch.attempt), {})
        return tuple(sorted((failed.get("failed") or {}).items()))

    def _gang_failure(self, watch: _Watch, *, ended: bool, fallback: tuple[int, str]) -> tuple[int, str]:
        """(code, detail) of a gang's attempt: its failed nodes (lost, failed preflight, down in Slurm)
        excluded from the job's later attempts and the attempt requeued (75); else `fallback`. Nodes it ended
        well on start their failures in a row again."""
        home = self.layout.home
        settled = (sn.job_state(home, watch.job_id).get("attempts") or {}).get(str(watch.attempt), {})
        if settled.get("detail"):  # settled already (the watcher, or a probe): the same answer, counted once
            return protocol.EX_TEMPFAIL, settled["detail"]
        recs = sn.records(home, watch.job_id, watch.attempt)
        ran_on = sorted(recs)
        if ran_on:
            sn.note_attempt(home, watch.job_id, watch.attempt, nodes=ran_on)
        # srun's report outlives a failed node's DOWN state, which may end at once (ReturnToService=2)
        reported = sn.srun_node_failures(settled.get("log"), int(settled.get("log_from") or 0)) if ended else []
        failed = sn.lost(recs, sn.slurm_states(ran_on), ended=ended, answers=sn.slurmd_answers, srun_failed=reported)
        if not failed:
            if fallback[0] == 0:
                sn.record_success(home, ran_on)
            return fallback
        sn.exclude(home, watch.job_id, failed)
        drained = sn.record_failures(home, failed, watch.job_id)
        detail = "; ".join(failed.values())
        detail += f"; excluded from its next attempts (--exclude={','.join(sn.excluded(home, watch.job_id))})"
        if drained:
            detail += f"; drained {', '.join(drained)} (failed {sn.DRAIN_AFTER} times in a row)"
        detail = f"slurm job {watch.slurm_id}: {detail}; back in our queue"
        sn.note_attempt(home, watch.job_id, watch.attempt, failed=failed, detail=detail)
        return protocol.EX_TEMPFAIL, detail

    def _report(self, watch: _Watch, code: int, detail: str) -> None:
        failed = self._failed_nodes(watch) if watch.nodes > 1 else ()
        try:
            self._on_exit(Exit(watch.job_id, watch.attempt, code, detail, failed))
        except Exception:  # the service logs and recovers on its next reconcile
            log.exception("on_exit failed for job %s", watch.job_id)

    def _settle(self, watch: _Watch, row: Optional[sj.Row]) -> None:
        """Report how a watched attempt ended (a requeued one is cancelled in Slurm first)."""
        if row is not None and not row.terminal:  # Slurm requeued it: the queue gives it a new attempt
            sj.cancel(watch.slurm_id)  # first: it must not run again under this attempt
            code, detail = protocol.EX_TEMPFAIL, (f"slurm requeued job {watch.slurm_id} ({row.reason}); "
                                                  "back in our queue")
        else:
            code, detail = self._ending(watch.job_id, watch.attempt, watch.slurm_id, row, self.layout)
            if code is None:
                code = -signal.SIGKILL
        if watch.nodes > 1:
            code, detail = self._gang_failure(watch, ended=True, fallback=(code, detail))
        self._report(watch, code, detail)

    def _ending(self, job_id: int, attempt: int, slurm_id: str, row: Optional[sj.Row],
                layout: Layout) -> tuple[Optional[int], str]:
        """(exit code, detail) of an attempt whose Slurm job ended; code None when nothing tells."""
        if row is not None and row.restarts > 0:
            return protocol.EX_TEMPFAIL, f"slurm requeued job {slurm_id} ({row.reason}); back in our queue"
        state = row.state if row is not None else "purged"
        code = layout.read_exit(job_id, attempt)
        if code is not None:
            return code, f"exit code {code} (slurm job {slurm_id} {state.lower()})"
        if row is not None and row.state in sj.NOT_THE_JOBS_FAULT:
            return protocol.EX_TEMPFAIL, f"slurm job {slurm_id} {row.state.lower()} ({row.reason}); requeued"
        try:
            fields = sj.show(slurm_id) if slurm_id else {}  # (no id: `scontrol show job` would list them all)
        except sj.SlurmError:
            fields = {}
        shown = sj.exit_of_show(fields) if fields else None
        if row is not None and row.state == "CANCELLED":
            return -signal.SIGKILL, f"slurm job {slurm_id} cancelled; killed before it recorded an exit code"
        if shown is not None:
            return shown, f"exit code {shown} (slurm job {slurm_id} {state.lower()}, no exit record)"
        return None, f"slurm job {slurm_id} is gone without an exit record"

    # ---- internals --------------------------------------------------------------------------------------

    def _describe_target(self) -> str:
        return describe_target(self.partition, self.account, self.qos)

    def _slurm_id(self, job: Job) -> Optional[str]:
        return sj.parse_handle(job.proc_start)

    def _env(self, job: Job, env: dict[str, str], exit_file: Path) -> dict[str, str]:
        """sbatch's environment, which it exports to the job: the attempt's, without a surrounding job's
        SLURM_* variables (a service run inside an allocation) and, on GPUs, without our CUDA_VISIBLE_DEVICES
        (Slurm sets it for the GPUs it assigned on its node)."""
        out = {k: str(v) for k, v in env.items() if not k.startswith("SLURM_")}
        if not self.cpu_slots:
            out.pop(protocol.VISIBLE_DEVICES, None)
        out[sj.EXIT_VAR] = str(exit_file)
        return out
