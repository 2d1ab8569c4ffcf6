"""Contract 3, the job protocol: environment variables the executor sets and the runtime reads.

Kept import-light (no torch) so the orchestrator can use the names on hot paths.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

JOB_ID = "AUTORESEARCH_JOB_ID"
ATTEMPT = "AUTORESEARCH_ATTEMPT"
CHECKPOINT_DIR = "AUTORESEARCH_CHECKPOINT_DIR"
PARAMS = "AUTORESEARCH_PARAMS"
HOME = "AUTORESEARCH_HOME"
HEARTBEAT_FILE = "AUTORESEARCH_HEARTBEAT_FILE"
FAULTS = "AUTORESEARCH_FAULTS"
TRACKING_URI = "MLFLOW_TRACKING_URI"
RUN_ID = "MLFLOW_RUN_ID"
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
DEVICE_ORDER = "CUDA_DEVICE_ORDER"

# The variables the executor sets for every attempt: a job's own `--env` (or env file) may not name them, since
# the executor's value would silently win (FAULTS is a test hook inherited from the service, not set per job).
SET_BY_EXECUTOR = (JOB_ID, ATTEMPT, CHECKPOINT_DIR, PARAMS, HOME, HEARTBEAT_FILE, TRACKING_URI, RUN_ID,
                   VISIBLE_DEVICES, DEVICE_ORDER)

# A job exits with this code to be requeued without spending an attempt (e.g. it found a GPU fault).
EX_TEMPFAIL = 75


def home_dir() -> Path:
    """The autoresearch home as jobs see it: $AUTORESEARCH_HOME, else ~/.autoresearch (not created here).

    The runtime's own copy of the rule, so training jobs never import the service's settings."""
    return Path(os.environ.get(HOME) or Path.home() / ".autoresearch").expanduser()


# Written by the runtime (JobContext.complete) into the job's checkpoint dir when an attempt has done its last
# step: {"attempt": N, "at": UNIX time}. A job that ends while being preempted counts as SUCCEEDED only with
# this marker for its current attempt; anything else goes back in line (Contract 2).
COMPLETE_FILE = "autoresearch-complete.json"


def completed_attempt(checkpoint_dir: str | os.PathLike[str]) -> int | None:
    """The attempt that marked the job complete in `checkpoint_dir`, or None (absent or unreadable)."""
    try:
        with open(os.path.join(checkpoint_dir, COMPLETE_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    attempt = data.get("attempt") if isinstance(data, dict) else None
    return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None
