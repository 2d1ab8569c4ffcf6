"""A tiny training job over a ParquetDataset for the preemption test: a linear model on `x`, the loader
(its position) inside TrainState, a checkpoint on SIGTERM. Appends "step id,id,..." per step to
out/ids.txt and writes out/final.pt at the end. Params: data, workers, epochs, sleep, out."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from runtime.checkpoint.manager import CheckpointManager, TrainState  # noqa: E402
from runtime.context import ContextConfig, JobContext  # noqa: E402
from runtime.data.loader import DataLoader  # noqa: E402
from runtime.data.parquet import ParquetDataset  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    with JobContext.from_env(ContextConfig(heartbeat_interval_s=0)) as ctx:
        p = ctx.params
        out = Path(p["out"])
        out.mkdir(parents=True, exist_ok=True)
        ds = ParquetDataset(p["data"], columns=["id", "x"], batch_rows=8, shuffle_rows=24, seed=4,
                            cache_dir=p["cache"])
        loader = DataLoader(ds, batch_size=None, num_workers=int(p["workers"]))
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        state = TrainState(model, opt, loader)
        ckpt = CheckpointManager(ctx.checkpoint_dir, keep_last=2, interval_steps=5)
        step = ckpt.load_latest(state) or 0
        total = int(p["epochs"]) * len(ds)
        log = open(out / "ids.txt", "a")
        while step < total:
            for batch in loader:
                loss = (model(batch["x"].unsqueeze(1)) - batch["x"].unsqueeze(1) * 0.1).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                state.step = step
                log.write(f"{step} {','.join(map(str, batch['id'].tolist()))}\n")
                log.flush()
                ckpt.maybe_save(step, state)
                ctx.heartbeat(step)
                time.sleep(float(p.get("sleep", 0)))
                if ctx.should_stop():
                    ckpt.save_now(step, state)
                    ckpt.close()
                    ctx.exit_preempted()
        ckpt.save_now(total, state)
        ckpt.close()
        torch.save(model.state_dict(), out / "final.pt")


if __name__ == "__main__":
    main()
