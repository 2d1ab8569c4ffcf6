"""A tiny nanoGPT-style byte-level language model, trained for a fixed time budget: the agent's playground.

Everything the agent may change is in this file: the model, the optimizer, the hyperparameters, the loop.
The budget is wall-clock (60 s by default, sized for two CPU cores), so a faster step is as good an idea as a
better model. The run ends by printing `val_bpb: <number>` (lower is better), which autoresearch reads.
"""

import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from prepare import VOCAB, batch, evaluate_bpb, load

# -- settings ----------------------------------------------------------------------------------------------------
TIME_BUDGET = float(os.environ.get("CHARLM_TIME_BUDGET", "60"))  # seconds of training
SEED = int(os.environ.get("AUTORESEARCH_SEED", "0"))
BLOCK = 64
BATCH = 16
N_LAYER = 2
N_HEAD = 4
N_EMBD = 64
DROPOUT = 0.0
LR = 1e-3
WEIGHT_DECAY = 0.01
THREADS = 1  # one core per run: several variants share a CPU box

torch.manual_seed(SEED)
torch.set_num_threads(THREADS)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(N_EMBD)
        self.attn = nn.MultiheadAttention(N_EMBD, N_HEAD, dropout=DROPOUT, batch_first=True)
        self.ln2 = nn.LayerNorm(N_EMBD)
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD))

    def forward(self, x):
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, N_EMBD)
        self.pos = nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.Sequential(*[Block() for _ in range(N_LAYER)])
        self.ln = nn.LayerNorm(N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.size(1))
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


# -- the loop ----------------------------------------------------------------------------------------------------
train, val = load()
model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
gen = torch.Generator().manual_seed(SEED)
start, step = time.time(), 0
while time.time() - start < TIME_BUDGET:
    x, y = batch(train, BATCH, BLOCK, gen)
    loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    step += 1
    if step % 100 == 0:
        print(f"step {step} loss {loss.item():.4f} ({loss.item() / math.log(2):.3f} bits/byte)", flush=True)

print(f"steps: {step}")
print(f"val_bpb: {evaluate_bpb(model, val, BLOCK):.6f}")
