"""Expert tensor parallelism: a layer's routed experts split across their hidden dimension over tp.

Lowers the ``megatron+experts`` style (:mod:`autopar.sharding.experts`, which prices it) for the layers
whose plan picks it, from the tensor-parallel pass (``passes/tensor_parallel.py``). Rank ``r`` of the tp
group holds rows ``[r·I/tp, (r+1)·I/tp)`` of the gate half and the same rows of the up half of
the fused gate-up weight [E, 2I, H], so the model's own ``chunk(2, dim=-1)`` of its output still parts gate
from up, and columns ``[r·I/tp, (r+1)·I/tp)`` of the down weight [E, H, I] (``Shard(2)``; their names from
``autopar.experts.layouts``). The gate-up weight's rows are held reordered ``[gate_0 up_0 gate_1 up_1 …]`` and
placed ``Shard(1)``, the way the
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
from autopar.experts.layouts import hidden_split_weights
from autopar.sharding.experts import experts_refusal
from autopar.sharding.rules import segment_permutation


def split_experts(experts: nn.Module, path: str, tp_mesh: Any, copy: Any, reduce: Any,
                  record: Callable[[str, torch.Tensor, int], None]) -> None:
    """Shard ``experts``' two weights across their hidden dim over ``tp_mesh`` and reroute its forward
    through ``copy`` (Megatron's f) and ``reduce`` (g), autograd functions of (tensor, group); ``record``
    (fqn, index, dim) keeps the gate-up weight's row order for the full state dict and checkpoints."""
    from torch.distributed.tensor import DTensor, Shard

    if why := experts_refusal(experts):
        raise LoweringError(f"experts {path!r} cannot be split across their hidden dim: {why}")
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    gate_up_name, down_name = hidden_split_weights(experts)
    gate_up_full, down_full = getattr(experts, gate_up_name), getattr(experts, down_name)
    width = down_full.shape[2]
    if width % tp:
        raise LoweringError(f"experts {path!r}: tp={tp} does not divide their hidden dim {width}")
    order = segment_permutation((width, width), tp)  # [gate_0 up_0 gate_1 up_1 …]: rank r's rows contiguous
    with torch.no_grad():
        gate_up = gate_up_full.detach().index_select(1, order.to(gate_up_full.device))
        gate_up = gate_up.chunk(tp, dim=1)[rank].clone()
        down = down_full.detach().chunk(tp, dim=2)[rank].clone()
    record(f"{path}.{gate_up_name}", order, 1)
    for name, piece, dim in ((gate_up_name, gate_up, 1), (down_name, down, 2)):
        old = getattr(experts, name)
        setattr(experts, name, nn.Parameter(DTensor.from_local(piece, tp_mesh, [Shard(dim)], run_check=False),
                                            requires_grad=old.requires_grad))
    experts._autopar_etp = (tp_mesh.get_group(), copy, reduce, (gate_up_name, down_name))
    experts.forward = types.MethodType(_etp_forward, experts)


def _etp_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """The model's own experts forward on this rank's shards, its partial output summed over tp."""
    group, copy, reduce, names = self._autopar_etp
    local = {n: getattr(self, n).to_local() for n in names}
    with _reparametrize_module(self, local):
        partial = type(self).forward(self, copy.apply(hidden_states, group), top_k_index,
                                     copy.apply(top_k_weights, group))
    return reduce.apply(partial, group)


__all__ = ["split_experts"]
