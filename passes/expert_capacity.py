"""Expert parallelism for a GShard/Switch capacity block: its own 3-D experts split on E between dispatch and combine.

A fixed-capacity MoE block (one-hot ``einsum("sec,sm->ecm")`` dispatch into
``[E, C, M]``, experts as batched einsums over ``e`` on 3-D weights of its
own, ``einsum("sec,ecm->sm")`` combine) runs its own forward under ep, with
its expert region found as it runs (:class:`autopar.capturing.moe_capacity.
ExpertRegion`): GShard's layout. Each rank dispatches its own tokens into
``[E, C, M]`` exactly as one device does for the same tokens (its capacity C
from its own token count; every rank of an ep group holds as many tokens, so
the same C), sends the slice of experts ``[i·E/ep, (i+1)·E/ep)`` to ep rank
``i`` with ``torch.distributed._functional_collectives.all_to_all_single_autograd``
(its backward is the reverse all-to-all), runs its local experts on the
received ``[E/ep, ep·C, M]`` (the ep ranks' slots side by side on dim 1), and
sends the outputs back by the reverse all-to-all before the block's combine.

**Exactness.** The router, the one-hot masks, the cumsum positions and the
combine run as written on this rank's tokens, so each token's routing and
slot are the ones one device computes for the same tokens; an expert maps
each slot on its own, so computing it on another rank changes no number.
A plan's ranks call the block on a share of the global batch: where the
capacity can drop tokens (cf · top-k < E) which tokens drop depends on that
share, so a split of the batch there runs a capacity per split, as the plan's
``batch_coupled`` says (:mod:`autopar.batch_coupling`): per dp rank's
microbatch, which is this rank's own call under ep too, so ep changes no
number of the split run; drop-free, every token reaches its top-k experts
whatever the share, and padded slots are zero rows whose combine weights are
zero.

**Weights** keep their FQNs and their global shape ``[E, …]``, as DTensors
sharded on dim 0 over the ep group (as ``passes/expert_parallel.py``'s fused
experts); they stay whole over the expert-data-parallel group at every ZeRO
stage (the block's router is a dense weight of the same module, so they
cannot be an FSDP2 unit of their own; priced so,
``planning/expert_price.py``), left out of the dp engine and reduced by
:func:`autopar.passes.expert_parallel.reduce_expert_grads`.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from autopar.capturing.moe_capacity import ExpertRegion, expert_weights, proof, run
from autopar.experts import MoEFacts


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), None, None, group)  # equal chunks of dim 0, one per rank


def to_experts(x: torch.Tensor, group: Any, ep: int) -> torch.Tensor:
    """``[E, C, …]`` of this rank's tokens → ``[E/ep, ep·C, …]``: this rank's experts' slots of every rank
    of the ep group, source rank by source rank on dim 1."""
    per, c = x.shape[0] // ep, x.shape[1]
    got = _all_to_all(x, group).reshape(ep, per, c, *x.shape[2:])  # [source rank, local expert, C, …]
    return got.transpose(0, 1).reshape(per, ep * c, *x.shape[2:])


def from_experts(y: torch.Tensor, group: Any, ep: int) -> torch.Tensor:
    """The reverse of :func:`to_experts`: ``[E/ep, ep·C, …]`` → ``[E, C, …]`` of this rank's tokens."""
    per, c = y.shape[0], y.shape[1] // ep
    back = _all_to_all(y.reshape(per, ep, c, *y.shape[2:]).transpose(0, 1), group)  # [expert's rank, per, C, …]
    return back.reshape(ep * per, c, *y.shape[2:])


def capacity_refusal(model: nn.Module, layer: str, facts: MoEFacts) -> str | None:
    """Why ep cannot split this capacity block (None when it can): its ep refusal from capture (drops,
    an expert region not of the shape ep splits), proved again on the model handed in."""
    if facts.ep_refusal:
        return f"layer {layer!r}: {facts.ep_refusal}"
    try:
        block = model.get_submodule(facts.module_path)
    except AttributeError:
        return f"layer {layer!r}: no MoE block {facts.module_path!r} in the model"
    own = {id(p) for p in expert_weights(block, facts.num_experts)}
    if not own:
        return f"layer {layer!r}: block {facts.module_path!r} holds no weights of {facts.num_experts} experts"
    hidden = next((int(p.shape[1]) for p in block.parameters() if p.dim() == 2 and p.shape[0] == facts.num_experts
                   and id(p) not in own), None)
    if hidden is None:
        return f"layer {layer!r}: block {facts.module_path!r} has no router weight of one row per expert"
    if why := proof(block, facts.num_experts, hidden):
        return (f"layer {layer!r}: ep cannot split the expert region of {facts.module_path!r} "
                f"({type(block).__name__}): {why}")
    return None


def _block_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    weights, e, group, ep = self._autopar_ep_capacity
    region = ExpertRegion(weights, e, lambda w: w.to_local(), lambda x: to_experts(x, group, ep),
                          lambda y: from_experts(y, group, ep))
    return run(self, type(self).forward, region, args, kwargs)


def split_region(model: nn.Module, facts: MoEFacts, emesh: Any) -> list[nn.Parameter]:
    """Shard the block's expert weights on E over ``emesh``'s ep axis (DTensors, FQNs unchanged) and run
    its forward with the expert region split (requires :func:`capacity_refusal` passed). Returns the
    sharded weights."""
    from torch.distributed.tensor import DTensor, Shard

    block = model.get_submodule(facts.module_path)
    ep, rank = emesh["ep"].size(), emesh["ep"].get_local_rank()
    made = []
    for name, full in list(block.named_parameters(recurse=False)):
        if full.dim() >= 2 and full.shape[0] == facts.num_experts and "." not in name:
            local = full.detach().chunk(ep, dim=0)[rank].clone()
            param = nn.Parameter(DTensor.from_local(local, emesh["ep"], [Shard(0)], run_check=False),
                                 requires_grad=full.requires_grad)
            setattr(block, name, param)
            made.append(param)
    block._autopar_ep_capacity = (made, facts.num_experts, emesh["ep"].get_group(), ep)
    block.forward = types.MethodType(_block_forward, block)
    return made


def holder(params: list[nn.Parameter]) -> nn.Module:
    """A module outside the model holding ``params``: what the dp engine is told to ignore (the block
    itself also holds its router, which the dp engine reduces)."""
    held = nn.Module()
    for i, p in enumerate(params):
        held.register_parameter(f"w{i}", p)
    return held


__all__ = ["capacity_refusal", "from_experts", "holder", "split_region", "to_experts"]
