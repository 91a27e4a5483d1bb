"""Expert parallelism: each MoE block's experts sharded on their expert dim over an ``ep`` group.

Takes one part of the model (the whole model, or one pipeline stage whose layer
modules are called: :func:`autopar.contract.ep_refusal`), the plan restricted to
that part's layers, the device mesh and the part's units, and returns an
:class:`ExpertParallelResult`. What stays true: parameter FQNs are unchanged (an
expert weight keeps its name and its global shape ``[E, …]`` as a DTensor), and after
:func:`reduce_expert_grads` every expert gradient is the mean over the whole
dp (× cp) group, as one device would compute it.

**Layout** (torchtitan's and Megatron-Core's "parallel folding"): ``ep``
borrows its ranks from ``dp`` × ``cp`` — the device mesh stays (pp, dp, cp, tp)
for the dense layers, and the dp axis (under cp, dp × cp flattened) is
unflattened into (``edp``, ``ep``) for the experts (:func:`expert_mesh`; ep
innermost, so an ep group is ep neighbouring ranks of dp × cp — the cp ranks of
a sample first — which is where pricing places it, :meth:`autopar.mesh.Mesh.stride`).
Under cp a rank's MoE blocks route and dispatch its S/cp tokens: the routers are
per token (no capacity rule: ``contract.cp_refusal``), so no routing decision
changes, and each expert gradient is the mean over dp × cp.
Rank ``i`` of an ep group holds experts ``[i·E/ep, (i+1)·E/ep)``, as a
DTensor on that 2-D mesh placed (Replicate, Shard(0)): the runtime's full
state dict, gradient norm and checkpoints read it as any other DTensor.

**Inside pipeline stages** (pp > 1) the same pass runs on each stage of this rank
(:func:`autopar.passes.parallelize.parallelize_part`): a stage calls the model's own
layer modules, so its experts modules are the model's, rerouted as above. The dp
axis unflattened is this pipeline rank's, so an ep group is ep dp ranks holding
the same stages and running the same schedule: their all-to-alls come in the same
order on each. The schedule divides the stage's gradients by the microbatch count
before :func:`reduce_expert_grads` sums them over the edp group and divides by dp.

**Forward** of an experts module, in whatever layout its weights are held (``autopar.experts.calls``):
the router runs replicated, on this rank's own tokens, exactly as written (fp32 scores where the model
computes them so). The block's call of its experts is rerouted by its convention, recorded and proved
splittable at capture (:class:`autopar.experts.Call`): Hugging Face's ``experts(hidden, top_k_index,
top_k_weights)`` (Mixtral, Qwen2-MoE, DeepSeek-V3, gpt-oss) has its T·k routed rows sorted by expert;
torchtitan's ``experts(rows sorted by expert, rows per expert)`` comes sorted; Llama 4's
``experts(rows [E·T, H])`` is expert-major. The per-expert row counts are exchanged (one small
all-to-all), the rows dispatched to the rank holding their expert with
``torch.distributed._functional_collectives.all_to_all_single_autograd`` (its backward is the reverse
all-to-all; Llama 4's equal blocks by ``passes/expert_capacity.py``'s even all-to-all on E), run
through the module's **own forward** on this rank's slice of its ``[E, …]`` weights (so biases,
clamped or interleaved gates and grouped GEMMs run as written), sent back, and — for Hugging Face's
call — weighted by the router's top-k weights and summed per token (``index_add``) as its forward
does. Routing is decided before any dispatch, by the replicated router on the same tokens one device
would see, so ep changes no routing decision. The ``top_k_index`` a Hugging Face experts module is
called with is also what ``compile(..., moe_bias_update=γ)`` counts, before this forward moves any
row (``autopar/runtime/balance.py``): a DeepSeek-V3 router's bias then moves by the counts of the
whole dp × cp group, ep's ranks among them.

**Capacity blocks** (GShard/Switch: one-hot einsum dispatch into [E, C, H], the block's own 3-D
experts) run their own forward with the expert region between dispatch and combine split on E
(all-to-all of the dispatched tensor, forward and back): ``passes/expert_capacity.py``.

**Module lists** (a hand-written block's ``nn.ModuleList`` of experts, run by
its own loop) take the same dispatch and combine (:func:`exchange`) from the
block's own forward, run twice (record, replay): ``passes/expert_list.py``.
Each rank keeps its experts whole, as plain parameters under their own FQNs.

**Gradients.** The data-parallel engines must not average expert gradients
over dp: ranks of one ep group hold *different* experts, so DDP's or FSDP2's
average over the whole dp group would mix them. The exact route is to
leave the expert weights out of the dp engine (``ignored_modules`` for the
composable DDP, ``ignored_params`` for FSDP2's ``replicate``/``fully_shard``)
and reduce them here, once per step after the last microbatch
(:func:`reduce_expert_grads`): rank q's expert gradient already sums, through
the all-to-all's backward, the contributions of every token of its ep group,
so a sum over the expert-data-parallel group (the (dp × cp)/ep ranks holding the
same experts) adds the rest of dp × cp, and dividing by dp × cp gives the global-batch
mean each rank's loss (its own mean) stands for. An MoE layer at ZeRO ≥ 1
(with an edp group of 2 or more) runs its dense weights (router, shared
experts, attention) at that stage over dp, and its experts module becomes
an FSDP2 unit of its own over the edp group (``passes.zero.shard_experts``, called
by the data-parallel pass, innermost): FSDP2 shards the ep DTensors 2-D
over (edp, ep) as it does tensor-parallel weights over (dp, tp), and
averages their gradients over edp; the experts' forward scales their
weights' gradient by 1/ep on the way (``ScaleGrad``), so that average is
the mean over dp (gloo has no pre-multiplied sum for FSDP2's own divide
factor). ZeRO-1 there runs as ZeRO-2 (the unit reduce-scatters every
microbatch), and is priced so (``planning/pricing.py``). A
replicated plan over dp alone runs its dense weights on the composable DDP
with the experts left out (``ignored_modules``), as hand-written EP does;
beside tp or pp, on FSDP2's ``replicate`` (:func:`autopar.contract.plan_engine`).
DDP is given the dp process group, not the dp mesh: a mesh sliced from the
plan's adds DDP's TP hooks, which would turn every DTensor parameter of its
root, the ignored experts included, into a plain tensor after each forward.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from autopar.admission import expert_parallel_refusals
from autopar.contract import Unit, data_ranks
from autopar.errors import LoweringError
from autopar.experts import Call, Dispatch, ExpertLayout, MoEFacts
from autopar.experts.calls import indexed, run_local
from autopar.graph import LayerGraph
from autopar.passes.expert_capacity import from_experts, to_experts
from autopar.passes.expert_dispatch import ScaleGrad, exchange
from autopar.plan import Plan


@dataclass
class ExpertParallelResult:
    """The experts this part shards: their modules, their DTensor weights, the groups they reduce over."""

    modules: list[nn.Module] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)  # outside any FSDP2 unit: reduced here
    sharded: list[tuple[nn.Module, int]] = field(default_factory=list)  # (experts, ZeRO stage) FSDP2 shards
    # a module list's local experts: modules whose parameters (plain, or FSDP2's over edp) this rank of
    # the ep group alone holds (full state dicts gather them over the ep group; the gradient norm counts
    # them on 1/ep of the ranks). Modules, not parameters: FSDP2 replaces a unit's parameters
    held: list[nn.Module] = field(default_factory=list)
    buckets: list[list[nn.Parameter]] = field(default_factory=list)  # a module list's, one all-reduce each
    ep_group: Any = None
    edp_mesh: Any = None
    edp_group: Any = None
    dp: int = 1  # the ranks every expert gradient is the mean over: dp × cp (contract.data_ranks)


def moe_blocks(graph: LayerGraph, plan: Plan) -> list[tuple[str, MoEFacts]]:
    """(layer name, block) for every MoE block of the plan's layers."""
    return [(lp.name, m) for lp in plan.layers for m in graph.layer(lp.name).moe]


def _refusal(model: nn.Module, name: str, facts: MoEFacts, ep: int) -> str | None:
    """What the module says against ep on block ``facts`` (admission has found ``ep`` divides its experts)."""
    if facts.layout is ExpertLayout.MODULE_LIST:  # the block's own loop, rerouted where it is proved
        from autopar.passes.expert_list import list_refusal

        return list_refusal(model, name, facts)
    if facts.block_held and facts.dispatch is Dispatch.CAPACITY:  # GShard/Switch: passes/expert_capacity.py
        from autopar.passes.expert_capacity import capacity_refusal

        return capacity_refusal(model, name, facts)
    if facts.ep_refusal:  # capture's proof of the block's call of its experts (autopar.capturing.moe_calls)
        return f"layer {name!r}: {facts.ep_refusal}"
    try:
        experts = model.get_submodule(facts.experts_path)
    except AttributeError:
        return f"layer {name!r}: no experts module {facts.experts_path!r} in the model"
    own = {n: tuple(p.shape) for n, p in experts.named_parameters(recurse=False)}
    if facts.call is Call.NONE or not facts.per_expert or any(
            own.get(n, (0,))[0] != facts.num_experts for n in facts.per_expert):
        return (f"layer {name!r}: experts {facts.experts_path!r} ({type(experts).__name__}, parameters {own}) "
                f"are not the [E, …] weights capture proved ep splits ({list(facts.per_expert)}, called as "
                f"{facts.call})")
    return None


def check_expert_parallel(model: nn.Module, graph: LayerGraph, plan: Plan) -> None:
    """Raise a :class:`LoweringError` naming every reason ``plan``'s ep cannot run on ``model`` (before any
    collective): admission's rules (:func:`autopar.admission.expert_parallel_refusals`), then what only the
    module says (its experts are the weights, or the loop, capture proved)."""
    if plan.mesh.ep <= 1:
        return
    if found := expert_parallel_refusals(graph, plan):
        raise LoweringError("; ".join(found[:3]))
    problems = [why for name, facts in moe_blocks(graph, plan) if (why := _refusal(model, name, facts, plan.mesh.ep))]
    if problems:
        raise LoweringError("; ".join(problems[:3]))


def expert_mesh(mesh: Any, ep: int) -> Any:
    """The ranks ep borrows — ``mesh``'s dp axis, or under cp its dp × cp flattened
    (:func:`autopar.passes.context_parallel.data_mesh`) — unflattened into (``edp``, ``ep``), ep innermost
    (a collective on first call: every rank calls it, for the same mesh, before any part is lowered;
    cached after). Under cp an ep group is ep neighbours of the flattened dp × cp, the cp ranks of one
    sample first (:mod:`autopar.mesh`), and edp the (dp × cp)/ep ranks holding the same experts."""
    from autopar.passes.context_parallel import data_mesh

    # cached on the mesh itself: a module-level cache kept every mesh, and with it every process group
    # its sub-meshes made, alive after the job (or test case) that made it had ended
    cache = mesh.__dict__.setdefault("_autopar_expert_meshes", {})
    if ep not in cache:
        cp = mesh["cp"].size() if "cp" in (mesh.mesh_dim_names or ()) else 1
        host = data_mesh(mesh, cp)
        cache[ep] = host._unflatten(0, (host.size() // ep, ep), ("edp", "ep"))
    return cache[ep]


def _shard(experts: nn.Module, facts: MoEFacts, emesh: Any) -> list[nn.Parameter]:
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = emesh["ep"].size(), emesh["ep"].get_local_rank()
    made = []
    for name in facts.per_expert:
        full = getattr(experts, name)
        local = full.detach().chunk(ep, dim=0)[rank].clone()
        param = nn.Parameter(DTensor.from_local(local, emesh["ep"], [Shard(0)], run_check=False),
                             requires_grad=full.requires_grad)
        setattr(experts, name, param)
        made.append(param)
    return made


def apply_expert_parallel(module: nn.Module, graph: LayerGraph, plan: Plan, mesh: Any,
                          units: tuple[Unit, ...]) -> ExpertParallelResult:
    """Shard the experts of every MoE block of ``module``'s layers over ``mesh``'s ep groups and route
    their tokens with all-to-all (see the module docstring).

    Requires: :func:`check_expert_parallel` passed; ``module`` unsharded (its expert weights whole);
    ``units`` the part's data-parallel units from the contract (its experts' ZeRO stage).
    """
    ep = plan.mesh.ep
    emesh = expert_mesh(mesh, ep)
    edp = emesh["edp"].size()
    result = ExpertParallelResult(edp_group=emesh["edp"].get_group() if edp > 1 else None, dp=data_ranks(plan.mesh),
                                  edp_mesh=emesh["edp"], ep_group=emesh["ep"].get_group())
    zeros = expert_zeros(graph, plan, units)
    for name, facts in moe_blocks(graph, plan):
        experts = module.get_submodule(facts.experts_path)
        sharded = zeros[name] >= 1 and edp > 1
        if facts.layout is ExpertLayout.MODULE_LIST:  # its own loop rerouted: passes/expert_list.py
            from autopar.passes.expert_list import reroute

            local = reroute(module, facts, emesh, 1.0 / ep if sharded else None)
            result.held += local
            made = [p for m in local for p in m.parameters()]
            if sharded:
                result.sharded.append((experts, zeros[name]))
            else:
                result.buckets.append(made)
            result.modules.append(experts)
            continue
        if facts.block_held and facts.dispatch is Dispatch.CAPACITY:  # passes/expert_capacity.py
            from autopar.passes.expert_capacity import holder, split_region

            made = split_region(module, facts, emesh)
            result.params += made  # whole over edp at every ZeRO stage, reduced by reduce_expert_grads
            result.modules.append(holder(made))  # the dp engine ignores these, not the block's router
            continue
        made = _shard(experts, facts, emesh)
        # FSDP2 over edp averages a gradient over its edp ranks; the weights' gradient scaled by 1/ep on the
        # way makes that the mean over dp (each rank's experts already sum their ep group's tokens)
        experts._autopar_ep = _EpCall(emesh["ep"].get_group(), ep, 1.0 / ep if sharded else None, facts.call,
                                      facts.per_expert, facts.num_experts, type(experts).forward)
        experts.forward = types.MethodType(_ep_forward, experts)
        if sharded:  # FSDP2 wraps it in the data-parallel pass (after recompute): shard_experts
            result.sharded.append((experts, zeros[name]))
        else:
            result.params += made
        result.modules.append(experts)
    return result


def expert_zeros(graph: LayerGraph, plan: Plan, units: tuple[Unit, ...]) -> dict[str, int]:
    """The ZeRO stage each MoE layer of ``plan``'s layers runs at: the stage of the contract's unit
    holding it among ``units`` (the part's; 0 outside any), which is
    :func:`autopar.contract.effective_zero`'s. Read from the part's units, not recomputed from
    ``plan``: a pipeline stage's plan holds its own layers only, and the plan's data-parallel mode
    is the whole plan's. The experts take that stage over the edp group."""
    holder = {name: u.zero for u in units for name in u.layers}
    return {lp.name: holder.get(lp.name, 0) for lp in plan.layers if graph.layer(lp.name).moe}


@dataclass(frozen=True)
class _EpCall:
    """What an experts module's forward under ep needs: its ep group, the gradient scale FSDP2 over edp
    needs (None outside it), how its block calls it, its [E, …] weights and its own forward."""

    group: Any
    ep: int
    scale: float | None
    call: Call
    names: tuple[str, ...]
    num_experts: int
    forward: Any


def _local_weights(experts: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's slice of the experts' weights, for one call of their own forward."""
    # a bf16 plan: the experts stay fp32 (FSDP2's policy does not reach them), computed on bf16 copies
    # whose gradients autograd casts back to fp32, as FSDP2's MixedPrecisionPolicy does for the rest
    spec: _EpCall = experts._autopar_ep
    weights = {n: getattr(experts, n).to_local() for n in spec.names}
    weights = {n: w.to(dtype) if w.is_floating_point() else w for n, w in weights.items()}
    if spec.scale is not None:
        weights = {n: ScaleGrad.apply(w, spec.scale) for n, w in weights.items()}
    return weights


def _run_local(experts: nn.Module, rows: torch.Tensor, counts: list[int],
               like: torch.Tensor | None = None) -> torch.Tensor:
    """Rows grouped by local expert (``counts`` each) through the module's own forward on this rank's
    weights (``autopar.experts.calls.run_local``)."""
    spec: _EpCall = experts._autopar_ep
    weights = _local_weights(experts, rows.dtype)
    out = run_local(experts, spec.forward, spec.call, weights, rows, counts, like)
    # no rows for any local expert: keep the weights (a zero gradient) and the received rows in the graph,
    # so that every rank of the ep group runs the dispatch's backward all-to-all: a rank whose output did
    # not depend on its received rows would skip it and leave its peers waiting (seen in a pipeline's
    # first-step shape inference, which routes every token of its zero inputs alike)
    return out + 0.0 * (rows.sum() + sum(w.sum() for w in weights.values() if w.is_floating_point()))


def _ep_forward(self: nn.Module, *args: Any) -> torch.Tensor:
    """The experts' forward under ep, per the block's call (``autopar.experts.calls``): dispatch, local
    experts, combine."""
    spec: _EpCall = self._autopar_ep
    group, ep, e = spec.group, spec.ep, spec.num_experts
    if spec.call is Call.INDEXED:
        return indexed(*args, e, lambda rows, counts: exchange(rows, counts, group, ep,
                                                               lambda r, n: _run_local(self, r, n)))
    if spec.call is Call.GROUPED:
        rows, counts = args
        return exchange(rows, counts.long(), group, ep, lambda r, n: _run_local(self, r, n, counts))
    rows = args[0]  # BLOCKED: [E·T, H], expert-major; this rank's experts take every ep rank's blocks
    t, h = rows.shape[0] // e, rows.shape[-1]
    got = to_experts(rows.view(e, t, h), group, ep)  # [E/ep, ep·T, H]
    out = _run_local(self, got.reshape(-1, h), [ep * t] * (e // ep))
    return from_experts(out.view(e // ep, ep * t, h), group, ep).reshape(e * t, h)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def sync_expert_replicas(result: ExpertParallelResult) -> None:
    """Broadcast each expert shard from the first rank of its expert-data-parallel group (a collective):
    a model materialised from the meta device draws its shards rank by rank; the edp ranks must agree."""
    import torch.distributed as dist

    if result.edp_group is None:
        return
    src = dist.get_global_rank(result.edp_group, 0)
    with torch.no_grad():
        for p in [*result.params, *(p for bucket in result.buckets for p in bucket)]:
            dist.broadcast(_local(p), src=src, group=result.edp_group)


def reduce_expert_grads(result: ExpertParallelResult) -> None:
    """Every expert gradient the mean over dp: summed over the expert-data-parallel group, divided by dp
    (after the step's last backward; a collective over each edp group)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for p in result.params:
        if p.grad is None and isinstance(p, DTensor):  # no token reached this rank's experts: still reduced
            p.grad = DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh, p.placements,
                                        run_check=False)
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
        local = _local(p.grad)
        if result.edp_group is not None:
            dist.all_reduce(local, group=result.edp_group)
        local.div_(result.dp)
    for bucket in result.buckets:  # a module list's local experts: one flat all-reduce per block
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if result.edp_group is not None:
            dist.all_reduce(flat, group=result.edp_group)
        flat.div_(result.dp)
        for p, piece in zip(bucket, flat.split([g.numel() for g in grads])):
            p.grad = piece.view_as(p)


__all__ = ["ExpertParallelResult", "apply_expert_parallel", "check_expert_parallel", "expert_mesh",
           "expert_zeros", "moe_blocks", "reduce_expert_grads", "sync_expert_replicas"]
