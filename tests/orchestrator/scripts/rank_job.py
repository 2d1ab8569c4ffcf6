"""A rank for the process-tree tests (no torch import: it starts fast). It records its pid, start time and
environment in OUT/ATTEMPT.RANK.json, then behaves as MODE says:
- stubborn: ignores SIGTERM and sleeps (only SIGKILL ends it);
- tempfail: rank 1 exits 75 on attempt 1 (asking to be requeued); everything else exits 0.
"""

import json
import os
import signal
import sys
import time

import psutil

mode, out = sys.argv[1], sys.argv[2]
rank, attempt = os.environ.get("RANK", "0"), os.environ["AUTORESEARCH_ATTEMPT"]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
record = {"pid": os.getpid(), "start": psutil.Process().create_time(), "env": sorted(os.environ)}
tmp = os.path.join(out, f".{attempt}.{rank}.tmp")
with open(tmp, "w") as fh:
    json.dump(record, fh)
os.replace(tmp, os.path.join(out, f"{attempt}.{rank}.json"))
if mode == "stubborn":
    time.sleep(600)
elif mode == "tempfail" and attempt == "1" and rank == "1":
    sys.exit(75)
