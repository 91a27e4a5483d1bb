"""The all-to-all dispatch and combine both expert layouts share (``passes/expert_parallel.py`` for fused
experts, ``passes/expert_list.py`` for module lists), and the gradient scaling their FSDP2 units need.

Rows sorted by expert go to the rank of the ep group holding their expert with
``torch.distributed._functional_collectives.all_to_all_single_autograd`` (its
backward is the reverse all-to-all), after one small all-to-all of the per-expert row
counts; the outputs come back by the reverse all-to-all, in the rows' order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(rows.contiguous(), recv, send, group)


# Under torch.compile (autopar.runtime.compiled) the exchange stays eager, a graph break the block compiles around:
# its split sizes are the step's routing (data-dependent), so traced they would recompile every step.
@torch.compiler.disable
def exchange(rows: torch.Tensor, counts: torch.Tensor, group: Any, ep: int,
             run_local: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """Rows sorted by expert (``counts[e]`` rows for expert ``e`` of E = ``counts.numel()``) sent to the
    rank of the ep group holding their expert, run there by ``run_local(rows grouped by local expert,
    rows per local expert)`` and sent back: that function's outputs, in the order of ``rows``. Shared by
    both layouts ep lowers (fused experts here, module lists in ``passes/expert_list.py``)."""
    import torch.distributed as dist

    per_rank = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] row counts
    send = counts.view(ep, per_rank).sum(1).tolist()
    by_source = received.view(ep, per_rank)
    recv = by_source.sum(1).tolist()
    got = _all_to_all(rows, send, recv, group)
    # received rows come grouped by source rank, then by expert: regroup by local expert
    local_id = torch.repeat_interleave(torch.arange(per_rank, device=got.device).repeat(ep), by_source.reshape(-1))
    regroup = torch.argsort(local_id, stable=True)
    out = run_local(got[regroup], by_source.sum(0).tolist())
    return _all_to_all(out[torch.argsort(regroup)], recv, send, group)


__all__ = ["ScaleGrad", "exchange"]
