"""ZeRO and data parallelism: the contract's FSDP units over the dp axis.

Takes one part of the model (the whole model, or one pipeline stage) after
tensor parallelism and recompute, the part's units from the contract
(:meth:`autopar.contract.Layout.stage_units`: which module each unit wraps,
its ZeRO stage and engine) and the ``dp`` axis of the device mesh. Returns a
:class:`DataParallelResult`. What stays true: parameter FQNs are unchanged;
after a step's last backward every gradient is the mean over the dp group.
Which module gets which unit is decided by :mod:`autopar.contract` alone,
so what runs is what pricing priced.

| zero | engine | between microbatches |
| --- | --- | --- |
| 3 | ``fully_shard(reshard_after_forward=True)`` | grads reduce-scattered each microbatch |
| 2 | ``fully_shard(reshard_after_forward=False)`` | grads reduce-scattered each microbatch |
| 1 | ``fully_shard(reshard_after_forward=False)`` | *deferred*: unsharded grads accumulate, params stay gathered |
| 0 | ``replicate`` (FSDP2-based, ``replicate_with_fsdp``) or DDP | *deferred*: grads accumulate, all-reduce once |

**Hybrid sharding** (HSDP, a plan's ``dp_replicate`` R > 1: :mod:`autopar.contract_hsdp`): every
``fully_shard`` unit gets the 2-D mesh (``dp_replicate``, ``dp_shard_cp``) unflattened from the data mesh
(:func:`hsdp_mesh`), on which FSDP2 shards over the second dimension and all-reduces each reduce-scattered
gradient over the first, dividing by both; ``replicate`` units, 0-d parameters and DDP keep the 1-D
data mesh (all dp × cp ranks).

*Deferred* modules are listed in the result; the runtime calls
``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``
on them for every microbatch but the last (:func:`set_last_microbatch`). With
one microbatch ZeRO-1 and ZeRO-2 run alike; the optimizer state is sharded in
both because the optimizer sees the sharded parameters. The FSDP2-based
``replicate`` is used beside ``fully_shard`` rather than the DDP-based one
because it composes with ``fully_shard`` on sibling modules in one model.

Mixed precision (a bf16 plan): every FSDP2 unit gets
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` — its sharded
fp32 parameters are the master weights the optimizer steps, compute runs on
the bf16 copies it gathers, gradients are reduced and accumulated in fp32.
DDP has no such policy that works composably (its experimental
``_MixedPrecision`` casts nothing on its lazy first forward), so a bf16 DDP
root keeps its gradients as views of its buckets and the runtime gives it
bf16 parameters, fp32 masters and an fp32 all-reduce
(:mod:`autopar.runtime.precision`). The dtype comes from
:func:`compute_dtype`, set by the runtime around lowering, or from
``apply_data_parallel(param_dtype=...)``.

**Parameters FSDP2 cannot shard** (0-d: CLIP's ``logit_scale``; FSDP2's
``replicate`` and ``fully_shard`` both refuse a scalar) stay out of every
unit (``ignored_params``) and whole on every rank, in their own dtype: after
each backward their gradient is all-reduced over the dp group and divided by
its size (:func:`keep_whole`), the mean one device computes; summing the
accumulated gradient of every microbatch is exact too (what earlier
microbatches left is already equal on every rank). Each is one element per
rank, what a sharded 1-element tensor holds once FSDP2 pads it, so memory is
as priced. They are broadcast from the group's first rank at start
(:func:`sync_replicas`), so a model materialised from the meta device agrees.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from autopar.contract import ROOT, Engine, Unit, plan_layout, wrapping
from autopar.errors import LoweringError
from autopar.graph import LayerGraph
from autopar.plan import Plan


@dataclass
class DataParallelResult:
    """Which module got which zero stage, and the modules whose gradient sync is deferred."""

    zero_by_path: dict[str, int] = field(default_factory=dict)
    deferred: list[nn.Module] = field(default_factory=list)
    ddp: nn.Module | None = None  # the root, when lowered onto the composable DDP
    ddp_ignored: tuple[nn.Module, ...] = ()  # modules DDP leaves out (ep's experts: each rank's own)
    whole: list[nn.Parameter] = field(default_factory=list)  # 0-d: outside every FSDP2 unit (keep_whole)
    param_dtype: torch.dtype | None = None  # the units' compute dtype (None: the parameters' own)


_COMPUTE_DTYPE: ContextVar[torch.dtype | None] = ContextVar("autopar_compute_dtype", default=None)


@contextmanager
def compute_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Units wrapped inside compute in ``dtype`` (bf16) with fp32 reduction; None or fp32: as they are.

    The runtime sets it around lowering, so the data-parallel pass sees the plan's precision
    without another argument through the pass manager."""
    token = _COMPUTE_DTYPE.set(None if dtype == torch.float32 else dtype)
    try:
        yield
    finally:
        _COMPUTE_DTYPE.reset(token)


def mixed_precision_policy(dtype: torch.dtype | None):
    """FSDP2's policy for ``dtype`` compute: parameters gathered in it, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def layer_zero_stages(graph: LayerGraph, plan: Plan) -> tuple[dict[str, int], int]:
    """(ZeRO stage per block module path, ZeRO stage of the root) the contract gives a
    one-part plan: what each module's parameters run at, whatever the engine."""
    layout = plan_layout(graph, plan)
    owned = {role.unit: role.zero for role in layout.layers if role.unit not in (None, ROOT)}
    root = next((u.zero for u in layout.stage_units(0) if u.path == ROOT), 0)
    if layout.engine in (Engine.DDP, Engine.REPLICATE):  # one unit holds every layer
        owned = {layer.module_path: 0 for layer, own in zip(graph, wrapping(graph, plan.mesh.pp).own) if own}
    return owned, root


def scalar_params(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s 0-d parameters (each once): what FSDP2's units cannot shard or replicate."""
    return list({id(p): p for p in module.parameters() if p.dim() == 0}.values())


def keep_whole(params: list[nn.Parameter], dp_mesh) -> None:
    """After each backward, every one of ``params``' gradient the mean over ``dp_mesh``'s group: a
    hook on its accumulation (one all-reduce of one element per parameter and microbatch)."""
    import torch.distributed as dist

    group, size = dp_mesh.get_group(), dp_mesh.size()

    def mean(p: torch.Tensor) -> None:
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(size)

    for p in params:
        p.register_post_accumulate_grad_hook(mean)


HSDP_DIMS = ("dp_replicate", "dp_shard_cp")  # FSDP2's HSDP mesh: replicas outermost, the shard group inside


def hsdp_mesh(dp_mesh, replicas: int):
    """The 2-D device mesh (R replicas, the rest of ``dp_mesh``) of hybrid sharding; None at ``replicas`` 1.

    The data mesh's ranks unflattened with the replicas outermost, as :mod:`autopar.mesh` lays
    ``dp_replicate`` out (a collective on first call: every rank calls it, for the same mesh; cached on the
    mesh, as ``passes.expert_parallel.expert_mesh`` caches its own)."""
    if replicas <= 1:
        return None
    cache = dp_mesh.__dict__.setdefault("_autopar_hsdp_meshes", {})
    if replicas not in cache:
        cache[replicas] = dp_mesh._unflatten(0, (replicas, dp_mesh.size() // replicas), HSDP_DIMS)
    return cache[replicas]


def _wrap(module: nn.Module, unit: Unit, dp_mesh, dtype: torch.dtype | None,
          ignored: tuple[nn.Module, ...] = (), whole: tuple[nn.Parameter, ...] = (), shard_mesh=None) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    if unit.engine is Engine.DDP:
        # The composable (DDP-based) replicate buckets gradients and overlaps their
        # all-reduce with backward, keeping FQNs. FSDP2's replicate at the root cost
        # 1.22× DDP's step in benchmarks/runtime_overhead.py on gloo. DDP keeps its
        # gradient buckets beside the gradients (priced in planning/pricing.py).
        # init_sync=False: DDP's own start-up sync broadcasts one flat copy of every
        # parameter (flatten_dense_tensors), whose free can land on a gloo worker thread,
        # which the profiler does not see (benchmarks/fidelity.py then counted it live
        # for the whole run); sync_replicas broadcasts each tensor in place instead.
        from torch.distributed._composable.replicate import replicate as ddp_replicate

        # bf16: gradients as views of the buckets, so the bf16 gradients cost no second copy
        # (the fp32 all-reduce hook is the runtime's: it needs the master weights)
        # Under ep the experts are left out (reduced over edp by passes/expert_parallel.py), and DDP
        # gets the dp group, not the dp mesh: a mesh sliced from the plan's adds the TP hooks, which
        # turn every DTensor parameter, the ignored experts included, into a plain one after each
        # forward (DDP is the engine only where dp is the one axis above 1: no tp DTensor to keep)
        ddp_replicate(module, ignored_modules=ignored or None, process_group=dp_mesh.get_group(),
                      init_sync=False, gradient_as_bucket_view=dtype is not None)
        return
    inside = ({p for m in ignored for p in m.parameters()} | set(whole)) & set(module.parameters())
    if unit.engine is Engine.REPLICATE:
        replicate(module, mesh=dp_mesh, mp_policy=mixed_precision_policy(dtype), ignored_params=inside or None)
    else:
        fully_shard(module, mesh=dp_mesh if shard_mesh is None else shard_mesh, reshard_after_forward=(unit.zero == 3),
                    mp_policy=mixed_precision_policy(dtype), ignored_params=inside or None)


def apply_data_parallel(part: nn.Module, units: tuple[Unit, ...], dp_mesh, *,
                        param_dtype: torch.dtype | None = None,
                        ignored: tuple[nn.Module, ...] | list[nn.Module] = (),
                        experts=None, replicas: int = 1) -> DataParallelResult:
    """Wrap each of the part's ``units`` (innermost first, the root last) over ``dp_mesh``.

    ``ignored`` modules' parameters stay out of every unit: the experts under ep at ZeRO-0, which
    ``passes/expert_parallel.py`` reduces over their expert-data-parallel group instead; ``experts``
    (a ``passes.expert_parallel.ExpertParallelResult``) has its ZeRO ≥ 1 experts wrapped first, as
    units of their own over that group. ``replicas``: the plan's ``dp_replicate`` (HSDP above 1: the
    ``fully_shard`` units over :func:`hsdp_mesh`).

    ``param_dtype`` (default: :func:`compute_dtype`'s) is the compute dtype of a bf16 plan.
    Requires: tensor parallelism and recompute already applied (FSDP2 must see the
    DTensor parameters TP made, so on a 2-D mesh it shards over dp after tp), and the
    units' modules present in ``part``.
    """
    dtype = param_dtype if param_dtype is not None else _COMPUTE_DTYPE.get()
    dtype = None if dtype == torch.float32 else dtype
    if experts is not None:  # ep: experts at ZeRO ≥ 1 are units of their own over edp, innermost
        shard_experts(experts, dtype)
    result = DataParallelResult(param_dtype=dtype)
    if any(unit.engine is not Engine.DDP for unit in units):  # DDP takes 0-d parameters as they are
        own = {id(p) for m in ignored for p in m.parameters()}
        result.whole = [p for p in scalar_params(part) if id(p) not in own]
        keep_whole(result.whole, dp_mesh)
    for unit in units:
        try:
            module = part.get_submodule(unit.path)
        except AttributeError:
            raise LoweringError(f"the contract gives module {unit.path!r} an FSDP unit, but this "
                                "part of the model has no such module") from None
        _wrap(module, unit, dp_mesh, dtype, tuple(ignored), tuple(result.whole), hsdp_mesh(dp_mesh, replicas))
        result.zero_by_path[unit.path] = unit.zero
        if unit.deferred:
            result.deferred.append(module)
        if unit.engine is Engine.DDP:
            result.ddp, result.ddp_ignored = module, tuple(ignored)
    return result


def shard_experts(experts: Any, dtype: torch.dtype | None) -> None:
    """Each experts module of a layer at ZeRO ≥ 1 an FSDP2 unit of its own over the edp group
    (``experts``: a ``passes.expert_parallel.ExpertParallelResult``; called innermost first, before
    the contract's units): ZeRO-3 reshards after forward; ZeRO-1 and -2 keep the gathered weights and
    reduce-scatter every microbatch (priced so: ``planning/pricing.py``). Its weights are DTensors on
    the ep mesh, so FSDP2 shards them 2-D over (edp, ep), as it does a tensor-parallel weight over (dp, tp)."""
    from torch.distributed.fsdp import fully_shard

    for module, zero in experts.sharded:
        fully_shard(module, mesh=experts.edp_mesh, reshard_after_forward=(zero == 3),
                    mp_policy=mixed_precision_policy(dtype))


def sync_replicas(result: DataParallelResult, dp_mesh) -> None:
    """Broadcast a DDP root's parameters and buffers, and the parameters kept whole beside FSDP2's
    units, in place from the dp group's first rank.

    Requires: the module materialised. What DDP's ``init_sync`` does, without its flat
    copy of the whole model (and its shape check, which the shared plan makes moot).
    """
    import torch.distributed as dist

    group = dp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in result.whole:
            dist.broadcast(p, src=src, group=group)
    if result.ddp is None:
        return
    from torch.distributed.tensor import DTensor

    # ep's experts differ across the dp group (each ep rank holds its own): passes/expert_parallel.py
    # syncs them over their edp group
    own = {id(t) for m in result.ddp_ignored for t in [*m.parameters(), *m.buffers()]}
    with torch.no_grad():
        for t in [*result.ddp.parameters(), *result.ddp.buffers()]:
            if not isinstance(t, DTensor) and id(t) not in own:
                dist.broadcast(t, src=src, group=group)


def set_last_microbatch(result: DataParallelResult, last: bool) -> None:
    """Sync and reshard deferred (ZeRO-0/1) modules only in the last microbatch's backward."""
    from torch.distributed._composable.replicate import DDP

    for module in result.deferred:
        if isinstance(module, DDP):  # the composable DDP takes no ``recurse``
            module.set_requires_gradient_sync(last)
            continue
        module.set_requires_gradient_sync(last, recurse=False)
        if hasattr(module, "set_reshard_after_backward"):
            module.set_reshard_after_backward(last, recurse=False)
