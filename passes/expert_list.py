"""Expert parallelism for experts held as an ``nn.ModuleList`` and run by the block's own loop.

A hand-written MoE block (Mixtral's as transformers 4.x wrote it, most MoEs
outside a library) routes its tokens in Python no tracer follows, and ep does
not rewrite what it cannot read: :func:`reroute` replaces the block's forward
by :func:`autopar.capturing.moe_reroute.rerouted` — the block's own code run
twice, recording the rows each expert is called on, then replaying its
experts' outputs — with the experts' outputs computed across the ep group by
:func:`autopar.passes.expert_dispatch.exchange` (the all-to-all dispatch and
combine the fused layout uses). The router's indices and weights are the
model's own; :func:`list_refusal` proves the rerouting exact on this model's
block before anything is lowered (``moe_reroute.prove``), and names the layer
and the reason where it is not.

**Layout.** Rank ``i`` of an ep group keeps experts ``[i·E/ep, (i+1)·E/ep)``
as they are (plain parameters under their own FQNs); the others become
:class:`Elsewhere` (no parameters), and the module list a
:class:`LocalExperts`, called on the rows its experts received. Their
gradients are reduced over the expert-data-parallel group as the fused
experts' are (:func:`autopar.passes.expert_parallel.reduce_expert_grads`, one
flat all-reduce per block), or, at ZeRO ≥ 1 with an edp group, the module list
is an FSDP2 unit over that group, its experts' weight gradients scaled by
1/ep on the way (``scale``). Full state dicts, exports and the gradient norm
gather or count them over the ep group (``autopar/runtime/lowering.py``:
``held_group``).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from autopar.capturing.moe_reroute import out_width, proof, rerouted, router_width
from autopar.experts import MoEFacts
from autopar.passes.expert_dispatch import ScaleGrad, exchange


class Elsewhere(nn.Module):
    """Stands for an expert another rank of the ep group holds (no parameters)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def extra_repr(self) -> str:
        return f"held by ep rank {self.rank}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"this expert is held by ep rank {self.rank}: it runs there (passes/expert_list.py)")


def list_refusal(model: nn.Module, layer: str, facts: MoEFacts) -> str | None:
    """Why ep cannot reroute this module-list block (None when the proof passes: module docstring)."""
    try:
        block = model.get_submodule(facts.module_path)
        experts = model.get_submodule(facts.experts_path)
    except AttributeError:
        return f"layer {layer!r}: no MoE block {facts.module_path!r} with experts {facts.experts_path!r}"
    name = facts.experts_path.rsplit(".", 1)[-1]
    if block._modules.get(name) is not experts or not isinstance(experts, nn.ModuleList):
        return f"layer {layer!r}: experts {facts.experts_path!r} are not a module list child of its block"
    if why := proof(block, name, facts.num_experts):
        return (f"layer {layer!r}: ep cannot reroute the loop of {facts.module_path!r} "
                f"({type(block).__name__}): {why}")
    return None


# ----------------------------------------------------------------------------- the lowering


def _call(expert: nn.Module, rows: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One local expert on its rows, in the rows' dtype (a bf16 plan computes on bf16 copies of fp32
    weights, whose gradients autograd casts back, as for the fused experts); ``scale``: its weights'
    gradient times ``scale`` and its input's unchanged (the output's gradient scaled, the input's
    unscaled on the way back)."""
    if scale is not None:
        rows = ScaleGrad.apply(rows, 1.0 / scale)
    params = dict(expert.named_parameters())
    if any(p.dtype != rows.dtype for p in params.values()):
        out = torch.func.functional_call(expert, {n: p.to(rows.dtype) for n, p in params.items()}, (rows,))
    else:
        out = expert(rows)
    return ScaleGrad.apply(out, scale) if scale is not None else out


def _run_local(self: nn.ModuleList, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The module list's forward under ep: rows grouped by local expert (``counts`` each) through them.
    Every local expert runs, on no rows too, so each of its weights has a gradient every step."""
    first, scale = self._autopar_ep_list
    return torch.cat([_call(self[first + j], piece, scale) for j, piece in enumerate(rows.split(counts))])


class LocalExperts(nn.ModuleList):
    """A block's module list under ep: this rank's experts and :class:`Elsewhere` for the others, called
    on the rows its experts received (:func:`_run_local`)."""

    forward = _run_local


def _block_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    name, e, width, hidden, group, ep = self._autopar_ep_block
    experts = self._modules[name]

    def run(rows: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        like = next((x for x in rows if x is not None), None)
        if like is None:  # no expert called: still exchange (every rank of the ep group must)
            like = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)).new_zeros(0, hidden)
        flat = torch.cat([x if x is not None else like[:0] for x in rows])
        counts = torch.tensor([0 if x is None else x.shape[0] for x in rows], dtype=torch.int64,
                              device=flat.device)
        back = exchange(flat, counts, group, ep, experts)
        return list(back.split(counts.tolist()))

    return rerouted(self, name, e, width, run, args, kwargs)


def reroute(model: nn.Module, facts: MoEFacts, emesh: Any, scale: float | None) -> list[nn.Module]:
    """Keep this rank's experts of the block, the others :class:`Elsewhere`; its forward rerouted
    (requires :func:`list_refusal` passed). Returns the local experts."""
    block = model.get_submodule(facts.module_path)
    name = facts.experts_path.rsplit(".", 1)[-1]
    experts: nn.ModuleList = block._modules[name]
    ep, rank = emesh["ep"].size(), emesh["ep"].get_local_rank()
    per = facts.num_experts // ep
    hidden = router_width(block, name, facts.num_experts)
    width = out_width(experts[0], hidden)
    for e in range(facts.num_experts):
        if e // per != rank:
            experts[e] = Elsewhere(e // per)
    experts._autopar_ep_list = (rank * per, scale)
    experts.__class__ = LocalExperts  # callable (an FSDP2 unit over edp must be a module with a forward)
    block._autopar_ep_block = (name, facts.num_experts, width, hidden, emesh["ep"].get_group(), ep)
    block.forward = types.MethodType(_block_forward, block)
    return [experts[e] for e in range(rank * per, (rank + 1) * per)]


__all__ = ["Elsewhere", "LocalExperts", "list_refusal", "reroute"]
