"""The vocabulary-parallel cross-entropy: the chunked loss on a head split over tp on its vocabulary.

A plan whose ``training.loss`` is ``vocab_parallel`` (:func:`autopar.contract.loss_engine`) splits the
head over tp by its vocabulary style: its weight (and bias) is a DTensor ``Shard(0)`` over the tp mesh,
rank r holding classes ``[r·V/tp, (r+1)·V/tp)`` (a tied head holds its embedding's parameter, split
alike). The head returns the hidden state inside a step (:mod:`autopar.runtime.chunked_loss`), and this
loss computes, chunk by chunk of tokens, on this rank's shard alone::

    z_c   = h_c @ W_rᵀ + b_r                           (fp32; a chunk of tokens × V/tp, never gathered)
    ℓ_r   = logsumexp(z_c, classes),  t_r = z_c[y] where this rank owns y, else 0
    (ℓ, t) of every rank ← one all-gather over tp          (2 fp32 numbers a token a rank)
    lse   = logsumexp over the ranks of ℓ_r,  target = Σ_r t_r
    loss  = Σ_{y ≠ -100} (lse − target) / #{y ≠ -100}

which is ``F.cross_entropy`` of the whole logits. Backward recomputes each chunk's shard of logits and
takes ``exp(z_c − lse) − onehot(y)`` (lse kept from forward, one number a token), adds ``gᵀ h`` into the
shard's weight gradient and ``g W_r`` into the hidden state's, which is summed over tp once, at the end
(the head's input is replicated over tp). The peak is two fp32 chunks of a shard.

Why not torch's ``torch.distributed.tensor.parallel.loss_parallel``: it takes the whole logits of the
microbatch as a DTensor sharded on the class dim and runs autograd's log-softmax and NLL through it,
so it holds B·S·V/tp fp32 logits and their log-softmax until backward (the full loss's peak divided by
tp, not a chunk of a shard), and its chunks could not recompute their logits in backward; it also
issues three all-reduces (max, sum of exponentials, target logit) where one all-gather does here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.errors import LossError

IGNORE_INDEX = -100  # F.cross_entropy's default, which the default loss uses


def shard_of(weight: torch.Tensor) -> tuple[Any, int]:
    """(the tp process group, this rank's first class) of a head weight split on its vocabulary: a
    DTensor ``Shard(0)`` over a 1-D mesh, as the TP pass's vocab style leaves it."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        where = (type(weight).__name__ if not isinstance(weight, DTensor)
                 else f"{weight.placements} over {weight.device_mesh.ndim} mesh dims")
        raise LossError(f"the plan runs the vocabulary-parallel loss, but the head's weight is {where}, not split on "
                        "its vocabulary over tp: re-plan the model")
    rows = weight.to_local().shape[0]
    return weight.device_mesh.get_group(), weight.device_mesh.get_local_rank() * rows


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, W, b).float().flatten(0, -2), targets.flatten())`` with ``W``, ``b``
    split over tp on the vocabulary (DTensors, :func:`shard_of`), ``chunk_tokens`` tokens at a time."""
    from torch.distributed.tensor import DTensor

    group, start = shard_of(weight)
    w = weight.to_local()  # autograd: the shard's gradient goes back into the DTensor parameter
    b = bias.to_local() if isinstance(bias, DTensor) else bias
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.dtype != w.dtype:  # a bf16 plan's loss is handed the output in fp32: the head ran in bf16
        h = h.to(w.dtype)
    y = targets.reshape(-1)
    count = (y != IGNORE_INDEX).sum()
    return _VocabParallelCrossEntropy.apply(h, w, b, y, chunk_tokens, group, start) / count


def _joined(z: torch.Tensor, y: torch.Tensor, start: int, group: Any) -> torch.Tensor:
    """Per token of a chunk: the log-sum-exp over the whole vocabulary and the target's logit, joined over
    tp from each rank's shard ``z`` (classes ``start``…) by one all-gather; rows (lse, target)."""
    mine = (y >= start) & (y < start + z.shape[1])
    rows = torch.arange(z.shape[0], device=z.device)
    local = torch.stack([torch.logsumexp(z, dim=1),
                         torch.where(mine, z[rows, (y - start).clamp(0, z.shape[1] - 1)], 0.0)])
    tp = dist.get_world_size(group)
    every = torch.empty((tp * local.shape[0], local.shape[1]), dtype=local.dtype, device=local.device)
    dist.all_gather_single(every, local.contiguous(), group=group)  # ranks along dim 0, as gloo takes it
    every = every.view(tp, *local.shape)
    return torch.stack([torch.logsumexp(every[:, 0], dim=0), every[:, 1].sum(0)])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Σ over the tokens not ignored of lse − target, on this rank's vocabulary shard, in chunks; backward
    recomputes each chunk's logits (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor,
                chunk: int, group: Any, start: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for at in range(0, h.shape[0], chunk):
            y_c = y[at:at + chunk]
            z = F.linear(h[at:at + chunk], w, b).float()
            joined = _joined(z, y_c, start, group)
            del z
            lse[at:at + chunk] = joined[0]
            total += torch.where(y_c != IGNORE_INDEX, joined[0] - joined[1], 0.0).sum()
        ctx.save_for_backward(h, w, b, y, lse)
        ctx.chunk, ctx.group, ctx.start = chunk, group, start
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        h, w, b, y, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        # accumulated in fp32 over the chunks, whatever the weight's dtype
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        grad_b = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need_b else None
        for at in range(0, h.shape[0], ctx.chunk):
            h_c, y_c = h[at:at + ctx.chunk], y[at:at + ctx.chunk]
            g = F.linear(h_c, w, b).float()  # the chunk's shard of logits again
            g.sub_(lse[at:at + ctx.chunk].unsqueeze(1)).exp_()  # softmax over the whole vocabulary, in place
            kept = y_c != IGNORE_INDEX
            mine = kept & (y_c >= ctx.start) & (y_c < ctx.start + g.shape[1])
            rows = torch.arange(g.shape[0], device=g.device)[mine]
            g[rows, y_c[mine] - ctx.start] -= 1.0
            g.mul_(kept.unsqueeze(1).to(g.dtype) * grad)
            if need_h:
                grad_h[at:at + ctx.chunk] = g.to(h.dtype) @ w
            if need_w:
                grad_w.addmm_(g.t(), h_c.float() if h_c.dtype != torch.float32 else h_c)
            if need_b:
                grad_b += g.sum(0)
            del g
        if need_h:  # each rank's share of the hidden state's gradient, from its classes: summed over tp
            dist.all_reduce(grad_h, group=ctx.group)
        grad_w = grad_w.to(w.dtype) if grad_w is not None else None
        grad_b = grad_b.to(b.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None


__all__ = ["shard_of", "vocab_parallel_cross_entropy"]
