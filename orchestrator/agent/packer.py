"""Packing a session's trials onto its GPUs (`start --trials-per-gpu auto|N`): the I/O around `packing`.

A collaborator of `orchestrator.agent.graph.Agent`, handed the agent as its `host` (what it reads and calls there
is declared by `Host`). It keeps k (trials per device) in the checkpointed state under `packing`, so a resumed
session continues with the k it had:

- `N` (an integer): k = N from the first trial on, whatever the devices (on `cpu:N` slots too: the CPU tests
  pack that way). `auto` on cpu slots: k = 1 (there is no GPU to measure).
- `auto` on GPUs: the baseline runs alone (k = 1); once every baseline run has ended, their MLflow runs'
  `system/gpu_*` metrics give the first k (`packing.initial_k`), then each round of k finished trials gives
  its trials per hour to the `packing.Controller`, which raises k while that pays and steps back when it
  does not, or when a packed trial ran out of GPU memory (the service requeued it; it stays one trial, in
  flight, never a failure).

Trials ask for `packing.gpus_for(k)` of a device; the session keeps k x devices in flight (an explicit
--parallel wins). Every decision is an event ("packing: k 2 -> 4 (trials/hour 41 -> 77, +88%); trying 4"),
a line in the state's log, the `trials_per_gpu` metric and the `autoresearch.packing` tag of the session run.
The trials' budget (steps, seeds) never depends on k: packing changes where a trial runs, not what it computes.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Protocol

from runtime.protocol import DEVICE_MEMORY_METRIC, PEAK_MEMORY_METRIC, UTILIZATION_METRIC
from orchestrator.queue.gpuuse import GpuUse
from orchestrator.agent import packing
from orchestrator.agent.history import held_intervals
from orchestrator.agent.packing import AUTO, Controller, Measurement
from orchestrator.agent.trial import Phase, State, Trial, TrialStatus, load
from orchestrator.core.devices import is_cpu_slot

S, P = TrialStatus, Phase
SYSTEM_METRICS = (PEAK_MEMORY_METRIC, DEVICE_MEMORY_METRIC, UTILIZATION_METRIC)
IN_FLIGHT = (S.QUEUED, S.RUNNING)


def session_devices(service: Any, store: Any) -> list[str]:
    """The device names a session's trials may use: its embedded service's, else every live service's."""
    if service is not None:
        return list(service.device_names)
    from orchestrator.api.jobs import live_services

    return [d for s in live_services(store) for d in (s.devices or [])]


def summary(state: dict) -> dict[str, Any] | None:
    """What a session's summary says of its packing: the mode, the final k and every decision's line."""
    pack = state.get("packing")
    if not pack:
        return None
    return {"mode": pack["mode"], "trials_per_gpu": pack["k"], "decisions": list(pack.get("log", []))}


class Host(Protocol):
    """What packing needs of the agent it serves (`orchestrator.agent.graph.Agent`)."""

    cfg: Any  # SessionConfig: parallel, trials_per_gpu
    store: Any  # JobStore: the trials' jobs and their events, the devices' samples
    tracker: Any  # Tracker: the baseline runs' system metrics, the session run's metric and tag

    def _event(self, kind: str, state: State, **data: Any) -> None: ...


class Packer:
    """k, the in-flight count that follows from it, and the node wrapper that decides it; see the module doc."""

    def __init__(self, host: Host, parallel: int, devices: list[str] | None, target_busy: float = 0.8) -> None:
        """`parallel`: trials in flight at k = 1 (--parallel, else the device count); `devices`: the session's
        device names (None: unknown, and then nothing is packed unless --trials-per-gpu N says so)."""
        self.host = host
        self._base_parallel = parallel
        self.devices = list(devices or [])
        self.n_devices = len(self.devices) or parallel
        self.target_busy = target_busy
        wanted = packing.parse(getattr(self.host.cfg, "trials_per_gpu", AUTO))
        self.k = 1 if wanted == AUTO else wanted
        self.nodes = int(getattr(self.host.cfg, "nodes", 1) or 1)
        self.per_node = int(getattr(self.host.cfg, "gpus", 1) or 1)  # whole devices a trial holds on each node
        self.pack: dict[str, Any] = {}

    @property
    def whole(self) -> int:
        """Devices one trial holds in all when it asks for more than one (--gpus G, --nodes N); 1 otherwise."""
        return self.per_node * self.nodes

    @property
    def parallel(self) -> int:
        """Trials in flight: --parallel when given, else k x devices (a trial of G devices on N nodes holds G x N)."""
        if self.whole > 1:
            return self.host.cfg.parallel or max(1, max(self._base_parallel, self.n_devices) // self.whole)
        return self.host.cfg.parallel or max(self._base_parallel, self.k * self.n_devices)

    @property
    def capacity(self) -> int:
        # One proposal more than there are places waits in the queue: a freed place starts the next trial at
        # once (no round trip through the agent), and a demoted trial (lower priority) never slips into it.
        # Not while the baseline decides k: that trial would ask for a whole device, and the shares proposed
        # once k is known could not join it there until it ended (seen on an H200).
        if self.pack.get("mode") == AUTO and not self.pack.get("decided"):
            return self.parallel
        return self.parallel + 1

    def gpus(self) -> float | int:
        """What a trial submitted now asks for (on each of its nodes)."""
        return self.per_node if self.whole > 1 else packing.gpus_for(self.k)

    # -- the node wrapper ------------------------------------------------------------------------------------------

    def packed(self, name: str, node: Callable[[State], State]) -> Callable[[State], State]:
        """`node` with k restored from the state first (a resumed session), and after `analyse`, k decided anew;
        each decision is an event and goes into the state with the node's output."""

        def run(state: State) -> State:
            lines = self._sync(state)
            out = node(state)
            if name == "analyse":
                lines += self._decide_k(state, out)
            if lines:
                merged = {**state, **out}
                for line in lines:
                    self.host._event("packing", merged, message=f"packing: {line}", k=self.k)
            return {**out, "packing": dict(self.pack)} if lines or "packing" not in state else out

        run.__name__ = name
        return run

    def _sync(self, state: State) -> list[str]:
        """Load k from the state; a session's first node sets the packing up (and says how)."""
        if state.get("packing"):
            self.pack = dict(state["packing"])
            self.k = int(self.pack["k"])
            return []
        wanted = packing.parse(getattr(self.host.cfg, "trials_per_gpu", AUTO))
        if self.whole > 1:
            where = f" on each of {self.nodes} nodes" if self.nodes > 1 else ""
            mode, why = "whole", f"k=1 (each trial holds {self.per_node} whole device(s){where})"
        elif wanted != AUTO:
            mode, why = "fixed", f"k={wanted} (--trials-per-gpu {wanted}): each trial asks for 1/{wanted} of a device"
        elif not self.devices:
            mode, why = "off", "k=1 (the session's devices are unknown)"
        elif all(is_cpu_slot(d) for d in self.devices):
            mode, why = "cpu", "k=1 (cpu slots: auto runs one trial per slot; --trials-per-gpu N packs N)"
        else:
            mode, why = AUTO, "k=1 while the baseline runs alone; its GPU use then decides k"
        self.k = 1 if wanted == AUTO or self.whole > 1 else wanted
        self.pack = {"mode": mode, "k": self.k, "decided": mode != AUTO, "controller": None,
                     "round_from": 0, "steps": [[0, self.k]], "log": [why], "oom_jobs": []}
        return [why] if mode != "off" else []

    # -- deciding k ------------------------------------------------------------------------------------------------

    def _decide_k(self, state: State, out: State) -> list[str]:
        if self.pack.get("mode") != AUTO:
            return []
        trials = load(out.get("trials", state.get("trials", [])))
        if not self.pack["decided"]:
            line = self._first_k(trials)
            lines = [line] if line else []
        else:
            lines = self._oom_check(trials) + self._round(trials)
        if lines and state.get("parent_run"):
            try:
                self.host.tracker.log_metrics(state["parent_run"], {"trials_per_gpu": self.k}, step=len(trials))
                self.host.tracker.set_tags(state["parent_run"], {"autoresearch.packing": lines[-1]})
            except Exception:  # a record for people: not worth failing the session over
                pass
        return lines

    def _first_k(self, trials: list[Trial]) -> str | None:
        """Once every baseline run has ended: k from their measurements (k = 1 when one is missing)."""
        base = [t for t in trials if t.phase is P.BASELINE]
        if not base or any(t.status not in (S.SUCCEEDED, S.FAILED, S.STOPPED, S.CANCELLED) for t in base):
            return None
        done = [t for t in base if t.status is S.SUCCEEDED and t.run_id]
        decision = packing.initial_k([self._measure(t) for t in done], target_busy=self.target_busy)
        fit = min(decision.fit or 1, self._parallel_cap())
        alone = packing.trials_per_hour([self._held_s(t) for t in done], min(self.n_devices, self._base_parallel))
        k = min(decision.k, fit)
        ctl = Controller(k=k, fit=fit, prev_k=1 if alone and k > 1 else None, prev_tph=alone if k > 1 else None,
                         held=k == 1)
        self.pack["decided"] = True
        self.pack["controller"] = ctl.to_dict()
        self._set_k(k, trials, decision.evidence)
        return decision.evidence

    def _oom_check(self, trials: list[Trial]) -> list[str]:
        """A packed trial in flight whose job the service requeued after it ran out of GPU memory: step back.
        The trial itself stays what it is (queued or running again, alone): never counted as failed."""
        if self.k <= 1 and not any(k > 1 for _, k in self.pack["steps"]):
            return []
        ctl, seen, lines = Controller.from_dict(self.pack["controller"]), set(self.pack["oom_jobs"]), []
        for t in trials:
            if t.status not in IN_FLIGHT or t.ended or t.job_id is None or t.job_id in seen:
                continue
            k_at = self._k_of(t.n)
            if k_at <= 1 or not any(packing.is_oom(ev.reason) for ev in self.host.store.events(t.job_id)):
                continue
            seen.add(t.job_id)
            decision = ctl.oom(k_at, f"trial {t.n} (job {t.job_id})")
            if decision is not None:
                self._set_k(decision.k, trials, decision.evidence)
                lines.append(decision.evidence)
        self.pack["oom_jobs"] = sorted(seen)
        self.pack["controller"] = ctl.to_dict()
        return lines

    def _round(self, trials: list[Trial]) -> list[str]:
        """A round at k: the first k trials submitted at k that succeeded (at least 2, at most what is in
        flight). Their median time held gives the trials per hour of k of them side by side on each device."""
        ctl = Controller.from_dict(self.pack["controller"])
        if ctl.held:
            return []
        in_flight = min(self.k * self.n_devices, self.parallel)
        need = min(in_flight, max(2, self.k))
        done = sorted((t for t in trials if t.n >= self.pack["round_from"] and t.status is S.SUCCEEDED
                       and self._k_of(t.n) == self.k and t.finished_at), key=lambda t: t.finished_at)
        if len(done) < need:
            return []
        tph = packing.trials_per_hour([self._held_s(t) for t in done[:need]], in_flight)
        decision = ctl.observe(tph) if tph else None
        self.pack["controller"] = ctl.to_dict()
        if decision is None:
            return []
        self._set_k(decision.k, trials, decision.evidence)
        return [decision.evidence]

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _set_k(self, k: int, trials: list[Trial], why: str) -> None:
        if k != self.pack["k"]:
            self.pack["steps"] = [*self.pack["steps"], [len(trials), k]]
        self.k = self.pack["k"] = k
        self.pack["round_from"] = len(trials)
        self.pack["log"] = [*self.pack["log"], why]

    def _k_of(self, n: int) -> int:
        """The k trial `n` was submitted at (the last step recorded at or before it)."""
        k = 1
        for first, step_k in self.pack["steps"]:
            if first <= n:
                k = step_k
        return k

    def _parallel_cap(self) -> int:
        """The most k that --parallel leaves room for (16 without it)."""
        if not self.host.cfg.parallel:
            return packing.K_MAX
        return max(1, math.ceil(self.host.cfg.parallel / max(1, self.n_devices)))

    def _measure(self, t: Trial) -> Measurement:
        """A baseline run's use: its peak and its device's memory as the runtime logged them, and the device's
        busy share while it ran, from the service's samples in the queue (on its MLflow run too, but only some
        seconds after the job ended: the session decides at once)."""
        got = self.host.tracker.system_metrics(t.run_id, SYSTEM_METRICS)
        busy, peak, total = got.get(UTILIZATION_METRIC), got.get(PEAK_MEMORY_METRIC), got.get(DEVICE_MEMORY_METRIC)
        if t.job_id is not None and None in (busy, peak, total):
            # A script without the runtime logs no memory figures: the samples of its device (it ran alone there,
            # so the device's peak use is its own) say the same.
            gpus = GpuUse(self.host.store.db)
            use = gpus.jobs([t.job_id]).get(t.job_id)
            if use is not None and use.held_seconds > 0:
                busy = 100.0 * use.busy_seconds / use.held_seconds if busy is None else busy
                peak = use.peak_memory / 1e6 if peak is None and use.peak_memory else peak
            if total is None:
                job = self.host.store.get(t.job_id)
                totals = [d.mem_total for d in gpus.devices(job.host) if d.device in (job.devices or ())]
                total = max(totals) / 1e6 if totals and max(totals) else None
        return Measurement(peak_memory_mb=peak, device_memory_mb=total, busy_pct=busy)

    def _held_s(self, t: Trial) -> float:
        """Seconds the trial's job held its device (every attempt; 0 while it is unknown)."""
        if t.job_id is None:
            return 0.0
        return sum(end - start for start, end in held_intervals(self.host.store, self.host.store.get(t.job_id))
                   if end is not None)
