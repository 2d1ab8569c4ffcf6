"""Train the charlm byte-level GPT: one trial, resumable, metrics to MLflow.

The queue runs it as `python -m experiments.charlm.train` with the trial's params in AUTORESEARCH_PARAMS
(the job protocol). By hand, with the defaults or a few overrides:

    AUTORESEARCH_PARAMS='{"max_steps": 50}' python -m experiments.charlm.train

Data: every step reads the next training shard(s) from the volume through VolumeDataset and DataLoader
(shuffled per epoch from the seed; with `data=shards`, the same files packed into tar shards, through
ShardDataset in VolumeDataset's order: the same batches, so the same run bitwise), and cuts `batch_size`
random windows out of them at offsets drawn from
(seed, step). The loader position, the RNG and the counters live in the checkpoint and the learning rate
is a function of the step, so a trial stopped by SIGTERM and resumed finishes bitwise the same on CPU.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from experiments.charlm import prepare
from experiments.charlm.model import GPT, GPTConfig
from experiments.charlm.spec import SPEC
from experiments.common import (WithCounters, apply_mutable, checkpoint_every, distribute, evenly_spaced,
                                loader_workers, lr_at, params_at, read_all, schedule, seed_checkpoint, setup_torch,
                                standalone_checkpoints)
from runtime.checkpoint import CheckpointManager, TrainState
from runtime.context import JobContext
from runtime.data import ShardDataset, VolumeDataset
from runtime.data.loader import DataLoader
from runtime.steps import Steps

EVALS = 10  # evaluations per trial, evenly spaced: the agent's early stopping reads val_loss at each
EVAL_BYTES = 32 * 1024  # the same leading slice of the validation stream scores every trial
EVAL_TOKENS = 16 * 1024  # positions per forward pass at eval (no backward, so memory allows more)
KEEP_CHECKPOINTS = 2


def read_shard(path: str) -> torch.Tensor:
    """VolumeDataset transform: a shard file's bytes as a uint8 tensor."""
    with open(path, "rb") as fh:
        return torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8)


def sample_bytes(sample: dict) -> torch.Tensor:
    """ShardDataset transform: the packed file's bytes as a uint8 tensor (what read_shard gives for the file)."""
    return torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8)


def train_data(data: str, seed: int) -> VolumeDataset | ShardDataset:
    """The training split as a dataset of uint8 tensors, one per 64 KiB piece, from the files or the tar shards."""
    if data == "shards":  # "global": VolumeDataset's order over the same pieces (they all fit the cache)
        return ShardDataset(prepare.ensure_shards(), split="train", shuffle="global", seed=seed,
                            transform=sample_bytes)
    return VolumeDataset(prepare.ensure(), pattern="train-*.bin", seed=seed, transform=read_shard)


def read_split(data: str, split: str) -> torch.Tensor:
    """A whole split concatenated in file order, on every rank (each rank scores validation whole)."""
    if data == "shards":
        ds = ShardDataset(prepare.ensure_shards(), split=split, shuffle=False)
        return torch.cat([sample_bytes(ds.read(i)) for i in range(ds.num_samples)])
    return torch.cat(read_all(VolumeDataset(prepare.ensure(), pattern=f"{split}-*.bin", shuffle=False), read_shard))


def windows(shards: torch.Tensor, rows: int, block: int, seed: int, step: int) -> tuple[torch.Tensor, ...]:
    """`rows` random (input, target) windows of `block` bytes from shards (k, shard_bytes). The offsets
    come from a generator seeded by (seed, step), so no RNG state has to survive a preemption."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    which = torch.randint(shards.shape[0], (rows, 1), generator=g)
    start = torch.randint(shards.shape[1] - block, (rows, 1), generator=g)
    chunk = shards[which, start + torch.arange(block + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: torch.Tensor, batch: int, autocast) -> float:
    """Mean cross-entropy (nats per byte) over the fixed validation rows (n, block+1)."""
    model.eval()
    total = 0.0
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        with autocast():
            _, loss = model(chunk[:, :-1], chunk[:, 1:])
        total += loss.item() * len(chunk)
    model.train()
    return total / len(rows)


def main() -> None:
    with JobContext.from_env() as ctx:
        params = SPEC.validate(ctx.params)  # the CLI validated already; by hand this fills the defaults
        standalone_checkpoints(ctx, SPEC.name, params)
        train(ctx, params)


def train(ctx: JobContext, p: dict) -> None:
    # -- settings derived from the params ---------------------------------------------------------------
    heads, block = p["heads"], p["block_size"]
    width = math.ceil(p["width"] * p["scale"] / (2 * heads)) * (2 * heads)  # rope rotates channel pairs
    batch = p["batch_size"] * p["scale"]  # sequences per step, per rank
    tokens_per_step = batch * block * ctx.world_size
    total = math.ceil(p["max_tokens"] / tokens_per_step) if p["max_tokens"] else p["max_steps"]
    warmup = int(p["warmup"] * total)
    eval_steps = evenly_spaced(total, EVALS)
    device = torch.device(ctx.device)
    say = print if ctx.is_main else (lambda *args, **kwargs: None)  # one copy of the log under torchrun
    autocast = setup_torch(device, p["seed"])

    # -- data: training shards through the volume loader, a fixed validation slice in memory -----------
    shards_per_step = math.ceil(batch * (block + 1) / prepare.SHARD_BYTES)
    train_ds = train_data(p["data"], p["seed"])
    # A private generator: the loader draws worker seeds from it, not from the global RNG dropout uses.
    loader = DataLoader(train_ds, batch_size=shards_per_step, num_workers=loader_workers(device),
                        generator=torch.Generator().manual_seed(p["seed"]))
    val_stream = read_split(p["data"], "val")
    n_rows = min(EVAL_BYTES, len(val_stream)) // (block + 1)
    val_rows = val_stream[:n_rows * (block + 1)].view(n_rows, block + 1).long().to(device)
    eval_batch = max(batch, EVAL_TOKENS // block)  # few, large forward passes: per-call overhead dominates

    # -- model, optimizer, checkpoint -------------------------------------------------------------------
    cfg = GPTConfig(block_size=block, layers=p["layers"], heads=heads, width=width, mlp_ratio=p["mlp_ratio"],
                    activation=p["activation"], norm=p["norm"], positions=p["positions"],
                    dropout=p["dropout"], tied=p["tied"])
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.param_groups(p["weight_decay"]), lr=p["lr"],
                                  betas=(p["beta1"], p["beta2"]))
    net = distribute(model, ctx)
    stream = WithCounters(loader, loss_sum=0.0, loss_steps=0)
    state = TrainState(net, optimizer, stream)
    forked = seed_checkpoint(ctx.checkpoint_dir)  # a forked trial's first attempt starts from its parent's copy
    ckpt = CheckpointManager(ctx.checkpoint_dir, keep_last=KEEP_CHECKPOINTS, interval_steps=checkpoint_every(total))
    step = ckpt.load_latest(state) or 0
    steps = Steps(ctx, ckpt, state, counters=stream.counters, name="charlm", say=say)
    # Population-based training: the params change at steps of a schedule (a replay), and a forked trial's new
    # values override those its copied optimizer brought back (group 0 decays, group 1 never does).
    plan = schedule()
    p = params_at(p, plan, step)
    apply_mutable(model, optimizer, p, decay_groups={0})
    changes = {at for at, _ in plan if at > step}
    if step == 0 or forked:  # a forked trial's run is new: it needs its params (and its budget) too
        ctx.log_params({**p, "model_width": width, "model_params": model.num_params(), "total_steps": total})
    say(f"charlm: {model.num_params():,} params, {total} steps of {tokens_per_step:,} tokens, "
        f"{'resuming at step ' + str(step) if step else 'from scratch'} on {device}", flush=True)

    # -- the loop ---------------------------------------------------------------------------------------
    val_loss = None
    t0 = time.perf_counter()
    batches = iter(loader)
    while step < total:
        shards = next(batches, None)
        if shards is None:  # end of an epoch: the loader has moved on to the next one
            batches = iter(loader)
            continue
        if step in changes:
            p = params_at(p, plan, step)
            apply_mutable(model, optimizer, p, decay_groups={0})
        x, y = windows(shards, batch, block, p["seed"], step)
        lr = lr_at(step, total, p["lr"], warmup, p["schedule"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast():
            _, loss = net(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if p["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), p["grad_clip"])
        optimizer.step()
        step += 1
        steps.count(step, loss)

        if step in eval_steps:
            val_loss = evaluate(model, val_rows, eval_batch, autocast)
            train_loss = steps.train_loss()
            ctx.log_metrics({"train_loss": train_loss, "val_loss": val_loss, "val_bpb": val_loss / math.log(2),
                             "lr": lr, "tokens": step * tokens_per_step}, step)
            say(f"step {step}/{total}: train {train_loss:.4f} val {val_loss:.4f} "
                f"({val_loss / math.log(2):.3f} bpb) {time.perf_counter() - t0:.1f}s", flush=True)
        steps.checkpoint(step)  # save on the interval, heartbeat, stop if asked

    # -- done: a checkpoint of the final step makes a re-run of a finished trial a cheap no-op ----------
    steps.finish(total)
    if val_loss is None:  # resumed at the end: report the final metric again
        val_loss = evaluate(model, val_rows, eval_batch, autocast)
        ctx.log_metrics({"val_loss": val_loss, "val_bpb": val_loss / math.log(2)}, total)
    # The holdout, scored once on the finished model (the same leading slice size as validation): nothing
    # during training (or in the search) reads it.
    test_stream = read_split(p["data"], "test")
    n_test = min(EVAL_BYTES, len(test_stream)) // (block + 1)
    test_rows = test_stream[:n_test * (block + 1)].view(n_test, block + 1).long().to(device)
    test_loss = evaluate(model, test_rows, eval_batch, autocast)
    ctx.log_metrics({"test_loss": test_loss, "test_bpb": test_loss / math.log(2)}, total)
    say(f"charlm: final val_loss {val_loss:.6f} ({val_loss / math.log(2):.4f} bits per byte; holdout test_loss "
        f"{test_loss:.6f})", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
