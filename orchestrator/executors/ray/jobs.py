"""Ray jobs as the queue knows them: an attempt's submission id, the handle recorded in the job's `proc_start`
(`ray:SID@ADDRESS`), a client for the cluster's Jobs API, and the exit code a finished Ray job earns.

Exit codes. Ray reports SUCCEEDED/FAILED with the entrypoint's exit code, but a stopped job (cancel,
preemption) has none. The entrypoint runs under the local executor's kind of `/bin/sh` wrapper, which
survives the stop's SIGTERM and prints the job's exit code as the last line of its output; a stopped job's code
is read back from there (none: killed after the grace, reported as SIGKILL). A job's own exit 75 thus still
means "requeue me". Ray-side failures map to codes the queue understands: a lost node or a start timeout to
75 (requeue without spending an attempt), a job that could not be started at all to 127.
"""

from __future__ import annotations

import hashlib
import re
import signal
from typing import Any, Optional

from orchestrator.core.errors import BadInput
from orchestrator.queue.models import Job
from runtime import protocol

PREFIX = "ray:"
# Like the local wrapper: `trap :` keeps the shell alive through the stop's SIGTERM so it can print the code.
# The job runs in the submit directory when that exists on the node Ray picked, else where Ray starts it.
WRAPPER = ('cd -- "$1" 2>/dev/null; shift; trap : TERM INT; "$@"; rc=$?; '
           'printf "\\n=== autoresearch: exit code %s\\n" "$rc"; exit $rc')
EXIT_LINE = re.compile(r"=== autoresearch: exit code (-?\d+)")  # what WRAPPER prints last
# Ray could not run the attempt for reasons outside the job: requeue it without spending an attempt.
REQUEUE_ERRORS = {"JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
                  "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE"}


def submission_id(job: Job, attempt: Optional[int] = None) -> str:
    """The Ray submission id of an attempt: derived from the job alone (no extra column), unique across
    queues sharing one cluster thanks to a tag of the job's id and submit time."""
    tag = hashlib.sha1(f"{job.id}:{job.submitted_at!r}".encode()).hexdigest()[:8]
    return f"autoresearch-{job.id}-{job.attempts if attempt is None else attempt}-{tag}"


def parse_handle(proc_start: Optional[str]) -> Optional[tuple[str, str]]:
    """(submission id, dashboard address) from a job's `proc_start` (`ray:SID@ADDRESS`), None if not Ray's."""
    if not proc_start or not proc_start.startswith(PREFIX):
        return None
    sid, _, address = proc_start[len(PREFIX):].partition("@")
    return sid, address


def normalize_address(address: str) -> str:
    """The Ray dashboard URL (the Jobs API endpoint): `HOST:8265` gets `http://`."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


def client_for(address: str):
    """A JobSubmissionClient, with clear one-line errors for a missing extra or an unreachable cluster."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise BadInput("--executor ray needs Ray: pip install 'autoresearch[ray]'") from None
    try:
        return JobSubmissionClient(address)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise BadInput(f"cannot reach the Ray cluster at {address} (the dashboard address, e.g. "
                       f"http://HEAD:8265): {first}") from None


def exit_of(info: Any, log_text: str = "") -> tuple[int, str]:
    """The queue's exit code and a detail for a finished Ray job (`JobInfo`), see the module docstring."""
    status = str(getattr(info.status, "value", info.status))
    if info.driver_exit_code is not None:
        code = int(info.driver_exit_code)
        return code, f"exit code {code} (ray {status.lower()})"
    found = EXIT_LINE.findall(log_text[-4096:])
    if found:
        return int(found[-1]), f"exit code {found[-1]} (ray {status.lower()})"
    if status == "STOPPED":
        return -signal.SIGKILL, "stopped by ray; killed after the grace period"
    if status == "SUCCEEDED":
        return 0, "exit code 0 (ray succeeded)"
    error = str(getattr(info.error_type, "value", info.error_type) or "")
    message = (info.message or "").strip().splitlines()[:1]
    detail = f"ray {status.lower()} ({error or 'no exit code'}): {message[0] if message else ''}".strip()
    if error in REQUEUE_ERRORS:
        return protocol.EX_TEMPFAIL, detail
    return 127, detail
