"""Contract 3, the job protocol: environment variables the executor sets and the runtime reads.

Kept import-light (no torch) so the orchestrator can use the names on hot paths.
"""

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

# A job exits with this code to be requeued without spending an attempt (e.g. it found a GPU fault).
EX_TEMPFAIL = 75
