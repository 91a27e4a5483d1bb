"""Which tokens of each sequence a cp rank holds (head-tail load balancing; ``passes/context_parallel.py``),
and the head all-to-all that moves them to a split of the heads and back (Ulysses: for SDPA in
``passes/context_parallel.py``, for attention written by hand in ``passes/manual_attention.py``)."""

from __future__ import annotations

from typing import Any

import torch

from autopar.errors import LoweringError


def positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions of cp rank ``rank``'s tokens: chunks ``rank`` and ``2·cp − 1 − rank``."""
    if seq_len % (2 * cp):
        raise LoweringError(f"cp={cp} needs the sequence length divisible by 2·cp = {2 * cp}, got {seq_len}")
    c = seq_len // (2 * cp)
    head, tail = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(head, head + c), torch.arange(tail, tail + c)])


def to_heads(x: torch.Tensor, order: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """The head all-to-all's first move: ``x`` [b, h, S/cp, d] (this rank's tokens, all heads) to
    [b, h/cp, S, d] (head group j to rank j, every rank's tokens), put in global token order by ``order``
    (the gathered rows' argsort). ``all_to_all_single_autograd``: its backward is the reverse all-to-all."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    b, h, n, d = x.shape
    chunks = x.reshape(b, cp, h // cp, n, d).transpose(0, 1).contiguous()  # [cp (head group), b, h/cp, n, d]
    got = all_to_all_single_autograd(chunks.flatten(0, 1), None, None, group)
    got = got.reshape(cp, b, h // cp, n, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)
    return got.index_select(2, order)  # [b, h/cp, S, d] in global token order


def to_tokens(x: torch.Tensor, order: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """The inverse of :func:`to_heads`: [b, h/cp, S, d] in global order back to [b, h, S/cp, d], this
    rank's tokens in its chunk order."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    b, g, s, d = x.shape
    x = x.index_select(2, torch.argsort(order))  # back to rank order: rank r's tokens r·S/cp onwards
    chunks = x.reshape(b, g, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp (rank), b, g, n, d]
    got = all_to_all_single_autograd(chunks.flatten(0, 1), None, None, group)
    return got.reshape(cp, b, g, s // cp, d).transpose(0, 1).reshape(b, cp * g, s // cp, d)


__all__ = ["positions", "to_heads", "to_tokens"]
