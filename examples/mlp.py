"""A deep MLP: a stack of residual-free h -> 4h -> h blocks.

Usage: autopar plan examples/mlp.py:mlp --world-size 8 --cluster a100-80g
"""

from __future__ import annotations

import torch
import torch.nn as nn


class MLPBlock(nn.Module):
    """Linear w -> 4w, GELU, Linear 4w -> w: one Megatron column/row pair."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def mlp(width: int = 1024, depth: int = 8, batch: int = 1, device: str | torch.device = "meta"):
    """``depth`` MLP blocks in an nn.Sequential and a float input of shape (batch, width)."""
    with torch.device(device):
        model = nn.Sequential(*[MLPBlock(width) for _ in range(depth)])
        x = torch.randn(batch, width)
    return model, (x,)
