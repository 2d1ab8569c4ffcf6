"""Fit a small polynomial regression by gradient descent: a training script that knows nothing of autoresearch.

    python train.py --lr 0.05 --degree 5 --steps 200 --out_dir /tmp/run1

Every `--eval_every` steps it prints `step N: val_loss X` (autoresearch.toml's `pattern` reads these lines).
It saves its state in --out_dir and, given --resume, continues from there: a preempted trial resumes.
Only numpy: it runs in a fraction of a second.
"""

import argparse
import os
import signal

import numpy as np

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--lr", type=float, default=0.05, help="gradient-descent step size")
parser.add_argument("--degree", type=int, default=3, help="polynomial degree of the features")
parser.add_argument("--l2", type=float, default=0.0, help="weight decay")
parser.add_argument("--optimizer", choices=["sgd", "momentum"], default="sgd")
parser.add_argument("--steps", type=int, default=200, help="gradient steps")
parser.add_argument("--eval_every", type=int, default=20)
parser.add_argument("--seed", type=int, default=0, help="initial weights and mini-batch order")
parser.add_argument("--out_dir", default="out")
parser.add_argument("--resume", action="store_true", help="continue from the state in --out_dir")
args = parser.parse_args()

# The data: a fixed noisy sine (the same for every seed), split into train and validation.
data = np.random.default_rng(1234)
x = data.uniform(-1, 1, size=400)
y = np.sin(3 * x) + 0.1 * data.normal(size=400)
features = np.stack([x ** k for k in range(args.degree + 1)], axis=1)
train_x, train_y, val_x, val_y = features[:300], y[:300], features[300:], y[300:]

rng = np.random.default_rng(args.seed)
weights = rng.normal(scale=0.1, size=args.degree + 1)
velocity = np.zeros_like(weights)
start = 0
state_path = os.path.join(args.out_dir, "state.npz")
os.makedirs(args.out_dir, exist_ok=True)
if args.resume and os.path.exists(state_path):
    saved = np.load(state_path)
    weights, velocity, start = saved["weights"], saved["velocity"], int(saved["step"])
    rng = np.random.default_rng([args.seed, start])
    print(f"resumed at step {start}", flush=True)

stop = False


def on_term(*_):
    global stop
    stop = True


signal.signal(signal.SIGTERM, on_term)

for step in range(start + 1, args.steps + 1):
    batch = rng.integers(0, len(train_y), size=32)
    error = train_x[batch] @ weights - train_y[batch]
    grad = train_x[batch].T @ error / len(batch) + args.l2 * weights
    if args.optimizer == "momentum":
        velocity = 0.9 * velocity + grad
        grad = velocity
    weights = weights - args.lr * grad
    if step % args.eval_every == 0 or step == args.steps:
        val_loss = float(np.mean((val_x @ weights - val_y) ** 2))
        print(f"step {step}: val_loss {val_loss:.6f}", flush=True)
        np.savez(state_path + ".tmp.npz", weights=weights, velocity=velocity, step=step)
        os.replace(state_path + ".tmp.npz", state_path)
        if stop:
            print(f"stopped at step {step}", flush=True)
            raise SystemExit(0)
