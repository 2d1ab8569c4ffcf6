"""A runtime job whose preemption arrives during its last step: it finishes that step within its grace, tells
the runtime it is complete, and exits 0. It must end SUCCEEDED and never run again."""

import time

from runtime.context import JobContext

with JobContext.from_env() as ctx:
    print(f"attempt {ctx.attempt} training", flush=True)
    while not ctx.should_stop():  # "training" until the preemption's SIGTERM arrives
        time.sleep(0.05)
    time.sleep(0.3)  # the last step, finished within the grace instead of checkpointing
    ctx.complete()
    print("last step done", flush=True)
