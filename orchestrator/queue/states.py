"""Job states and the transitions allowed between them.

    QUEUED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    RUNNING -> PREEMPTING -> QUEUED          (back in line, same priority and submit time, preemptions += 1)
    RUNNING -> CANCELLING -> CANCELLED
    FAILED (attempts left) -> QUEUED         (after a backoff)

Extensions (the contract may only be extended): STARTING can fail, be cancelled or go back to QUEUED
(preflight found a bad device; spawn failed with a temporary error) or enter CANCELLING (cancelled while
its process is being spawned); RUNNING -> QUEUED when the job exits
75 (EX_TEMPFAIL) or its host was lost; a job being preempted goes back in line whatever its exit code, unless it
told the runtime that this attempt did its last step (PREEMPTING -> SUCCEEDED; runtime.protocol.COMPLETE_FILE),
or is cancelled (PREEMPTING -> CANCELLING); a QUEUED job can be cancelled;
a job stopped for running past its time limit goes RUNNING -> CANCELLING -> FAILED ("time limit exceeded").
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """The life-cycle state of a job."""

    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    PREEMPTING = "PREEMPTING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def __str__(self) -> str:
        return self.value

    @property
    def finished(self) -> bool:
        """SUCCEEDED, CANCELLED and FAILED are finished states; a FAILED job may still be retried, so whether
        a job is final is the job's rule (`Job.final`, `Job.retrying`), not the state's."""
        return self in FINISHED


S = JobState
ALLOWED: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.STARTING, S.CANCELLED}),
    S.STARTING: frozenset({S.RUNNING, S.QUEUED, S.FAILED, S.CANCELLED, S.CANCELLING}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.PREEMPTING, S.CANCELLING, S.QUEUED}),
    S.PREEMPTING: frozenset({S.QUEUED, S.SUCCEEDED, S.FAILED, S.CANCELLING}),
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset({S.QUEUED}),  # only while attempts are left (Job.retrying)
}
HOLDING = frozenset({S.STARTING, S.RUNNING, S.PREEMPTING, S.CANCELLING})
FINISHED = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
ACTIVE = frozenset(set(JobState) - FINISHED)


TIME_LIMIT = "time limit exceeded"  # the reason text of a job stopped at its time limit (for people)
# How the reason of a job requeued to run alone after running out of GPU memory on a shared GPU starts (the
# agent does not count such a requeue as a failed trial).
OUT_OF_SHARED_MEMORY = "out of GPU memory on a shared GPU"


class StopCause(str, Enum):
    """Why the service stopped a job, kept as data on the job (`Job.stop_cause`) so no rule reads reason text."""

    TIME_LIMIT = "time_limit"


def allowed(src: JobState, dst: JobState) -> bool:
    """Whether the job states allow `src -> dst` (the retry rule on FAILED is the job's: `Job.retrying`)."""
    return dst in ALLOWED[src]
