"""ZeRO and data parallelism: each layer's ``zero`` stage as FSDP2 over the dp axis.

Takes the model (after tensor parallelism and recompute), the LayerGraph,
the Plan and the ``dp`` axis of the device mesh. Returns a
:class:`DataParallelResult`. What stays true: parameter FQNs are unchanged;
after a step's last backward every gradient is the mean over the dp group.

| zero | engine | between microbatches |
| --- | --- | --- |
| 3 | ``fully_shard(reshard_after_forward=True)`` | grads reduce-scattered each microbatch |
| 2 | ``fully_shard(reshard_after_forward=False)`` | grads reduce-scattered each microbatch |
| 1 | ``fully_shard(reshard_after_forward=False)`` | *deferred*: unsharded grads accumulate, params stay gathered |
| 0 | ``replicate`` (FSDP2-based, ``replicate_with_fsdp``) | *deferred*: grads accumulate, all-reduce once |

*Deferred* modules are listed in the result; the runtime calls
``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``
on them for every microbatch but the last (:func:`set_last_microbatch`). With
one microbatch ZeRO-1 and ZeRO-2 run alike; the optimizer state is sharded in
both because the optimizer sees the sharded parameters.

A plan that is plain DP everywhere is DDP (the composable, DDP-based
``replicate`` at the root; with tp > 1, one FSDP2-based ``replicate`` group at
the root) instead of one group per layer. The FSDP2-based ``replicate`` is used rather than the older composable
``replicate`` (DDP) because it composes with ``fully_shard`` on sibling
modules in one model. The root module is wrapped last so parameters outside
every layer module are handled: with the zero stage of the layers owning
them (else plain DP if every layer is, else ZeRO-2 — the root's own
parameters are then needed again at once in backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from autopar.graph import LayerGraph
from autopar.plan import Plan


@dataclass
class DataParallelResult:
    """Which module got which zero stage, and the modules whose gradient sync is deferred."""

    zero_by_path: dict[str, int] = field(default_factory=dict)
    deferred: list[nn.Module] = field(default_factory=list)
    ddp: nn.Module | None = None  # the root, when lowered onto the composable DDP


def layer_zero_stages(graph: LayerGraph, plan: Plan) -> tuple[dict[str, int], int]:
    """(zero stage per layer module path, zero stage of the root) from the plan.

    The repeated layers (the blocks: layers whose cost class occurs more than
    once) each get an FSDP unit of their own; every other layer (embeddings,
    final norm, head, glue) leaves its parameters to the root unit, with the
    highest zero stage among them. This is torchtitan's wrapping: one unit per
    block keeps the gather buffer to one block, and folding the few odd layers
    into the root saves their collectives (per-layer units cost 1.14× the
    hand-written per-block wrapping in benchmarks/runtime_overhead.py). The
    cost model's workspace counts the root unit's gathered parameters.
    A module shared by several layers gets the highest of their stages.
    """
    by_name = {l.name: l for l in graph}
    repeated = {l.name for l, own in zip(graph, graph.repeated) if own}
    stages: dict[str, int] = {}
    leftover: list[int] = []
    for lp in plan.layers:
        layer = by_name[lp.name]
        if not layer.param_names:
            continue
        if layer.module_path and layer.name in repeated:
            stages[layer.module_path] = max(stages.get(layer.module_path, 0), lp.zero)
        else:
            leftover.append(lp.zero)
    if leftover:
        root = max(leftover)
    else:
        root = 0 if all(z == 0 for z in stages.values()) else 2
    if root == 0 and any(stages.values()):
        # A replicate root around fully_shard units mis-averages their gradients under
        # pipelining (seen: 1.34 relative error, pp2×dp2×tp2); ZeRO-1 at the root keeps the
        # same communication pattern and only shards more than the plan priced.
        root = 1
    return stages, root


def _shard(module: nn.Module, zero: int, dp_mesh) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    if zero == 0:
        replicate(module, mesh=dp_mesh)
    else:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=(zero == 3))


def apply_data_parallel(model: nn.Module, graph: LayerGraph, plan: Plan, dp_mesh, *,
                        allow_ddp: bool = True) -> DataParallelResult:
    """Wrap each layer module with its zero stage over ``dp_mesh``, then the root.

    Requires: tensor parallelism and recompute already applied (FSDP2 must see
    the DTensor parameters TP made, so on a 2-D mesh it shards over dp after tp).
    ``allow_ddp=False`` keeps a pure-DP plan on FSDP2's replicate: pipeline
    stages need it (the composable DDP inside a PipelineStage gave gradients
    0.88 off, pp2×dp2).
    """
    stages, root_zero = layer_zero_stages(graph, plan)
    result = DataParallelResult()
    if root_zero == 0 and not any(stages.values()):
        if plan.mesh.tp == 1 and allow_ddp:
            # A pure-DP plan is DDP: the composable (DDP-based) replicate buckets gradients
            # and overlaps their all-reduce with backward, keeping FQNs. FSDP2's replicate
            # at the root cost 1.22× DDP's step in benchmarks/runtime_overhead.py on gloo.
            # DDP keeps its gradient buckets beside the gradients (priced in pricing.py);
            # gradient_as_bucket_view=True measured the same peak with zero_grad(set_to_none).
            from torch.distributed._composable.replicate import replicate as ddp_replicate

            # init_sync=False: DDP's own start-up sync broadcasts one flat copy of every
            # parameter (flatten_dense_tensors), whose free can land on a gloo worker thread,
            # which the profiler does not see (benchmarks/fidelity.py then counted it live
            # for the whole run); sync_replicas broadcasts each tensor in place instead.
            ddp_replicate(model, device_mesh=dp_mesh, init_sync=False)
            result.zero_by_path[""] = 0
            result.deferred.append(model)
            result.ddp = model
            return result
        # with tp, one FSDP2-based replicate group at the root (it composes with DTensor)
        stages = {}
    # innermost first: a module is wrapped before any ancestor that is also a layer
    for path in sorted(stages, key=lambda p: -p.count(".")):
        module = model.get_submodule(path)
        _shard(module, stages[path], dp_mesh)
        result.zero_by_path[path] = stages[path]
        if stages[path] <= 1:
            result.deferred.append(module)
    _shard(model, root_zero, dp_mesh)
    result.zero_by_path[""] = root_zero
    if root_zero <= 1:
        result.deferred.append(model)
    return result


def sync_replicas(result: DataParallelResult, dp_mesh) -> None:
    """Broadcast a DDP root's parameters and buffers in place from the dp group's first rank.

    Requires: the module materialised. What DDP's ``init_sync`` does, without its flat
    copy of the whole model (and its shape check, which the shared plan makes moot).
    """
    import torch
    import torch.distributed as dist

    if result.ddp is None:
        return
    group = dp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*result.ddp.parameters(), *result.ddp.buffers()]:
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
