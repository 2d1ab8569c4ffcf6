"""A stand-in training job for queue tests: counts `steps` steps of 50 ms, and on SIGTERM saves its step to a
marker in the checkpoint dir and exits; a later attempt resumes from the marker. Prints what it did."""

import json
import os
import signal
import sys
import time

steps = int(sys.argv[1])
ckpt_dir = os.environ["AUTORESEARCH_CHECKPOINT_DIR"]
marker = os.path.join(ckpt_dir, "marker.json")
stop = False


def on_term(*_):
    global stop
    stop = True


signal.signal(signal.SIGTERM, on_term)
step = json.load(open(marker))["step"] if os.path.exists(marker) else 0
print(f"attempt {os.environ['AUTORESEARCH_ATTEMPT']} starts at step {step} "
      f"run={os.environ.get('MLFLOW_RUN_ID', '')} cuda={os.environ.get('CUDA_VISIBLE_DEVICES')!r}", flush=True)
while step < steps:
    if stop:
        with open(marker + ".tmp", "w") as fh:
            json.dump({"step": step}, fh)
        os.replace(marker + ".tmp", marker)
        print(f"checkpointed at step {step}", flush=True)
        sys.exit(143)
    time.sleep(0.05)
    step += 1
print("done", flush=True)
