"""`autoresearch logs` for a job that ran on Ray, read from the cluster (for hosts without its log file)."""

from __future__ import annotations

import asyncio
from typing import IO

from orchestrator.core.errors import BadInput
from orchestrator.executors.ray.jobs import client_for, parse_handle, submission_id
from orchestrator.queue.models import Job


def stream_logs(job: Job, out: IO[bytes], *, follow: bool = False) -> None:
    """Print every attempt's Ray log of `job` to `out` (for `autoresearch logs` where its log file is absent)."""
    handle = parse_handle(job.proc_start)
    if handle is None:
        raise BadInput(f"job {job.id} did not run on Ray")
    client = client_for(handle[1])
    for attempt in range(1, job.attempts + 1):
        sid = submission_id(job, attempt)
        if attempt < job.attempts or not follow:
            try:
                out.write(client.get_job_logs(sid).encode())
            except RuntimeError:
                continue  # an attempt that never reached Ray
            continue

        async def tail() -> None:
            async for chunk in client.tail_job_logs(sid):
                out.write(chunk.encode())
                out.flush()

        asyncio.run(tail())
    out.flush()
