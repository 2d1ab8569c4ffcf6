"""The library API behind the CLI: submit, cancel, inspect. Tests and the agent call these directly.

Import-light on purpose (no torch, no mlflow): `autoresearch submit` runs through here.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Mapping, Optional

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.queue.policy import DEFAULT_PROJECT, UNPLACEABLE, unplaceable_reason
from orchestrator.queue.models import Job, JobEvent, JobSpec
from orchestrator.queue.inventory import SERVICE_STALE_AFTER
from orchestrator.queue.store import JobStore
from orchestrator.core.wakeup import notify



def open_store(settings: Optional[Settings] = None) -> JobStore:
    """The queue of these settings (default: this home's)."""
    return JobStore.from_settings(settings or Settings.load())


def live_services(store: JobStore) -> list:
    """Services whose heartbeat is fresh."""
    return store.hosts.services(max_age=SERVICE_STALE_AFTER)


def largest_capacity(services: list) -> int:
    """Devices of the largest of these services (0 when none is known or none reports devices)."""
    return max((len(s.devices or []) for s in services), default=0)


def experiment_spec(experiment: str, params: Mapping[str, Any], **options: Any) -> JobSpec:
    """A JobSpec running an experiment (a bundled name, a config file's path or remembered name) with validated
    params (SpaceError names a bad key; UnknownExperiment or config_file.ConfigError a bad experiment)."""
    from experiments import registry

    spec = registry.get(experiment)
    return job_spec(spec, spec.validate(dict(params)), **options)


def job_spec(spec: Any, params: Mapping[str, Any], **options: Any) -> JobSpec:
    """The JobSpec of one run of `spec` (an `ExperimentSpec`) with these (validated) params, for every face: the
    experiment decides the argv, the folder, the time limit and the image; options given explicitly win."""
    image = options.pop("image", None) or spec.image  # the environment the experiment names, unless --image
    fields = spec.job_fields(in_image=bool(image))
    for key in ("cwd", "time_limit"):
        if options.get(key) is not None:
            fields[key] = options.pop(key)
        options.pop(key, None)
    fields["image"] = image
    return JobSpec(params=dict(params), **fields, **options)


def submit(spec: JobSpec, settings: Optional[Settings] = None,
           store: Optional[JobStore] = None) -> tuple[Job, bool]:
    """Queue a job. Returns (job, whether a service is running to pick it up).

    A job asking for more devices than every live service has is refused (BadInput) when the live services'
    devices are known; with none known it is accepted, and the services say in its reason when it cannot
    be placed.
    """
    settings = settings or Settings.load()
    # The service may run elsewhere (another cwd, another host's view of the same paths): store it absolute.
    cwd = os.getcwd() if spec.cwd is None else os.path.abspath(os.path.expanduser(spec.cwd))
    if not os.path.isdir(cwd):
        raise BadInput(f"--workdir {spec.cwd}: not a directory")
    if cwd != spec.cwd:
        spec = replace(spec, cwd=cwd)
    if spec.image or spec.env_file or spec.mounts:
        from orchestrator.api.jobenv import prepare  # reads files and asks the container engine: only when asked

        spec = prepare(spec, settings.container_engine)
    store = store or JobStore.from_settings(settings)
    if spec.project != DEFAULT_PROJECT:  # the default project needs no look-up: submits stay one insert
        from orchestrator.api.sharing import resolve_project

        spec = replace(spec, project=resolve_project(spec.project, settings, store))
    if spec.deadline is not None and spec.deadline <= time.time():
        raise BadInput("--deadline is in the past")
    check_nodes(spec.nodes, settings, store)
    capacities = store.hosts.live_capacities(SERVICE_STALE_AFTER)
    largest = max(capacities, default=0)
    why = unplaceable_reason(spec.gpus * spec.nodes, largest) if largest else None
    if why:
        raise BadInput(f"--gpus {spec.gpus}: {why}")
    if spec.gpu_memory and capacities:
        check_gpu_memory(spec.gpu_memory, store)
    job = store.submit(spec)
    notify(settings.home)
    return job, bool(capacities)


MULTINODE_EXECUTORS = ("slurm",)


def check_nodes(nodes: int, settings: Settings, store: JobStore) -> None:
    """BadInput unless a job (or a session's trials) across `nodes` nodes can run here: the live services'
    executors decide; with none, the one this home's settings name."""
    if nodes > 1:
        executors = store.hosts.live_executors(SERVICE_STALE_AFTER) or [settings.executor]
        if not any(name in MULTINODE_EXECUTORS for name in executors):
            check_multinode(executors[0], nodes)


def check_multinode(executor: str, nodes: int) -> None:
    """BadInput (one line, naming the executor that can) when `executor` cannot run a job across `nodes` nodes:
    the local executor runs on this host only, and Ray places no multi-node gang yet."""
    if executor in MULTINODE_EXECUTORS:
        return
    why = "runs jobs on this host only" if executor == "local" else "does not place multi-node gangs yet"
    raise BadInput(f"--nodes {nodes}: the {executor} executor {why}; a job across nodes needs "
                   f"--executor {' or '.join(MULTINODE_EXECUTORS)} (serve --executor slurm)")


def check_gpu_memory(memory: int, store: JobStore) -> None:
    """BadInput when every GPU the services have sampled has less memory than `memory` (no GPU sampled yet, as
    on cpu slots: nothing is known, and the job is accepted)."""
    from orchestrator.core.gpushare import format_size
    from orchestrator.queue.gpuuse import GpuUse

    totals = [d.mem_total for d in GpuUse(store.db).devices() if d.mem_total]
    if totals and max(totals) < memory:
        raise BadInput(f"--gpu-memory {format_size(memory)}: no GPU here has that much (the largest has "
                       f"{format_size(max(totals))})")


def note_unplaceable(store: JobStore) -> None:
    """Keep the reason of queued jobs that no live service can place (more devices than the largest has) up to
    date: what `submit` refuses once the services' devices are known (the service's housekeeping calls it)."""
    largest = largest_capacity(live_services(store))
    if not largest:
        return  # no inventory known (a cluster still starting): say nothing rather than something wrong
    store.note({job.id: unplaceable_reason(job.gpus, largest) or "waiting: a live service can place it"
                for job in store.waiting_with(gpus_over=largest, reason_prefix=UNPLACEABLE)})


def cancel(job_id: int, settings: Optional[Settings] = None, store: Optional[JobStore] = None,
           reason: str = "cancelled by user") -> Job:
    """Cancel a job (BadInput when it already finished); `reason` is what its event log and `show` say."""
    settings = settings or Settings.load()
    store = store or JobStore.from_settings(settings)
    job = store.cancel(job_id, reason)
    notify(settings.home)
    return job


def show(job_id: int, store: JobStore) -> tuple[Job, list[JobEvent]]:
    """A job and its event log (JobNotFound: exit 2)."""
    return store.get(job_id), store.events(job_id)


def parse_params(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings to a dict (values stay strings; the experiment's space coerces them)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BadInput(f"bad --param {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out
