"""A stand-in training job for the faces tests: three steps, each printed, logged to MLflow and heartbeated."""

import sys

from runtime.context import JobContext

with JobContext.from_env() as ctx:
    for step in range(3):
        loss = 1.0 / (step + 1)
        print(f"step {step} loss {loss:.4f}", flush=True)
        ctx.log_metrics({"loss": loss}, step=step)
        ctx.heartbeat(step, force=True)
    print("argv tail:", sys.argv[1:], flush=True)
