"""A tiny deterministic CPU training job for the resume tests (single process or under torchrun).

Params (AUTORESEARCH_PARAMS): steps, interval, sleep (seconds per step), out (dir for losses/final params).
Every rank appends "step loss.hex()" lines to out/losses-rank<R>.txt; rank 0 saves out/final.pt at the end
and out/resumed.txt with the step it resumed from. Exits 75 when stopped by a signal after checkpointing.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from runtime.checkpoint.manager import CheckpointManager, TrainState  # noqa: E402
from runtime.context import ContextConfig, JobContext  # noqa: E402


class CountingLoader:
    """Batches drawn from a generator seeded by position: resuming needs the position restored."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pos = rank, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + self.pos)
        self.pos += 1
        x = torch.randn(16, 32, generator=g)
        return x, x.sum(dim=1, keepdim=True).sin()

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def main() -> None:
    torch.set_num_threads(1)  # bitwise repeatability across processes
    with JobContext.from_env(ContextConfig(heartbeat_interval_s=0)) as ctx:
        p = ctx.params
        out = Path(p["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"pid-rank{ctx.rank}").write_text(str(os.getpid()))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(64, 1))
        if ctx.world_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = CountingLoader(ctx.rank)
        state = TrainState(model, opt, loader)
        ckpt = CheckpointManager(ctx.checkpoint_dir, keep_last=2, interval_steps=int(p.get("interval", 10)))
        start = ckpt.load_latest(state) or 0
        if ctx.is_main:
            (out / "resumed.txt").write_text(str(start))
        if start == 0:
            torch.manual_seed(123 + ctx.rank)  # per-rank noise; a resumed run gets its RNG from the checkpoint
        losses = open(out / f"losses-rank{ctx.rank}.txt", "a")
        for step in range(start, int(p["steps"])):
            x, y = loader.next()
            x = x + 0.01 * torch.randn_like(x)  # consumes the global RNG, which the checkpoint restores
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.write(f"{step} {loss.item().hex()}\n")
            losses.flush()
            state.step = step + 1
            ckpt.maybe_save(step + 1, state)
            ctx.heartbeat(step + 1)
            time.sleep(float(p.get("sleep", 0)))
            if ctx.should_stop():
                ckpt.save_now(step + 1, state)
                ckpt.close()
                ctx.exit_preempted()
        ckpt.close()
        if ctx.is_main:
            inner = model.module if ctx.world_size > 1 else model
            torch.save(inner.state_dict(), out / "final.pt")


if __name__ == "__main__":
    main()
