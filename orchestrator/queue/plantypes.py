"""What the scheduling policy (`orchestrator.queue.policy.plan`) plans with and returns: the waiting and running
jobs as it sees them, the projects sharing the devices, and the plan. Frozen, validated in `__post_init__`; the
`of` adapters are the one way the service and `top` turn queue rows into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from orchestrator.core.errors import BadInput
from orchestrator.queue.states import JobState


def is_preemptible(preemptible: Any, scavenger: Any) -> bool:
    """Whether a job may be preempted: as it asked, and a scavenger always (it runs on idle devices only, first
    to go). The one place the rule lives: the policy, the listing and submit checks all ask here."""
    return bool(preemptible) or bool(scavenger)


def check_preemptible(preemptible: Any, scavenger: Any) -> None:
    """BadInput for a job that asks to be a scavenger and never preempted (the two contradict)."""
    if scavenger and not preemptible:
        raise BadInput("--scavenger jobs are always preemptible: drop --no-preempt")

DEFAULT_PROJECT = "default"  # the project of a job submitted without one
_RELEASING = (JobState.PREEMPTING.value, JobState.CANCELLING.value)  # being stopped: devices free soon


def check_sharing(job_id: int, share: float, memory: Optional[int], single: bool) -> None:
    """ValueError unless `share` is in (0, 1], a share below 1 is of `single` device, and `memory` >= 0."""
    if not 0.0 < share <= 1.0:  # also refuses NaN
        raise ValueError(f"job {job_id}: share must be more than 0 and at most 1, got {share}")
    if share < 1.0 and not single:
        raise ValueError(f"job {job_id}: a job sharing a device (share {share}) has exactly one device")
    if memory is not None and memory < 0:
        raise ValueError(f"job {job_id}: GPU memory must be at least 0 bytes, got {memory}")


def share_of(job: Any) -> float:
    """A job's share of its device from its `gpu_share` (None, or a row without the column: the whole)."""
    share = getattr(job, "gpu_share", None)  # rows read before sharing existed have no such column
    return 1.0 if share is None else float(share)



@dataclass(frozen=True)
class Waiting:
    """A QUEUED job that may start now (its retry backoff, if any, has elapsed).

    ``submitted_at`` is the original submit time: a preempted job keeps its place in line. ``time_limit``
    (seconds) lets it backfill; ``deadline`` (a time) expires it; a ``scavenger`` uses only idle devices.
    ``share`` (below 1 only with ``gpus=1``) is its share of the one device it runs on beside others, and
    ``memory`` the GPU memory it asked for, in bytes (None: its share of the device's).
    """

    id: int
    priority: int
    submitted_at: float
    gpus: int
    project: str = DEFAULT_PROJECT
    scavenger: bool = False
    deadline: Optional[float] = None
    time_limit: Optional[float] = None
    preemptible: bool = True
    share: float = 1.0
    memory: Optional[int] = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"job {self.id}: gpus must be at least 1, got {self.gpus}")
        if self.share != 1.0 or self.memory is not None:
            check_sharing(self.id, self.share, self.memory, self.gpus == 1)

    @classmethod
    def of(cls, job: Any) -> "Waiting":
        """The policy's view of a QUEUED job (a `Job`, a listing row or a dispatch pass's light row): the one
        adapter the service and `top` both plan with."""
        return cls(job.id, job.priority, job.submitted_at, job.gpus, job.project or DEFAULT_PROJECT,
                   bool(job.scavenger), job.deadline, job.time_limit, bool(job.preemptible), share_of(job),
                   getattr(job, "gpu_memory", None))


@dataclass(frozen=True)
class Running:
    """A job holding devices: STARTING, RUNNING, PREEMPTING or CANCELLING.

    ``started_at`` is when the current attempt started. ``releasing`` marks a job already being
    stopped (PREEMPTING or CANCELLING): its devices free up soon and it cannot be preempted again.
    ``ends_at``: when its time limit stops it at the latest (None: unknown). ``share`` (below 1 only on one
    device) and ``memory`` (bytes asked for; None: its share of the device's): as in `Waiting`.
    """

    id: int
    priority: int
    devices: tuple[str, ...]
    started_at: float
    preemptible: bool
    releasing: bool = False
    project: str = DEFAULT_PROJECT
    scavenger: bool = False
    ends_at: Optional[float] = None
    share: float = 1.0
    memory: Optional[int] = None

    def __post_init__(self) -> None:
        if self.share != 1.0 or self.memory is not None:
            check_sharing(self.id, self.share, self.memory, len(set(self.devices)) <= 1)

    @classmethod
    def of(cls, job: Any, now: float) -> "Running":
        """The policy's view of a job holding devices (a `Job`, a listing row or a pass's `Held` row): the one
        adapter the service and `top` both plan with. A scavenger is always preemptible."""
        started = job.started_at or now
        return cls(job.id, job.priority, tuple(job.devices or ()), started,
                   is_preemptible(job.preemptible, job.scavenger), job.state in _RELEASING,
                   job.project or DEFAULT_PROJECT, bool(job.scavenger),
                   started + job.time_limit if job.time_limit else None, share_of(job),
                   getattr(job, "gpu_memory", None))


@dataclass(frozen=True)
class Project:
    """A project sharing the devices: its weight in fair sharing, its guaranteed devices, its borrowing cap,
    its decayed usage (device-seconds) and the devices its jobs hold on other hosts of a shared queue (shares
    of devices count as fractions)."""

    name: str
    share: float = 1.0
    quota: int = 0
    borrow_limit: Optional[int] = None
    usage: float = 0.0
    held_elsewhere: float = 0

    def __post_init__(self) -> None:
        if not self.share > 0:
            raise ValueError(f"project {self.name}: share must be more than 0, got {self.share}")
        if self.quota < 0 or (self.borrow_limit is not None and self.borrow_limit < 0):
            raise ValueError(f"project {self.name}: quota and borrow limit must be at least 0")


@dataclass(frozen=True)
class Plan:
    """What to do now: jobs to start, as (job id, devices) in start order, running jobs to preempt, with the
    waiting job each is preempted for (`preempt_for`: (victim id, job id), in `preempt` order), and waiting
    jobs that can no longer meet their deadline."""

    starts: tuple[tuple[int, tuple[str, ...]], ...] = ()
    preempt: tuple[int, ...] = ()
    expired: tuple[int, ...] = ()
    # Explanations of `preempt`, so not part of a plan's identity: per victim, why ("priority", "reclaim": its
    # project borrows, or "scavenger"), and which waiting job it yields to.
    why: tuple[str, ...] = field(default=(), compare=False)
    preempt_for: tuple[tuple[int, int], ...] = field(default=(), compare=False)
