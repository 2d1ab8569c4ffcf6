"""Two-rank (torchrun, gloo) check of what each rank stages for an async save: rank 0 the replicated DDP
state in one exact-sized buffer, rank 1 none of it; the async checkpoint then loads bitwise on both ranks,
and close() frees the buffer. Writes out/stage-rank<R>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from runtime.checkpoint.manager import CheckpointManager, TrainState  # noqa: E402


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(300, 1000),
                                                                          torch.nn.Linear(1000, 3)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(sys.argv[1])
    model, opt = build(0)
    ckpt = CheckpointManager(out / "ckpt", keep_last=1, interval_steps=1)
    state = TrainState(model, opt)
    for step in range(1, 4):
        model(torch.randn(8, 300)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step, state)
    ckpt.wait()
    staged = ckpt.staged_bytes
    deferred = sum(t.nbytes for t in model.parameters()) + sum(
        v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.close()
    freed = ckpt.staged_bytes
    model2, opt2 = build(1)
    loaded = CheckpointManager(out / "ckpt", keep_last=1, interval_steps=1).load_latest(TrainState(model2, opt2))
    same = all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
    (out / f"stage-rank{rank}.json").write_text(json.dumps(
        {"staged": staged, "deferred": deferred, "freed": freed, "loaded": loaded, "same": same,
         "left": ckpt._stager.left_to_lower_ranks, "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
