"""Train a tabular regressor: one trial, resumable, metrics to MLflow.

The queue runs it as `python -m experiments.tabular.train` with the trial's params in AUTORESEARCH_PARAMS
(the job protocol). By hand, with the defaults or a few overrides:

    AUTORESEARCH_PARAMS='{"hidden": 128, "epochs": 2}' python -m experiments.tabular.train

Data: Parquet files exported from a Delta table (see prepare.py), streamed by ParquetDataset in batches of
`batch_size` rows, shuffled per epoch, split across ranks; the validation rows are small enough to hold in
memory and every rank scores them whole. The loader position, the RNG and the counters live in the
checkpoint and the learning rate is a function of the step, so a trial stopped by SIGTERM and resumed
finishes bitwise the same on CPU.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn as nn
import torch.nn.functional as F

from experiments.common import (WithCounters, distribute, loader_workers, lr_at, setup_torch,
                                standalone_checkpoints)
from experiments.tabular import prepare
from experiments.tabular.spec import SPEC
from runtime.checkpoint import CheckpointManager, TrainState
from runtime.context import JobContext
from runtime.steps import Steps
from runtime.data.loader import DataLoader
from runtime.data.parquet import ParquetDataset, read_manifest

KEEP_CHECKPOINTS = 2
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


class TabularMLP(nn.Module):
    """Embeddings of the categorical codes, concatenated with the numeric features, into an MLP."""

    def __init__(self, numeric: int, levels: dict[str, int], hidden: int, depth: int, emb_dim: int,
                 activation: str, dropout: float):
        super().__init__()
        self.embeddings = nn.ModuleDict({name: nn.Embedding(n, emb_dim) for name, n in levels.items()})
        layers: list[nn.Module] = []
        width = numeric + emb_dim * len(levels)
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), ACTIVATIONS[activation](), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, numeric: torch.Tensor, codes: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [numeric] + [emb(codes[name]) for name, emb in self.embeddings.items()]
        return self.mlp(torch.cat(parts, dim=1)).squeeze(1)


def inputs(batch: dict, numeric: list[str], levels: dict, device) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """A batch of columns -> (numeric matrix, categorical codes, target)."""
    x = torch.stack([batch[c] for c in numeric], dim=1).to(device, torch.float32)
    codes = {c: batch[c].to(device, torch.long) for c in levels}
    return x, codes, batch["y"].to(device, torch.float32)


def read_split(directory) -> dict[str, torch.Tensor]:
    """A whole (small) export in memory as column tensors, in file order."""
    manifest = read_manifest(str(directory))
    table = pq.read_table([str(directory / f["path"]) for f in manifest["files"]])
    return {name: torch.from_numpy(np.ascontiguousarray(table.column(name).to_numpy())) for name in table.column_names}


@torch.no_grad()
def evaluate(model: nn.Module, val: tuple, autocast) -> float:
    """Mean squared error on the whole validation set."""
    model.eval()
    x, codes, y = val
    with autocast():
        pred = model(x, codes).float()
    model.train()
    return F.mse_loss(pred, y).item()


def main() -> None:
    with JobContext.from_env() as ctx:
        params = SPEC.validate(ctx.params)  # the CLI validated already; by hand this fills the defaults
        standalone_checkpoints(ctx, SPEC.name, params)
        train(ctx, params)


def train(ctx: JobContext, p: dict) -> None:
    device = torch.device(ctx.device)
    say = print if ctx.is_main else (lambda *args, **kwargs: None)  # one copy of the log under torchrun
    autocast = setup_torch(device, p["seed"])

    # -- data: training rows streamed from Parquet, the validation rows in memory -------------------------
    volume = prepare.ensure(p["rows"])
    facts = prepare.facts(volume)
    numeric, levels = facts["numeric"], facts["levels"]
    batch = p["batch_size"] * p["scale"]
    train_ds = ParquetDataset(str(volume / "train"), batch_rows=batch, seed=p["seed"],
                              columns=[*numeric, *levels, "y"])
    loader = DataLoader(train_ds, batch_size=None, num_workers=loader_workers(device),
                        generator=torch.Generator().manual_seed(p["seed"]))
    val = inputs(read_split(volume / "val"), numeric, levels, device)
    steps_per_epoch = len(train_ds)
    total = p["epochs"] * steps_per_epoch

    # -- model, optimizer, checkpoint ------------------------------------------------------------------------
    model = TabularMLP(len(numeric), levels, p["hidden"] * p["scale"], p["depth"], p["emb_dim"],
                       p["activation"], p["dropout"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
    net = distribute(model, ctx)
    stream = WithCounters(loader, loss_sum=0.0, loss_steps=0)
    state = TrainState(net, optimizer, stream)
    ckpt = CheckpointManager(ctx.checkpoint_dir, keep_last=KEEP_CHECKPOINTS, interval_steps=max(1, total // 4))
    step = ckpt.load_latest(state) or 0
    steps = Steps(ctx, ckpt, state, counters=stream.counters, name="tabular", say=say)
    n_params = sum(q.numel() for q in model.parameters())
    if step == 0:
        ctx.log_params({**p, "model_params": n_params, "total_steps": total, "bayes_mse": facts["bayes_mse"]})
    say(f"tabular: MLP {p['depth']}x{p['hidden'] * p['scale']} with {n_params:,} params on {facts['train_rows']:,} "
        f"rows, {p['epochs']} epochs of {steps_per_epoch} steps, "
        f"{'resuming at step ' + str(step) if step else 'from scratch'} on {device}", flush=True)

    # -- the loop: one pass of the loader is the rest of the current epoch ---------------------------------
    mse = None
    t0 = time.perf_counter()
    while step < total:
        for columns in loader:
            x, codes, y = inputs(columns, numeric, levels, device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, p["lr"], 0, p["schedule"])
            with autocast():
                pred = net(x, codes)
            loss = F.mse_loss(pred.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            steps.done(step, loss)  # count the loss, save on the interval, heartbeat, stop if asked
        # End of an epoch (the loader has moved on to the next one): score it.
        epoch = step // steps_per_epoch
        mse = evaluate(model, val, autocast)
        train_loss = steps.train_loss()
        ctx.log_metrics({"val_mse": mse, "val_excess": mse - facts["bayes_mse"], "train_loss": train_loss,
                         "epoch": epoch}, step)
        say(f"epoch {epoch}/{p['epochs']} step {step}: train {train_loss:.4f} val_mse {mse:.4f} "
            f"(best possible {facts['bayes_mse']:.4f}) {time.perf_counter() - t0:.1f}s", flush=True)

    # -- done: a checkpoint of the final step makes a re-run of a finished trial a cheap no-op -------------
    steps.finish(total)
    if mse is None:  # resumed at the end: report the final metric again
        mse = evaluate(model, val, autocast)
        ctx.log_metrics({"val_mse": mse, "val_excess": mse - facts["bayes_mse"]}, total)
    # The holdout, scored once on the finished model: nothing during training (or in the search) reads it.
    test_mse = evaluate(model, inputs(read_split(volume / "test"), numeric, levels, device), autocast)
    ctx.log_metrics({"test_mse": test_mse}, total)
    say(f"tabular: final val_mse {mse:.6f} (holdout test_mse {test_mse:.6f})", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
