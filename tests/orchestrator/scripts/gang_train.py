"""A small data-parallel training run for the multi-node tests: STEPS steps of a linear model under DDP (gloo),
a DCP checkpoint every EVERY steps through the runtime, DELAY seconds per step. Every rank records who and where
it is (rank, world size, its node as Slurm named it, NODE_RANK, MASTER_ADDR, the step it started from) in
OUT/ATTEMPT.RANK.json; rank 0 prints each step and, at the end, writes OUT/final.json with the weights' bytes (hex).

Each step's global batch depends on the step alone and is split by rank, so a run resumed on the same world size
computes what an uninterrupted one does, and one resumed on fewer ranks still trains the same data.
"""

import json
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from runtime.checkpoint.manager import CheckpointManager, TrainState
from runtime.context import JobContext

steps, every, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.1
GLOBAL_BATCH = 8


def say(line):
    """One line in one write: the ranks of a node share its stdout, and print() under PYTHONUNBUFFERED writes the
    text and its newline apart, so two ranks' lines could run together ("...step 1rank 1 stopped...")."""
    os.write(1, (line + "\n").encode())


def write(path, data):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


with JobContext.from_env() as ctx:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1, bias=False)  # one parameter: one DDP bucket, the same on every attempt
    net = DistributedDataParallel(model) if ctx.world_size > 1 else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    state = TrainState(net, opt)
    ckpt = CheckpointManager(ctx.checkpoint_dir, keep_last=3, interval_steps=every)
    start = ckpt.load_latest(state) or 0
    write(os.path.join(out, f"{ctx.attempt}.{ctx.rank}.json"), {
        "rank": ctx.rank, "world": ctx.world_size, "node": os.environ.get("SLURMD_NODENAME"),
        "node_rank": os.environ.get("NODE_RANK"), "master": os.environ.get("MASTER_ADDR"),
        "attempt": ctx.attempt, "start": start, "pid": os.getpid(), "at": time.time()})
    if ctx.is_main:
        say(f"attempt {ctx.attempt} starts at step {start} with {ctx.world_size} ranks")
    per_rank = GLOBAL_BATCH // ctx.world_size
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
        lo = ctx.rank * per_rank
        loss = torch.nn.functional.mse_loss(net(x[lo:lo + per_rank]), y[lo:lo + per_rank])
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step = step + 1
        ctx.heartbeat(step + 1)
        if ctx.is_main:
            say(f"step {step + 1} loss {loss.item():.6f} at {time.time():.3f}")
            ctx.log_metrics({"loss": loss.item()}, step + 1)
        ckpt.maybe_save(step + 1, state)
        if ctx.should_stop():
            ckpt.save_now(step + 1, state)
            say(f"rank {ctx.rank} stopped on request at step {step + 1}")
            ckpt.close()
            ctx.exit_preempted()
        time.sleep(delay)
    ckpt.close()
    if ctx.is_main:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        write(os.path.join(out, "final.json"), {"weights": weights.numpy().tobytes().hex(), "steps": steps,
                                                "attempt": ctx.attempt, "world": ctx.world_size})
