"""Memory: model states under ZeRO, activations, and training precision.

Model states per device for Ψ parameters over N_d data-parallel ranks, with p,
g bytes per parameter of weights and gradients and K bytes of optimizer state
(ZeRO, Rajbhandari et al. 2020):

    ZeRO-0 (DP)  (p + g + K)·Ψ
    ZeRO-1       (p + g)·Ψ + K·Ψ/N_d
    ZeRO-2       p·Ψ + (g + K)·Ψ/N_d
    ZeRO-3       (p + g + K)·Ψ/N_d

Mixed precision (bf16 weights and gradients, fp32 master weights and Adam
moments) has p = g = 2, K = 12; plain fp32 with Adam has p = g = 4, K = 8.
Sharded terms round up: a rank holds whole elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter and per activation element of a training precision."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def optimizer_bytes_touched(self) -> int:
        """Bytes an Adam step reads and writes per parameter (states twice, grad, weight)."""
        return 2 * self.optimizer_bytes + self.grad_bytes + self.param_bytes


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", param_bytes=2, grad_bytes=2, optimizer_bytes=12, activation_bytes=2),
    "fp32": Precision("fp32", param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4),
}

ZERO_STAGES = (0, 1, 2, 3)


def precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(PRECISIONS)}") from None


def model_state_bytes(params: int, zero: int, dp: int, prec: Precision) -> int:
    """Weights + gradients + optimizer state one rank holds for ``params`` parameters."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {zero}")
    p, g, k = prec.param_bytes, prec.grad_bytes, prec.optimizer_bytes
    if zero == 0:
        return (p + g + k) * params
    if zero == 1:
        return (p + g) * params + math.ceil(k * params / dp)
    if zero == 2:
        return p * params + math.ceil((g + k) * params / dp)
    return math.ceil((p + g + k) * params / dp)


def optimizer_shard_params(params: int, zero: int, dp: int) -> int:
    """Parameters whose optimizer step this rank computes (sharded from ZeRO-1 on)."""
    return params if zero == 0 else math.ceil(params / dp)
