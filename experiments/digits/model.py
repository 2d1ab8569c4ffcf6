"""Two small classifiers for 8x8 grayscale digits: an MLP and a two-layer convnet.

`build(params)` turns the experiment's params into a model, so train.py never branches on architecture.
"""

from __future__ import annotations

import torch
import torch.nn as nn

SIDE = 8  # images are SIDE x SIDE
CLASSES = 10

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


def _norm(kind: str, features: int, conv: bool) -> nn.Module:
    if kind == "batchnorm":
        return nn.BatchNorm2d(features) if conv else nn.BatchNorm1d(features)
    if kind == "layernorm":
        # GroupNorm with one group is LayerNorm over (C, H, W) for feature maps.
        return nn.GroupNorm(1, features) if conv else nn.LayerNorm(features)
    return nn.Identity()


class MLP(nn.Module):
    """Flatten, then `depth` blocks of Linear -> norm -> activation -> dropout, then a linear classifier."""

    def __init__(self, hidden: int, depth: int, activation: str, norm: str, dropout: float):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = SIDE * SIDE
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), _norm(norm, hidden, conv=False), ACTIVATIONS[activation](),
                       nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, CLASSES))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Two 3x3 conv blocks (c, then 2c channels; the second halves the resolution), global average pool,
    dropout, linear classifier."""

    def __init__(self, channels: int, activation: str, norm: str, dropout: float):
        super().__init__()
        c = channels
        act = ACTIVATIONS[activation]
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), _norm(norm, c, conv=True), act(),
            nn.Conv2d(c, 2 * c, 3, padding=1, stride=2), _norm(norm, 2 * c, conv=True), act(),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(2 * c, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build(params: dict) -> nn.Module:
    """The model named by `params["arch"]`, sized by its params times `params["scale"]`."""
    scale = params.get("scale", 1)
    if params["arch"] == "cnn":
        return CNN(params["channels"] * scale, params["activation"], params["norm"], params["dropout"])
    return MLP(params["hidden"] * scale, params["depth"], params["activation"], params["norm"],
               params["dropout"])
