"""A hand job for the soak: `python -m benchmarks.chaos.handjob RECORDS QUEUE STEPS`.

A checkpointing training stand-in on the runtime's real parts (JobContext, CheckpointManager with DCP): `STEPS`
steps of 0.2 s over a small state whose every value equals the step, a synchronous checkpoint every 5 steps and
on SIGTERM, and the final step logged to MLflow as `score`. Its own append-only record
(`RECORDS/QUEUE-JOBID.jsonl`, one `os.write` per line with O_APPEND, so lines from racing attempts never mix)
is what the invariants read: when each attempt started and beat (two attempts alive at once is a violation), the
steps it began saving, and each checkpoint it loaded with whether the loaded values were the step's own
(a torn or foreign checkpoint loaded is a violation)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

STEP_S = 0.2
EVERY = 5


def main() -> None:
    records, queue, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    from runtime.context import JobContext

    ctx = JobContext.from_env()
    fd = os.open(records / f"{queue}-{ctx.job_id}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def put(ev: str, **kw) -> None:
        os.write(fd, (json.dumps({"ev": ev, "attempt": ctx.attempt, "pid": os.getpid(), "t": time.time(), **kw})
                      + "\n").encode())

    put("start")
    import torch

    from runtime.checkpoint import CheckpointManager

    state = {"w": torch.zeros(4096), "step": torch.zeros((), dtype=torch.int64)}
    ckpt = CheckpointManager(ctx.checkpoint_dir / "ckpt", keep_last=2, interval_steps=EVERY, async_save=False)
    loaded = ckpt.load_latest(state)
    step = 0
    if loaded is not None:
        ok = bool((state["w"] == float(loaded)).all()) and int(state["step"]) == loaded
        put("load", step=loaded, ok=ok)
        step = loaded

    def save() -> None:
        put("saving", step=step)
        ckpt.save_now(step, state)
        put("saved", step=step)

    while step < steps:
        if ctx.should_stop():
            save()
            put("stop", step=step)
            ckpt.close()
            ctx.exit_preempted()
        time.sleep(STEP_S)
        step += 1
        state["w"].fill_(float(step))
        state["step"].fill_(step)
        ctx.heartbeat(step)
        put("beat", step=step)
        if step % EVERY == 0 and step < steps:
            save()
    ctx.complete()
    ctx.log_metrics({"score": float(step)}, step)
    ckpt.close()
    put("end", step=step)


if __name__ == "__main__":
    main()
