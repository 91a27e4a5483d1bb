"""Expert parallelism for experts held as an ``nn.ModuleList`` and run by the block's own loop.

A hand-written MoE block (Mixtral's as transformers 4.x wrote it, most MoEs
outside a library) routes its tokens in Python: router, softmax, top-k,
renormalise, then a loop over its experts, each called on the rows routed to
it (gathered by ``torch.where`` and indexing), its output weighted and
``index_add``-ed. No tracer follows that loop, and ep must not rewrite what it
cannot read. So the block's own code runs, twice, with its experts swapped for
stand-ins (:class:`_Tape`):

1. **record**: the block's forward runs as written; each stand-in notes the rows
   its expert is called on (and returns zeros of the expert's output width);
2. **dispatch**: those rows, sorted by expert, go to the rank of the ep group
   holding each expert, run through the real expert there and come back
   (:func:`autopar.passes.expert_parallel.exchange`, the all-to-all dispatch and
   combine the fused layout uses);
3. **replay**: the block's forward runs again from the same RNG state; each
   stand-in returns its expert's outputs from step 2 (after checking it was
   called on as many rows as in step 1), and the block weights and combines
   them with its own code.

So the router's indices and weights are the model's own, from the model's own
code, and the combine is the block's. Gradients: the router's and the
weights' through the replay; the routed rows' through the record's gathers
and the all-to-all's backward; the experts' through the dispatch. The record's
other work (the router's scores, any shared expert) is computed and discarded:
one more forward of the block's dense part, which pricing does not count.

**Proof before lowering** (:func:`list_refusal`): on a copy of the block
(random weights where the model is on the meta device) and random hidden
states, the three steps with the experts run in place (ep = 1's semantics)
must give the block's own output and the same gradients for the input and
every parameter, each expert must be called at most once a pass, on one
tensor, row by row (its output on the rows split in two equals its output on
them whole, and it runs on no rows). A block that fails is refused with the
reason, naming the layer: ep never runs what it could not check.

**Layout.** Rank ``i`` of an ep group keeps experts ``[i·E/ep, (i+1)·E/ep)``
as they are (plain parameters under their own FQNs); the others are replaced
by :class:`Elsewhere` (no parameters). Their gradients are reduced over the
expert-data-parallel group as the fused experts' are
(:func:`autopar.passes.expert_parallel.reduce_expert_grads`), or, at ZeRO ≥ 1,
the module list is an FSDP2 unit over that group (called as a module: its
forward runs the local experts).
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from autopar.capturing.moe_reroute import out_width, proof, rerouted, router_width
from autopar.moe import MoEFacts
from autopar.passes.expert_parallel import ScaleGrad, exchange


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
