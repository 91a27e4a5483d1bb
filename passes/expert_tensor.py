"""Expert tensor parallelism: a layer's routed experts split across their hidden dimension over tp.

Lowers the ``megatron+experts`` style (:mod:`autopar.sharding.experts`, which prices it) for the layers
whose plan picks it, from the tensor-parallel pass (``passes/tensor_parallel.py``). Rank ``r`` of the tp
group holds rows ``[r·I/tp, (r+1)·I/tp)`` of the gate half and the same rows of the up half of
``gate_up_proj`` [E, 2I, H], so the model's own ``chunk(2, dim=-1)`` of its output still parts gate from
up, and columns ``[r·I/tp, (r+1)·I/tp)`` of ``down_proj`` [E, H, I] (``Shard(2)``). ``gate_up_proj``'s
rows are held reordered ``[gate_0 up_0 gate_1 up_1 …]`` and placed ``Shard(1)``, the way the
tensor-parallel pass holds a dense fused projection's segments (its ``Permutation``, which the runtime's
full state dict, DCP checkpoints and the safetensors export undo: one device's [E, 2I, H] comes back).
DTensor's ``_StridedShard(1, split_factor=2)`` would place the same shards without reordering, but DCP
cannot save it (torch 2.13 writes its two runs as one overlapping chunk). Parameter FQNs and global
shapes are unchanged.

**Forward**: the model's own experts forward (Hugging Face's ``grouped_mm`` or eager loop, whichever its
config selects) runs on this rank's shards, on the same tokens and routing every tp rank sees (the router
stays replicated: no routing decision changes); each expert's output is then a partial sum over its
I/tp hidden units, weighted by the router as a whole one is, so the partials are summed over tp.
Megatron's *f* (identity forward, gradient all-reduced backward) on the hidden input and on the router's
top-k weights (each rank's gradient of a weight is its partial output's share) and *g* (all-reduce
forward, identity backward) on the output. Each rank's weight gradients are then exactly its shard of one
device's: the output's gradient reaching every rank is the whole one.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from autopar.errors import LoweringError
from autopar.sharding.experts import experts_refusal
from autopar.sharding.rules import segment_permutation


def split_experts(experts: nn.Module, path: str, tp_mesh: Any, copy: Any, reduce: Any,
                  record: Callable[[str, torch.Tensor, int], None]) -> None:
    """Shard ``experts``' two weights across their hidden dim over ``tp_mesh`` and reroute its forward
    through ``copy`` (Megatron's f) and ``reduce`` (g), autograd functions of (tensor, group); ``record``
    (fqn, index, dim) keeps ``gate_up_proj``'s row order for the full state dict and checkpoints."""
    from torch.distributed.tensor import DTensor, Shard

    if why := experts_refusal(experts):
        raise LoweringError(f"experts {path!r} cannot be split across their hidden dim: {why}")
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    width = experts.down_proj.shape[2]
    if width % tp:
        raise LoweringError(f"experts {path!r}: tp={tp} does not divide their hidden dim {width}")
    order = segment_permutation((width, width), tp)  # [gate_0 up_0 gate_1 up_1 …]: rank r's rows contiguous
    with torch.no_grad():
        gate_up = experts.gate_up_proj.detach().index_select(1, order.to(experts.gate_up_proj.device))
        gate_up = gate_up.chunk(tp, dim=1)[rank].clone()
        down = experts.down_proj.detach().chunk(tp, dim=2)[rank].clone()
    record(f"{path}.gate_up_proj", order, 1)
    for name, piece, dim in (("gate_up_proj", gate_up, 1), ("down_proj", down, 2)):
        old = getattr(experts, name)
        setattr(experts, name, nn.Parameter(DTensor.from_local(piece, tp_mesh, [Shard(dim)], run_check=False),
                                            requires_grad=old.requires_grad))
    experts._autopar_etp = (tp_mesh.get_group(), copy, reduce)
    experts.forward = types.MethodType(_etp_forward, experts)


def _etp_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """The model's own experts forward on this rank's shards, its partial output summed over tp."""
    group, copy, reduce = self._autopar_etp
    local = {"gate_up_proj": self.gate_up_proj.to_local(), "down_proj": self.down_proj.to_local()}
    with _reparametrize_module(self, local):
        partial = type(self).forward(self, copy.apply(hidden_states, group), top_k_index,
                                     copy.apply(top_k_weights, group))
    return reduce.apply(partial, group)


__all__ = ["split_experts"]
