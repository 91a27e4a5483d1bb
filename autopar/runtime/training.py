"""What a training step adds around the engines: the global gradient norm, clipping, each step's RNG.

* **Global gradient norm.** Every rank holds shards of some parameters'
  gradients (FSDP2 over dp, DTensor over tp, a pipeline stage's own) and
  whole copies of others (DDP, replicated layers). The norm one device's
  ``clip_grad_norm_`` computes is recovered with one all-reduce: each rank
  adds the squares of its local gradient elements divided by how many ranks
  of its pipeline stage hold each element (dp × tp over the mesh dims that
  shard it), so every element of the model counts exactly once.
* **Clipping** multiplies every local gradient by ``max_norm / (norm +
  1e-6)`` when that is below 1, as ``torch.nn.utils.clip_grad_norm_`` does.
* **RNG.** Each step's randomness (dropout) is drawn from a generator seeded
  by (seed, step, stream), the stream being the rank's (pp, dp) coordinate:
  ranks differing only in their tp coordinate draw the same dropout masks on
  the activations they replicate, and a run resumed from a checkpoint draws
  what the uninterrupted run drew. The caller's own generator state is
  restored after the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import BatchError

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _copies(t: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks of one pipeline stage (dp × tp of them) hold each element of ``t``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return stage_ranks
    sharded = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if p.is_shard())
    return stage_ranks // sharded


def global_grad_norm(grads: list[torch.Tensor], stage_ranks: int, launched: bool,
                     split: list[int] | None = None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (float64 scalar, the same on every rank): a collective.
    ``split``: per gradient, how many ranks hold different parts of it beyond its own placements (ep for
    a module list's experts, each held by one rank of its ep group)."""
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g, s in zip(grads, split or [1] * len(grads)):
        by_copies.setdefault(_copies(g, stage_ranks) // s, []).append(_local(g))
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for copies, local in by_copies.items():
        norms = torch._foreach_norm([t for t in local if t.numel()], 2) if local else []
        if norms:
            total += torch.stack(norms).double().square().sum() / copies
    if launched and dist.is_initialized() and dist.get_world_size() > 1:
        from autopar.runtime.launch import hold

        dist.all_reduce(total)
        hold(total)
    return total.sqrt()


def clip_grads_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients so their global norm is at most ``max_norm`` (torch's rule, in place)."""
    coef = max_norm / (float(norm) + CLIP_EPS)
    if coef < 1.0 and grads:
        torch._foreach_mul_([_local(g) for g in grads], coef)


def _stream_seed(seed: int, step: int, stream: int) -> int:
    return (seed * 1_000_003 + step * 65_537 + stream * 257) % (2**63 - 1)


@contextmanager
def step_rng(seed: int, step: int, stream: int, device: torch.device) -> Iterator[None]:
    """Run a step's forward and backward on the step's own generator state; restore the caller's.

    Seeds the generators themselves: ``torch.manual_seed`` also queues a lazy CUDA seeding that
    formats a stack trace, ~2 ms a call here."""
    generators = [torch.default_generator]
    if device.type == "cuda":
        generators.append(torch.cuda.default_generators[device.index if device.index is not None
                                                         else torch.cuda.current_device()])
    saved = [g.get_state() for g in generators]
    value = _stream_seed(seed, step, stream)
    for g in generators:
        g.manual_seed(value)
    try:
        yield
    finally:
        for g, state in zip(generators, saved):
            g.set_state(state)


# ------------------------------------------------------------------ batches and losses


def check_batch(inputs: Any, targets: torch.Tensor | None, n: int, microbatches: int,
                microbatch_size: int, what_takes: str = "train_step") -> None:
    """Raise :class:`BatchError` unless the inputs' batch and the targets (when given) have ``n``
    samples on dim 0 (a positional tuple's every tensor; a dict's first)."""
    from autopar import inputs as model_inputs

    checked = model_inputs.tensors(inputs)
    if isinstance(model_inputs.normalise(inputs), dict):
        checked = [(f"input {k!r}", t) for k, t in checked[:1]]
    for what, t in checked + ([("targets", targets)] if targets is not None else []):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
            got = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else "no batch dim"
            raise BatchError(f"{what_takes} takes this rank's data-parallel shard of {n} samples "
                             f"(microbatches {microbatches} × microbatch size {microbatch_size}); "
                             f"{what} has {got}. Use local_batch() on the global batch")


def check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise BatchError(f"loss_fn must return a scalar tensor (the microbatch mean), got {shape}")
    return loss
