"""Tensor parallelism: a plan's per-layer ``tp`` styles, lowered as capture proved them.

Takes the model (real or meta tensors, unsharded), the captured
:class:`~autopar.graph.LayerGraph`, the Plan and the ``tp`` axis of the device
mesh. Returns a :class:`TensorParallelResult`. What stays true: parameter
FQNs are unchanged; every rank of the tp axis computes the same layer outputs
as the unsharded model.

A Megatron layer (column projections → row projections) runs its *own*
forward, unchanged, under :class:`~autopar.sharding.rules.ShardMode`
— the same rules capture simulated the style with before offering it
(:mod:`autopar.sharding.check`): shape queries answer globally, views
and splits get their local sizes. Here the mode's backend is
:class:`MeshRank`: the projections' weights are DTensor shards over the tp
mesh (``distribute_tensor``: column weights on their output features, row
weights on their input features, row biases replicated), the column inputs'
gradients and the row outputs are summed over the tp group. A fused
projection's output rows are permuted first so each rank's contiguous shard
holds its piece of every segment (``[q; k; v]``, GQA-shaped q/k/v, gate/up);
the permutations are returned so full state dicts can be put back in order.

Sequence parallelism (a layer planned with ``sp``) runs the same forward on
this rank's share of the hidden state's sequence: Megatron-SP's conjugate
pairs replace the two all-reduces (an all-gather of each column input, a
reduce-scatter of each row output), and a region of such layers is entered by
keeping a share and left by an all-gather (:class:`SequenceEnds`). These are
autograd functions over ``all_gather_single`` / ``reduce_scatter_single``
rather than DTensor's ``SequenceParallel`` style for the reason MeshRank's are:
the code between them is the layer's own, on local tensors, which module-level
styles cannot place.

Vocab styles (an ``nn.Embedding`` split on its vocabulary, an LM head split
on its outputs and gathered) use DTensor's ``RowwiseParallel`` /
``ColwiseParallel`` directly: no code of the model runs between their
collectives. Both shard the weight's vocabulary rows (``Shard(0)``), so a head
tied to its input embedding and split with it stays tied: the head takes the
embedding's sharded parameter back (:func:`_retie`); the contract splits such
ends together or not at all (:func:`autopar.contract.loss_fixed_tp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from autopar.admission import tensor_parallel_refusals
from autopar.errors import LoweringError
from autopar.graph import Layer, LayerGraph
from autopar.plan import Plan
from autopar.sharding.channel_ops import channel_params
from autopar.sharding.check import SEQ_DIM, hidden_input, install_projection_hooks, with_hidden_input
from autopar.sharding.rules import Collectives, ShardMode, is_conv1d, projection_dims, segment_permutation
from autopar.tp_style import TPStyle


@dataclass(frozen=True)
class Permutation:
    """The order tensor parallelism gave a parameter along ``dim``: ``new = old.index_select(dim, index)``
    (a fused projection's output rows; a Conv1D's weight is stored in × out, so its outputs are dim 1)."""

    index: torch.Tensor
    dim: int = 0


@dataclass
class TensorParallelResult:
    """What the pass did: the layers it split and ``permutations`` by parameter FQN."""

    layers: list[str] = field(default_factory=list)
    permutations: dict[str, Permutation] = field(default_factory=dict)


def _tp_layers(graph: LayerGraph, plan: Plan) -> list[tuple[Layer, TPStyle]]:
    by_name = {l.name: l for l in graph}
    out = []
    for lp in plan.layers:
        if lp.choice.tp is None:
            continue
        layer = by_name.get(lp.name)
        if layer is None:
            raise LoweringError(f"the plan names layer {lp.name!r}, which the model does not have")
        try:
            out.append((layer, layer.tp_style(lp.choice.tp)))
        except KeyError as exc:
            raise LoweringError(str(exc.args[0])) from None
    return out


def _projection(model: nn.Module, path: str, role: str) -> nn.Module:
    mod = model.get_submodule(path)
    if projection_dims(mod) is None and not isinstance(mod, nn.Embedding):
        raise LoweringError(f"tensor parallelism splits nn.Linear, Conv1D and nn.Embedding; {role} module "
                            f"{path!r} is {type(mod).__name__}: plan it with tp=none")
    return mod


def check_tensor_parallel(model: nn.Module, graph: LayerGraph, plan: Plan, tp: int) -> None:
    """Raise :class:`LoweringError` where the plan's tp layers cannot run at ``tp``: admission's rules
    (:func:`autopar.admission.tensor_parallel_refusals`: the style admits ``tp``, sp and segments too), then
    what only the module says (each projection split is a module tp splits, and ``tp`` divides its width).

    Pure and deterministic, so every rank raises the same error before any collective.
    """
    if found := tensor_parallel_refusals(graph, plan, tp):
        raise LoweringError(found[0])
    for _layer, style in _tp_layers(graph, plan):
        for path in (*style.column, *style.row, *style.vocab):
            mod = _projection(model, path, "tensor-parallel")
            dims = projection_dims(mod)
            size = mod.num_embeddings if isinstance(mod, nn.Embedding) else (
                dims[0] if path in style.row else dims[1])  # type: ignore[index]
            if size % tp and path not in style.whole:
                raise LoweringError(f"module {path!r}: tp={tp} does not divide its width {size}")


# ------------------------------------------------------------------ the mesh backend


class _CopyToTP(torch.autograd.Function):
    """Megatron's *f*: identity forward, gradient summed over the tp group backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's *g*: partial results summed over the tp group forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _all_gather(x: torch.Tensor, dim: int, group: Any, tp: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (gloo and NCCL gather along dim 0)."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * tp, *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any, tp: int) -> torch.Tensor:
    """The sum of every rank's ``x``, of which this rank keeps its 1/tp along ``dim``."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // tp, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


class _GatherSequence(torch.autograd.Function):
    """Megatron-SP's *g*: the sequence gathered forward, the gradient reduce-scattered backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any, tp: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.tp = dim, group, tp
        return _all_gather(x, dim, group, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.tp), None, None, None


class _ScatterSequence(torch.autograd.Function):
    """Megatron-SP's *ḡ*: partial sums reduce-scattered onto the sequence forward, the gradient
    gathered backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any, tp: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.tp = dim, group, tp
        return _reduce_scatter(x, dim, group, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.tp), None, None, None


class _SplitSequence(torch.autograd.Function):
    """Entering a sequence-parallel region from a replicated activation: keep this rank's share
    forward (no communication), gather the gradient's shares backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any, tp: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.tp = dim, group, tp
        return x.chunk(tp, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.tp), None, None, None, None


class _LeaveSequence(torch.autograd.Function):
    """Leaving a sequence-parallel region: gather the shares forward; every rank's gradient is the
    whole (replicated) one, of which it keeps its share backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any, tp: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.tp, ctx.rank = dim, tp, rank
        return _all_gather(x, dim, group, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.tp, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _recomputing() -> bool:
    """Whether this forward runs inside backward (activation checkpointing's recomputation)."""
    return torch._C._current_graph_task_id() != -1


class MeshRank(Collectives):
    """A rank of a real tp group: weights are DTensor shards (already permuted), sums are
    all-reduces. The two autograd functions are Megatron's conjugate operators: the layer's
    code between the projections runs on local tensors, so DTensor's styles, which wrap
    whole modules, cannot place them."""

    def __init__(self, tp_mesh: Any):
        self.group = tp_mesh.get_group()
        self.tp = tp_mesh.size()
        self.rank = tp_mesh.get_local_rank()

    def column_weight(self, weight: torch.Tensor, dim: int, segments: tuple[int, ...]) -> torch.Tensor:
        return _local(weight)  # type: ignore[return-value]

    def row_weight(self, weight: torch.Tensor, dim: int) -> torch.Tensor:
        return _local(weight)  # type: ignore[return-value]

    def replicated(self, param: torch.Tensor | None) -> torch.Tensor | None:
        return _local(param)

    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        return _CopyToTP.apply(x, self.group)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(partial, self.group)

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _GatherSequence.apply(x, dim, self.group, self.tp)

    def reduce_scatter_sequence(self, partial: torch.Tensor, dim: int) -> torch.Tensor:
        return _ScatterSequence.apply(partial, dim, self.group, self.tp)

    def grad_sum(self, x: torch.Tensor) -> torch.Tensor:
        return _CopyToTP.apply(x, self.group)

    def split_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _SplitSequence.apply(x, dim, self.group, self.tp, self.rank)

    def leave_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _LeaveSequence.apply(x, dim, self.group, self.tp, self.rank)


# ------------------------------------------------------------------ lowering


@torch.no_grad()
def _shard(mod: nn.Module, name: str, tp_mesh: Any, placement: Any) -> None:
    from torch.distributed.tensor import distribute_tensor

    param = getattr(mod, name, None)
    if param is None:
        return
    dt = distribute_tensor(param.data, tp_mesh, [placement])
    mod.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


@torch.no_grad()
def _permute(mod: nn.Module, fqn: str, segments: tuple[int, ...], tp: int, result: TensorParallelResult) -> None:
    perm = segment_permutation(segments, tp)
    conv = is_conv1d(mod)
    for name, param in mod.named_parameters(recurse=False):
        dim = 1 if conv and name == "weight" else 0
        if not param.is_meta:  # a meta model is initialised after sharding: nothing to move
            param.copy_(param.index_select(dim, perm.to(param.device)))
        result.permutations[f"{fqn}.{name}"] = Permutation(perm, dim)


@dataclass(frozen=True)
class SequenceEnds:
    """Sequence parallelism on a layer: whether it enters its region (keeps its share of a
    replicated hidden state) and leaves it (gathers its output's shares); between two
    sequence-parallel neighbours of one stage whose hidden state passes untouched, neither."""

    enter: bool
    leave: bool


def _sequence_ends(graph: LayerGraph, plan: Plan) -> dict[str, SequenceEnds]:
    """Each sequence-parallel layer's ends, from the plan's order (a part's layers, in chain order)."""
    layers, out = list(plan.layers), {}

    def passes(a: Any, b: Any) -> bool:  # a's output share goes straight into b
        return (a.choice.sp and b.choice.sp and a.stage == b.stage and b.choice.tp is not None
                and graph.layer(b.name).tp_style(b.choice.tp).sequence_linked)

    for i, lp in enumerate(layers):
        if lp.choice.sp and lp.choice.tp is not None:
            out[lp.name] = SequenceEnds(enter=not (i > 0 and passes(layers[i - 1], lp)),
                                        leave=not (i + 1 < len(layers) and passes(lp, layers[i + 1])))
    return out


def _megatron(model: nn.Module, layer: Layer, style: TPStyle, tp_mesh: Any, result: TensorParallelResult,
              sequence: SequenceEnds | None = None) -> None:
    from torch.distributed.tensor import Replicate, Shard

    tp = tp_mesh.size()
    for path in style.column:
        mod = _projection(model, path, "column")
        if path in style.whole:  # held whole on every rank: each rank reads its rows (sharding/whole.py)
            _shard(mod, "weight", tp_mesh, Replicate())
            _shard(mod, "bias", tp_mesh, Replicate())
            continue
        segs = style.segments.get(path)
        if segs is not None:
            _permute(mod, path, segs, tp, result)
        _shard(mod, "weight", tp_mesh, Shard(1 if is_conv1d(mod) else 0))
        _shard(mod, "bias", tp_mesh, Shard(0))
    for path in style.row:
        mod = _projection(model, path, "row")
        _shard(mod, "weight", tp_mesh, Shard(0 if is_conv1d(mod) else 1))
        _shard(mod, "bias", tp_mesh, Replicate())
    if layer.module_path is None:
        raise LoweringError(f"layer {layer.name!r} has no module of its own to run sharded")
    owner = model.get_submodule(layer.module_path)
    # a Mamba mixer's per-channel parameters, split on their channels (sharding/channel_ops.py)
    rel = len(layer.module_path) + 1
    shared = channel_params(owner, tuple(c[rel:] for c in style.column), tuple(r[rel:] for r in style.row))
    for path in (p for params in shared.values() for p in params):
        parent, _, name = path.rpartition(".")
        _shard(owner.get_submodule(parent) if parent else owner, name, tp_mesh, Shard(0))
    install_projection_hooks(owner, style.column, style.row, style.segments, prefix=layer.module_path,
                             whole=style.whole)
    _run_sharded(owner, tp_mesh, sequence)
    for path in style.experts:  # its routed experts split across their hidden dim too (sharding/experts.py)
        from autopar.passes.expert_tensor import split_experts

        split_experts(model.get_submodule(path), path, tp_mesh, _CopyToTP, _ReduceFromTP,
                      lambda fqn, index, dim: result.permutations.__setitem__(fqn, Permutation(index, dim)))


@dataclass
class ShardedRun:
    """What :func:`_run_sharded` set up on a tensor-parallel layer's module (its attribute
    :data:`SHARDED_RUN`): the rank, the layer's sequence ends, and whether its forward is compiled.

    ``compiled`` (set by :mod:`autopar.runtime.compiled` as it compiles the block): the module's
    hooks no longer enter :class:`ShardMode` around its forward; the compiled forward was traced once
    under the mode (:mod:`autopar.runtime.sharded_trace`) and runs the rewritten ops itself. The
    hooks still keep the sequence share on entry and gather it on exit, eagerly, outside the graph."""

    tp_mesh: Any
    sequence: SequenceEnds | None
    compiled: bool = False


SHARDED_RUN = "_autopar_sharded_run"


def _run_sharded(module: nn.Module, tp_mesh: Any, sequence: SequenceEnds | None = None) -> None:
    """Run ``module``'s forward under the sharding rules on this rank of ``tp_mesh``; with
    ``sequence``, on its share of the hidden state's sequence.

    A recomputed forward (activation checkpointing re-runs the module in backward, with the
    inputs it got: already shares) neither splits its input again nor gathers its output,
    which checkpointing throws away."""
    comm = MeshRank(tp_mesh)
    run = ShardedRun(tp_mesh, sequence)
    setattr(module, SHARDED_RUN, run)
    active: list[ShardMode] = []

    def enter(mod, args, kwargs):
        if run.compiled:  # the compiled forward was traced under the mode: only the sequence share here
            mode = None
        else:
            mode = ShardMode(comm)
            mode.__enter__()
            active.append(mode)
        if sequence is None:
            return None
        found = hidden_input(args, kwargs)
        if found is None:
            raise LoweringError(f"{type(mod).__name__}: sequence parallelism found no hidden state to share")
        where, x = found
        with torch._C.DisableTorchFunction():
            share = comm.split_sequence(x, SEQ_DIM) if sequence.enter and not _recomputing() else x
        if mode is not None:
            mode.enter_sequence(share, SEQ_DIM, share.shape[SEQ_DIM] * comm.tp)
        return with_hidden_input(args, kwargs, where, share)

    def leave(mod, args, kwargs, output):
        if active:
            active.pop().__exit__(None, None, None)
        if sequence is None or not sequence.leave or _recomputing():
            return None
        leaves, spec = pytree.tree_flatten(output)
        at = next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point())
        leaves[at] = comm.leave_sequence(leaves[at], SEQ_DIM)
        return pytree.tree_unflatten(leaves, spec)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)


def _vocab_styles(model: nn.Module, style: TPStyle) -> dict[str, object]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    for path in style.vocab:
        mod = model.get_submodule(path)
        if isinstance(mod, nn.Embedding):
            plan[path] = RowwiseParallel(input_layouts=Replicate())  # vocab-split embedding
        elif isinstance(mod, nn.Linear):
            plan[path] = ColwiseParallel(output_layouts=Replicate())  # an LM head, gathered
        else:
            raise LoweringError(f"vocab module {path!r} is {type(mod).__name__}: plan it with tp=none")
    return plan


def apply_tensor_parallel(model: nn.Module, graph: LayerGraph, plan: Plan, tp_mesh) -> TensorParallelResult:
    """Shard every layer whose plan ``tp`` names a style over ``tp_mesh`` (a 1-D DeviceMesh).

    Requires: the model unsharded (no FSDP yet), ``plan`` made for ``graph``.
    Returns the layers split and the fused projections' permutations. Raises
    :class:`LoweringError` (before touching the model) if a style does not admit the degree.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    result = TensorParallelResult()
    if tp == 1:
        return result
    check_tensor_parallel(model, graph, plan, tp)
    vocab: dict[str, object] = {}
    ends = _sequence_ends(graph, plan)
    for layer, style in _tp_layers(graph, plan):
        if style.vocab:
            vocab.update(_vocab_styles(model, style))
        if style.row:
            _megatron(model, layer, style, tp_mesh, result, ends.get(layer.name))
        result.layers.append(layer.name)
    if vocab:
        ties = _ties(model, list(vocab))
        parallelize_module(model, tp_mesh, vocab)
        _retie(model, ties)
    return result


def _ties(model: nn.Module, paths: list[str]) -> list[list[str]]:
    """The vocab modules among ``paths`` that share one weight, in groups (the first: the owner); a weight
    one of them shares with a module that is not split is a LoweringError (the tie would become two)."""
    holders: dict[int, list[str]] = {}
    for path, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        if isinstance(weight, nn.Parameter):
            holders.setdefault(id(weight), []).append(path)
    groups = []
    for group in holders.values():
        split = [p for p in group if p in paths]
        if split and len(group) > 1:
            if len(split) < len(group):
                raise LoweringError(f"modules {group} share one weight but tensor parallelism splits only {split}: "
                                    "plan their layers alike (re-plan the model)")
            groups.append(group)
    return groups


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Each tied group's modules hold its owner's sharded weight again (``parallelize_module`` gave each
    module a parameter of its own); both styles shard the vocabulary rows, checked here."""
    for owner, *others in ties:
        weight = model.get_submodule(owner).weight
        for path in others:
            mine = model.get_submodule(path).weight
            if getattr(mine, "placements", None) != weight.placements:
                raise LoweringError(f"tied weight of {owner!r} and {path!r} split differently "
                                    f"({weight.placements} and {getattr(mine, 'placements', None)})")
            model.get_submodule(path).weight = weight


__all__ = ["SHARDED_RUN", "MeshRank", "Permutation", "ShardedRun", "TensorParallelResult", "apply_tensor_parallel",
           "check_tensor_parallel"]
