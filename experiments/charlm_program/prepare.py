"""Data and evaluation of the charlm program. Protected: the agent may not edit it, and every run gets it
restored read-only, so `val_bpb` means the same thing for every variant.

Data: the bytes of Python's standard library source (no network, no download), split into train and
validation by a stable hash of each file's path (one file in ten goes to validation). The model is a byte
level language model (vocabulary 256), and the score is validation bits per byte on a fixed slice.
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from pathlib import Path

import torch

VOCAB = 256
TRAIN_BYTES = 4_000_000
VAL_BYTES = 200_000
# The evaluation slice is fixed; CHARLM_EVAL_BYTES exists only so tests can run in seconds.
EVAL_BYTES = int(os.environ.get("CHARLM_EVAL_BYTES", "65536"))
SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}


def load() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) byte tensors (uint8), the same on every run on this interpreter."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = bytearray(), bytearray()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if SKIP.intersection(path.relative_to(root).parts[:-1]):
            continue
        target = val if zlib.crc32(rel.encode()) % 10 == 0 else train
        if len(target) < (VAL_BYTES if target is val else TRAIN_BYTES):
            target += f"# file: {rel}\n".encode() + path.read_bytes() + b"\n\n"
        if len(train) >= TRAIN_BYTES and len(val) >= VAL_BYTES:
            break
    return (torch.frombuffer(bytearray(train[:TRAIN_BYTES]), dtype=torch.uint8).long(),
            torch.frombuffer(bytearray(val[:VAL_BYTES]), dtype=torch.uint8).long())


def batch(data: torch.Tensor, size: int, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` random windows of `block` bytes and their next-byte targets."""
    ix = torch.randint(len(data) - block - 1, (size,), generator=gen)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + block + 1] for i in ix])
    return x, y


@torch.no_grad()
def evaluate_bpb(model: torch.nn.Module, val: torch.Tensor, block: int) -> float:
    """Bits per byte of `model` (logits of shape (B, T, 256) from (B, T) bytes) on the fixed validation slice."""
    model.eval()
    data = val[:EVAL_BYTES + 1]
    n = (len(data) - 1) // block
    x = data[:n * block].view(n, block)
    y = data[1:n * block + 1].view(n, block)
    nll = 0.0
    for i in range(0, n, 32):
        logits = model(x[i:i + 32])
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y[i:i + 32].reshape(-1),
                                                 reduction="sum").item()
    model.train()
    return nll / (n * block) / math.log(2)
