"""Expert tensor parallelism: a layer's routed experts split across their hidden dimension over tp.

Lowers the ``megatron+experts`` style (:mod:`autopar.sharding.experts`, which prices it) for the layers
whose plan picks it, from the tensor-parallel pass (``passes/tensor_parallel.py``). Rank ``r`` of the tp
group holds rows ``[r·I/tp, (r+1)·I/tp)`` of the gate half and the same rows of the up half of
``gate_up_proj`` [E, 2I, H] — a DTensor placed ``_StridedShard(1, split_factor=2)``, so the model's own
``chunk(2, dim=-1)`` of its output still parts gate from up, and ``full_tensor()`` (the runtime's full
state dict, checkpoints, the safetensors export) gives back the one-device [E, 2I, H] — and columns
``[r·I/tp, (r+1)·I/tp)`` of ``down_proj`` [E, H, I] (``Shard(2)``). Parameter FQNs and global shapes
are unchanged.

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
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from autopar.errors import LoweringError
from autopar.sharding.experts import experts_refusal


def split_experts(experts: nn.Module, path: str, tp_mesh: Any, copy: Any, reduce: Any) -> None:
    """Shard ``experts``' two weights across their hidden dim over ``tp_mesh`` and reroute its forward
    through ``copy`` (Megatron's f) and ``reduce`` (g), autograd functions of (tensor, group)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if why := experts_refusal(experts):
        raise LoweringError(f"experts {path!r} cannot be split across their hidden dim: {why}")
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    width = experts.down_proj.shape[2]
    if width % tp:
        raise LoweringError(f"experts {path!r}: tp={tp} does not divide their hidden dim {width}")
    with torch.no_grad():
        gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
        gate_up = torch.cat([gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]], dim=1).clone()
        down = experts.down_proj.detach().chunk(tp, dim=2)[rank].clone()
    for name, local, placement in (("gate_up_proj", gate_up, _StridedShard(1, split_factor=2)),
                                   ("down_proj", down, Shard(2))):
        old = getattr(experts, name)
        setattr(experts, name, nn.Parameter(DTensor.from_local(local, tp_mesh, [placement], run_check=False),
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
