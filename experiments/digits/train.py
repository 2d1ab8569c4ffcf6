"""Train a digits classifier: one trial, resumable, metrics to MLflow.

The queue runs it as `python -m experiments.digits.train` with the trial's params in AUTORESEARCH_PARAMS
(the job protocol). By hand, with the defaults or a few overrides:

    AUTORESEARCH_PARAMS='{"arch": "cnn", "epochs": 5}' python -m experiments.digits.train

Data: PNG files on the volume, read through VolumeDataset and DataLoader and decoded with Pillow in the
dataset's transform (image and label both come from the file, since the loader hands over a cached copy).
The loader position, the RNG and the counters live in the checkpoint and the learning rate is a function
of the step, so a trial stopped by SIGTERM and resumed finishes bitwise the same on CPU.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from experiments.common import (WithCounters, apply_mutable, checkpoint_every, distribute, loader_workers, lr_at,
                                params_at, read_all, schedule, seed_checkpoint, setup_torch, standalone_checkpoints)
from experiments.digits import prepare
from experiments.digits.model import build
from experiments.digits.spec import SPEC
from runtime.checkpoint import CheckpointManager, TrainState
from runtime.context import JobContext
from runtime.steps import Steps
from runtime.data import VolumeDataset
from runtime.data.loader import DataLoader

MEAN, STD = 0.305, 0.376  # pixel statistics of the digits images (0..1 scale), to centre the inputs
KEEP_CHECKPOINTS = 2


def decode(path: str) -> tuple[torch.Tensor, int]:
    """VolumeDataset transform: a PNG file -> (normalised 1x8x8 float image, label from its text chunk)."""
    with Image.open(path, formats=("PNG",)) as img:
        pixels = np.asarray(img, dtype=np.float32) / 255.0
        label = int(img.text["label"])
    return torch.from_numpy((pixels - MEAN) / STD).unsqueeze(0), label


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, autocast) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on the whole validation set."""
    model.eval()
    with autocast():
        logits = model(images).float()
    model.train()
    loss = F.cross_entropy(logits, labels).item()
    return (logits.argmax(1) == labels).float().mean().item(), loss


def make_optimizer(model: torch.nn.Module, p: dict) -> torch.optim.Optimizer:
    """AdamW, or SGD with Nesterov momentum, as the params say."""
    if p["optimizer"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=p["lr"], momentum=p["momentum"],
                               nesterov=p["momentum"] > 0, weight_decay=p["weight_decay"])
    return torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])


def main() -> None:
    with JobContext.from_env() as ctx:
        params = SPEC.validate(ctx.params)  # the CLI validated already; by hand this fills the defaults
        standalone_checkpoints(ctx, SPEC.name, params)
        train(ctx, params)


def train(ctx: JobContext, p: dict) -> None:
    device = torch.device(ctx.device)
    say = print if ctx.is_main else (lambda *args, **kwargs: None)  # one copy of the log under torchrun
    autocast = setup_torch(device, p["seed"])

    # -- data: training images through the volume loader, the validation set in memory -----------------
    data_dir = prepare.ensure()
    train_ds = VolumeDataset(data_dir, pattern="train/*.png", seed=p["seed"], transform=decode)
    batch = min(p["batch_size"] * p["scale"], len(train_ds))  # per rank; never more than one epoch
    # drop_last: equal-size batches (BatchNorm cannot train on a batch of one). A private generator: the
    # loader draws worker seeds from it, not from the global RNG that dropout uses.
    loader = DataLoader(train_ds, batch_size=batch, num_workers=loader_workers(device), drop_last=True,
                        generator=torch.Generator().manual_seed(p["seed"]))
    val = read_all(VolumeDataset(data_dir, pattern="val/*.png", shuffle=False), decode)
    val_images = torch.stack([x for x, _ in val]).to(device)
    val_labels = torch.tensor([y for _, y in val], device=device)
    steps_per_epoch = len(train_ds) // batch
    total = p["epochs"] * steps_per_epoch

    # -- model, optimizer, checkpoint -------------------------------------------------------------------
    model = build(p).to(device)
    optimizer = make_optimizer(model, p)
    net = distribute(model, ctx)
    stream = WithCounters(loader, loss_sum=0.0, loss_steps=0)
    state = TrainState(net, optimizer, stream)
    forked = seed_checkpoint(ctx.checkpoint_dir)  # a forked trial's first attempt starts from its parent's copy
    ckpt = CheckpointManager(ctx.checkpoint_dir, keep_last=KEEP_CHECKPOINTS, interval_steps=checkpoint_every(total))
    step = ckpt.load_latest(state) or 0
    steps = Steps(ctx, ckpt, state, counters=stream.counters, name="digits", say=say)
    # Population-based training: the params change at steps of a schedule (a replay), and a forked trial's new
    # values override those its copied optimizer brought back.
    plan = schedule()
    p = params_at(p, plan, step)
    apply_mutable(model, optimizer, p)
    changes = {at for at, _ in plan if at > step}
    n_params = sum(q.numel() for q in model.parameters())
    if step == 0 or forked:  # a forked trial's run is new: it needs its params (and its budget) too
        ctx.log_params({**p, "model_params": n_params, "total_steps": total})
    say(f"digits: {p['arch']} with {n_params:,} params, {p['epochs']} epochs of {steps_per_epoch} steps, "
        f"{'resuming at step ' + str(step) if step else 'from scratch'} on {device}", flush=True)

    # -- the loop: one pass of the loader is the rest of the current epoch --------------------------------
    accuracy = None
    t0 = time.perf_counter()
    while step < total:
        for x, y in loader:
            if step in changes:
                p = params_at(p, plan, step)
                apply_mutable(model, optimizer, p)
            lr = lr_at(step, total, p["lr"], 0, p["schedule"])
            for group in optimizer.param_groups:
                group["lr"] = lr
            with autocast():
                logits = net(x.to(device))
            loss = F.cross_entropy(logits.float(), y.to(device), label_smoothing=p["label_smoothing"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            steps.done(step, loss)  # count the loss, save on the interval, heartbeat, stop if asked
        # End of an epoch (the loader has moved on to the next one): score it.
        epoch = step // steps_per_epoch
        accuracy, val_loss = evaluate(model, val_images, val_labels, autocast)
        train_loss = steps.train_loss()
        ctx.log_metrics({"val_accuracy": accuracy, "val_loss": val_loss, "train_loss": train_loss,
                         "lr": lr_at(step - 1, total, p["lr"], 0, p["schedule"]), "epoch": epoch}, step)
        say(f"epoch {epoch}/{p['epochs']} step {step}: train {train_loss:.4f} val {val_loss:.4f} "
            f"accuracy {accuracy:.4f} {time.perf_counter() - t0:.1f}s", flush=True)

    # -- done: a checkpoint of the final step makes a re-run of a finished trial a cheap no-op ----------
    steps.finish(total)
    if accuracy is None:  # resumed at the end: report the final metric again
        accuracy, val_loss = evaluate(model, val_images, val_labels, autocast)
        ctx.log_metrics({"val_accuracy": accuracy, "val_loss": val_loss}, total)
    # The holdout, scored once on the finished model: nothing during training (or in the search) reads it.
    test = read_all(VolumeDataset(data_dir, pattern="test/*.png", shuffle=False), decode)
    test_accuracy, test_loss = evaluate(model, torch.stack([x for x, _ in test]).to(device),
                                        torch.tensor([y for _, y in test], device=device), autocast)
    ctx.log_metrics({"test_accuracy": test_accuracy, "test_loss": test_loss}, total)
    say(f"digits: final val_accuracy {accuracy:.6f} (holdout test_accuracy {test_accuracy:.6f})", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
