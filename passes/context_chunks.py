"""Which tokens of each sequence a cp rank holds (head-tail load balancing; ``passes/context_parallel.py``)."""

from __future__ import annotations

import torch

from autopar.errors import LoweringError


def positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions of cp rank ``rank``'s tokens: chunks ``rank`` and ``2·cp − 1 − rank``."""
    if seq_len % (2 * cp):
        raise LoweringError(f"cp={cp} needs the sequence length divisible by 2·cp = {2 * cp}, got {seq_len}")
    c = seq_len // (2 * cp)
    head, tail = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(head, head + c), torch.arange(tail, tail + c)])


__all__ = ["positions"]
