"""A small GPT for bytes, written for this project in the spirit of nanoGPT.

Every architecture choice in `spec.py` maps to one switch here: norm (LayerNorm or RMSNorm), positions
(learned absolute embeddings or rotary), MLP activation (GELU, ReLU or SwiGLU), dropout and tied
input/output embeddings. The vocabulary is the 256 byte values, so there is no tokenizer to build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # bytes


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. `width` must divide by 2*heads (rotary rotates pairs of channels per head)."""

    block_size: int = 128
    layers: int = 2
    heads: int = 4
    width: int = 128
    mlp_ratio: int = 4
    activation: str = "gelu"
    norm: str = "layernorm"
    positions: str = "learned"
    dropout: float = 0.0
    tied: bool = True

    def __post_init__(self) -> None:
        if self.width % (2 * self.heads):
            raise ValueError(f"width {self.width} must be a multiple of 2*heads ({2 * self.heads})")
        if self.activation not in ("gelu", "relu", "swiglu"):
            raise ValueError(f"unknown activation {self.activation!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"unknown norm {self.norm!r}")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"unknown positions {self.positions!r}")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 so bf16 autocast does not lose the small variances.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def make_norm(kind: str, dim: int) -> nn.Module:
    """The norm layer named in the config."""
    return RMSNorm(dim) if kind == "rmsnorm" else nn.LayerNorm(dim)


def rope_tables(block_size: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (block_size, head_dim/2) for rotary position embeddings."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x1, x2) of x (batch, heads, time, head_dim) by position-dependent angles."""
    t = x.shape[-2]
    cos, sin = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal multi-head self-attention, with rotary positions applied to queries and keys when asked."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.dropout = cfg.dropout
        self.rope = cfg.positions == "rope"
        if self.rope:
            cos, sin = rope_tables(cfg.block_size, cfg.width // cfg.heads)
            # Not persistent: derived from the config, so checkpoints carry only learned state.
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.rope:
            q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    """Position-wise feed-forward: GELU or ReLU, or SwiGLU with 2/3 of the hidden size (equal parameters)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.width
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:
            hidden = max(8, int(2 * hidden / 3))
            self.gate = nn.Linear(cfg.width, hidden, bias=False)
        self.up = nn.Linear(cfg.width, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.width, bias=False)
        self.act = nn.ReLU() if cfg.activation == "relu" else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate(x)) * self.up(x) if self.swiglu else self.act(self.up(x))
        return self.down(h)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1, self.attn = make_norm(cfg.norm, cfg.width), Attention(cfg)
        self.norm2, self.mlp = make_norm(cfg.norm, cfg.width), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Byte-level decoder-only transformer. `forward(idx, targets)` returns (logits, mean cross-entropy)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.width)
        self.pos = nn.Embedding(cfg.block_size, cfg.width) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = make_norm(cfg.norm, cfg.width)
        self.head = nn.Linear(cfg.width, VOCAB, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections keeps the stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameter count (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} bytes is longer than block_size {self.cfg.block_size}")
        x = self.embed(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(t, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
        return logits, loss

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay matrices (linear and embedding weights), not gains, biases or norms."""
        decay, no_decay = [], []
        for p in self.parameters():  # parameters() yields a tied weight once
            (decay if p.dim() >= 2 else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_bytes: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `new_bytes` continuations of idx (batch, time); handy for eyeballing a trained model."""
        for _ in range(new_bytes):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, 1, generator=generator)), dim=1)
        return idx
