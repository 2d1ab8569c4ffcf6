"""The job protocol: environment variables the executor sets and the runtime reads.

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
# A job sharing a GPU (`submit --gpus 0.25`): its share of the device (a float 1/k) and, when it asked for one,
# its GPU memory limit in bytes. The runtime caps the process's CUDA memory to these (`JobContext`).
GPU_SHARE = "AUTORESEARCH_GPU_SHARE"
GPU_MEMORY = "AUTORESEARCH_GPU_MEMORY"

# The thread pools a job's libraries size from the environment when they load (OpenMP, and so torch's intra-op
# threads; MKL): the executor gives a job its share of the host's cores in these, unless the job or the service
# sets OMP_NUM_THREADS itself. A job forked warm applies them with torch.set_num_threads.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# The variables the executor sets for every attempt: a job's own `--env` (or env file) may not name them, since
# the executor's value would silently win (FAULTS is a test hook inherited from the service, not set per job).
SET_BY_EXECUTOR = (JOB_ID, ATTEMPT, CHECKPOINT_DIR, PARAMS, HOME, HEARTBEAT_FILE, TRACKING_URI, RUN_ID,
                   VISIBLE_DEVICES, DEVICE_ORDER, GPU_SHARE, GPU_MEMORY)

# A job exits with this code to be requeued without spending an attempt (e.g. it found a GPU fault).
EX_TEMPFAIL = 75

# MLflow metric names of a job's GPU use, in MLflow's `system/gpu_*` style: the job's own peak CUDA memory (the
# runtime logs it from rank 0 when the attempt ends), the device's total memory, and the device's mean
# utilisation while the job held it (the service logs it, from NVML). Agent sessions read them to pack trials.
PEAK_MEMORY_METRIC = "system/gpu_peak_memory_megabytes"
DEVICE_MEMORY_METRIC = "system/gpu_memory_total_megabytes"
UTILIZATION_METRIC = "system/gpu_utilization_percentage"


def home_dir() -> Path:
    """The autoresearch home as jobs see it: $AUTORESEARCH_HOME, else ~/.autoresearch (not created here).

    The runtime's own copy of the rule, so training jobs never import the service's settings."""
    return Path(os.environ.get(HOME) or Path.home() / ".autoresearch").expanduser()


# Written by the runtime (JobContext.complete) into the job's checkpoint dir when an attempt has done its last
# step: {"attempt": N, "at": UNIX time}. A job that ends while being preempted counts as SUCCEEDED only with
# this marker for its current attempt; anything else goes back in line (the job states).
COMPLETE_FILE = "autoresearch-complete.json"


# Written by the runtime into the job's checkpoint dir when an attempt on a shared GPU ran out of CUDA memory
# (then it exits EX_TEMPFAIL): {"attempt": N, "at": UNIX time, "error": "..."}. The service requeues such a job to
# run alone on a whole device, without spending an attempt.
OOM_FILE = "autoresearch-oom.json"


def oom_attempt(checkpoint_dir: str | os.PathLike[str]) -> int | None:
    """The attempt that ran out of GPU memory while sharing a device, per `OOM_FILE` in `checkpoint_dir`, or
    None (absent or unreadable)."""
    return _attempt_in(os.path.join(checkpoint_dir, OOM_FILE))


def completed_attempt(checkpoint_dir: str | os.PathLike[str]) -> int | None:
    """The attempt that marked the job complete in `checkpoint_dir`, or None (absent or unreadable)."""
    return _attempt_in(os.path.join(checkpoint_dir, COMPLETE_FILE))


def _attempt_in(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    attempt = data.get("attempt") if isinstance(data, dict) else None
    return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None
