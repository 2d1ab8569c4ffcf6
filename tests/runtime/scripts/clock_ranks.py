"""Two-rank (torchrun, gloo) check of a checkpoint interval in minutes: each rank's clock is its own fake one
that advances one second per step on rank 0 and seven on rank 1; both save the same steps, rank 0's. Writes
out/clock-rank<R>.json with the steps each rank's maybe_save started."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from runtime.checkpoint import interval, manager  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(sys.argv[1])
    now = [0.0]
    interval._now = lambda: now[0]  # this rank's clock
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = manager.CheckpointManager(out / "ckpt", keep_last=10, interval_minutes=0.5)
    state, saved = manager.TrainState(model, opt), []
    for step in range(1, 101):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        now[0] += 1.0 if rank == 0 else 7.0
        state.step = step
        if ckpt.maybe_save(step, state):
            saved.append(step)
    ckpt.wait()
    ckpt.close()
    (out / f"clock-rank{rank}.json").write_text(json.dumps({"saved": saved, "complete": ckpt.complete_steps()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
