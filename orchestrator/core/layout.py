"""Where a job's files live: the one place that knows the paths under a home.

```
HOME/logs/ID.log                 the job's output, every attempt appended (`autoresearch logs`)
HOME/checkpoints/ID/             the job's checkpoint dir, the same for every attempt (the job protocol)
HOME/checkpoints/ID/autoresearch-complete.json   written by the job's runtime when an attempt did its last step
                                 (runtime.protocol.COMPLETE_FILE; read by the store when a preempted job ends)
HOME/run/ID.ATTEMPT.exit         the exit code the attempt's wrapper recorded (read after a restart)
HOME/run/ID.heartbeat            the job's progress heartbeat (the hang watchdog reads it)
HOME/forks/KEY/step_N/           the checkpoint a population-based-training trial starts from (a copy of its
                                 parent's, made once, under the trial's idempotency key)
```
The service, the executors, the reaper and the health monitor all ask a `Layout` instead of joining paths.
A reaper settling another host's jobs builds the `Layout` of that host's home.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Layout:
    """The file layout of one home."""

    home: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home))

    @property
    def logs_dir(self) -> Path:
        """Every job's log file."""
        return self.home / "logs"

    @property
    def checkpoints_dir(self) -> Path:
        """Every job's checkpoint dir (put it on a shared filesystem to resume on another host)."""
        return self.home / "checkpoints"

    @property
    def run_dir(self) -> Path:
        """Per-attempt bookkeeping: exit records and heartbeats."""
        return self.home / "run"

    def ensure(self) -> "Layout":
        """Create the directories (idempotent)."""
        for path in (self.logs_dir, self.checkpoints_dir, self.run_dir):
            path.mkdir(parents=True, exist_ok=True)
        return self

    def log_path(self, job_id: int) -> Path:
        """The job's output file."""
        return self.logs_dir / f"{job_id}.log"

    def checkpoint_dir(self, job_id: int) -> Path:
        """The job's checkpoint dir (the same for every attempt)."""
        return self.checkpoints_dir / str(job_id)

    def fork_dir(self, key: str) -> Path:
        """The copy of a parent's checkpoint a forked trial (idempotency key `key`) starts from."""
        return self.home / "forks" / key.replace(":", "-").replace("/", "-")

    def heartbeat_file(self, job_id: int) -> Path:
        """The job's progress heartbeat."""
        return self.run_dir / f"{job_id}.heartbeat"

    def exit_file(self, job_id: int, attempt: int) -> Path:
        """The exit code recorded by the wrapper of one attempt."""
        return self.run_dir / f"{job_id}.{attempt}.exit"

    def attempt_of(self, exit_file: Path) -> Optional[tuple[int, int]]:
        """(job id, attempt) of an exit-file path of this home; None for any other path."""
        exit_file = Path(exit_file)
        if exit_file.parent != self.run_dir or exit_file.suffix != ".exit":
            return None
        try:
            job_id, attempt = (int(x) for x in exit_file.stem.split("."))
        except ValueError:
            return None
        return job_id, attempt

    def read_exit(self, job_id: int, attempt: int) -> Optional[int]:
        """The recorded exit code of an attempt, None when it has none (still running, or killed)."""
        try:
            return int(self.exit_file(job_id, attempt).read_text().strip())
        except (OSError, ValueError):
            return None


def node_name(home: Path, explicit: Optional[str] = None) -> str:
    """This service's identity in a shared queue: `explicit` (the `node` setting), else the host name plus the
    home, so homes on one host differ."""
    if explicit:
        return explicit
    digest = hashlib.sha1(str(Path(home).resolve()).encode()).hexdigest()[:6]
    return f"{socket.gethostname()}-{digest}"
