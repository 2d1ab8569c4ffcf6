"""One rank of the multi-node checkpoint benchmark (benchmarks/multinode.py), run on every node by the Slurm
executor's launcher: each rank holds its own shard of the model's state (MIB_PER_RANK MiB of fp32 under a name of
its own, as a sharded model's rank does) and saves it SAVES times, two ways:

- dcp: the runtime's `CheckpointManager` (async DCP: every rank stages its shard to host memory and writes its own
  file to the shared volume in the background; the commit marker once all have) -> per rank, the stall (the save
  call plus the next optimizer step's wait for staging) and the time to the commit;
- torch.save: rank 0 gathers every shard and writes one file with `torch.save` while the others wait at a barrier
  (the monolithic approach) -> per rank, the stall (all of it: nobody trains meanwhile).

Rank 0 writes OUT/result.json: per rank stalls, bytes, and wall times of each way.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from runtime.checkpoint.manager import CheckpointManager, TrainState
from runtime.context import JobContext

mib, saves, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


class Shard(torch.nn.Module):
    def __init__(self, rank: int, numel: int):
        super().__init__()
        self.register_parameter(f"shard{rank}", torch.nn.Parameter(torch.randn(numel)))


with JobContext.from_env() as ctx:
    rank, world = ctx.rank, ctx.world_size
    numel = mib * (1 << 20) // 4
    model = Shard(rank, numel)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    state = TrainState(model, opt)
    ckpt = CheckpointManager(os.path.join(out, "dcp"), keep_last=1, interval_steps=1)
    dcp_stalls, dcp_commits = [], []
    for i in range(1, saves + 1):
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.maybe_save(i, state)
        called = time.perf_counter() - t0
        t1 = time.perf_counter()
        opt.step()  # waits (pre-hook) until this rank's shard is staged in host memory
        staged = time.perf_counter() - t1
        ckpt.wait()  # the commit (every rank's file written, the metadata after), for the throughput
        dist.barrier()
        dcp_commits.append(time.perf_counter() - t0)
        dcp_stalls.append(called + staged)
    ckpt.close()
    mono_stalls = []
    target = os.path.join(out, "monolithic.pt")
    for i in range(saves):
        dist.barrier()
        t0 = time.perf_counter()
        mine = next(iter(model.parameters())).detach()
        parts = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
        dist.gather(mine, parts, dst=0)
        if rank == 0:
            torch.save({f"shard{r}": t for r, t in enumerate(parts)}, target + ".tmp")
            os.fsync(os.open(target + ".tmp", os.O_RDONLY))
            os.replace(target + ".tmp", target)
        dist.barrier()
        mono_stalls.append(time.perf_counter() - t0)
    stats = torch.tensor([sum(dcp_stalls) / saves, max(dcp_stalls), sum(dcp_commits) / saves,
                          sum(mono_stalls) / saves], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        per_rank = [dict(zip(("dcp_stall_mean_s", "dcp_stall_max_s", "dcp_commit_s", "torch_save_stall_s"),
                             [round(float(v), 4) for v in g])) for g in gathered]
        total = world * numel * 4
        result = {"world": world, "bytes_per_rank": numel * 4, "bytes_total": total, "saves": saves,
                  "per_rank": per_rank,
                  "dcp_commit_s": max(r["dcp_commit_s"] for r in per_rank),
                  "torch_save_s": max(r["torch_save_stall_s"] for r in per_rank)}
        result["dcp_mb_s"] = round(total / result["dcp_commit_s"] / 1e6, 1)
        result["torch_save_mb_s"] = round(total / result["torch_save_s"] / 1e6, 1)
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(result, fh, indent=1)
