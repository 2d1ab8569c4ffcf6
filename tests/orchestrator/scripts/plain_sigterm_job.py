"""A training script with the most common SIGTERM handler there is: save, then `sys.exit(0)`. It knows nothing
of the runtime. Counts `steps` steps of 50 ms; a later attempt resumes from the saved step."""

import json
import os
import signal
import sys
import time

steps = int(sys.argv[1])
marker = os.path.join(os.environ["AUTORESEARCH_CHECKPOINT_DIR"], "plain.json")
os.makedirs(os.path.dirname(marker), exist_ok=True)
step = json.load(open(marker))["step"] if os.path.exists(marker) else 0


def save_and_exit(*_):
    with open(marker + ".tmp", "w") as fh:
        json.dump({"step": step}, fh)
    os.replace(marker + ".tmp", marker)
    print(f"saved at step {step}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, save_and_exit)
print(f"attempt {os.environ['AUTORESEARCH_ATTEMPT']} starts at step {step}", flush=True)
while step < steps:
    time.sleep(0.05)
    step += 1
    if step % 10 == 0:
        print(f"trained {step} steps", flush=True)
print("done", flush=True)
