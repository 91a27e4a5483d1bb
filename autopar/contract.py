"""The contract: what each layer of a plan runs as, decided once for pricing and lowering.

Pricing (:mod:`autopar.planning.pricing`), the solver's bounds and the
lowering passes all ask this module, and nothing else decides, for a graph
and a plan (or one configuration being priced):

* the **data-parallel engine** of the plan and of each layer;
* each layer's **FSDP unit** and the ZeRO stage that unit runs at;
* the **collectives** a unit issues per step and each layer's share of them;
* the **FSDP2 buffers** a rank holds;
* whether a layer's **recompute** applies;
* the **rank layout**: the mesh's (:mod:`autopar.mesh`: row-major over its declared axes, pp
  outermost, tp innermost), and how many pipeline ranks share a node.

Torch-free, so the planner and ``autopar show`` never import torch for it.

The rules, with what the runtime showed:

``dp = 1`` (and ``cp = 1``: dp below stands for the dp × cp ranks, :func:`data_ranks`)
    No data-parallel engine (:attr:`Engine.NONE`): a layer's ``zero`` is moot.
every layer ``zero = 0`` (a *replicated* plan)
    dp the only axis above 1 (ep folded into it, its experts left out): DDP at the root (the composable
    ``replicate``: 25 MiB gradient buckets overlapped with backward; FSDP2's replicate at the root cost
    1.22× its step on gloo, 1.08× a hand-written EP's under ep). Otherwise one FSDP2 ``replicate`` unit
    per part (the model, or one pipeline stage) holding all its layers: the
    composable DDP inside a ``PipelineStage`` gave gradients 0.88 off, and
    DDP does not take DTensor parameters.
some layer ``zero ≥ 1`` (a *sharded* plan)
    Each *block* — a repeated layer (its cost class occurs more than once)
    with parameters and a module of its own that no other layer calls and
    that holds all of them — is
    an FSDP2 unit of its own: ``fully_shard`` (``reshard_after_forward`` for
    ZeRO-3) for zero ≥ 1, FSDP2 ``replicate`` for zero 0. Every other layer
    with parameters belongs to its part's **root unit**; every root unit of
    the plan runs at one ZeRO stage: the highest its layers ask for, and at
    least 1 (a replicate root around ``fully_shard`` units mis-averaged their
    gradients under pipelining: 1.34 relative error, pp2×dp2×tp2). A root
    layer that asked for less keeps its request in the plan, is priced at the
    root's stage (:func:`effective_zero`) and is noted. One unit per block and the
    odd layers folded into the root is torchtitan's wrapping: per-layer units
    cost 1.14× the hand-written per-block wrapping (benchmarks/runtime_overhead.py).
    A root holding no parameters runs at ZeRO-2 if its part shards anything, else 0.
    Inside an export-captured model's pipeline stages no layer module is
    called, so each stage is one unit holding all its layers.
recompute
    Full recompute applies to a layer with a module of its own (checkpoint
    hooks on that module), except inside pipeline stages of an export-captured
    model, whose stages are single ATen graphs with no layer modules left to
    hook. Selective recompute applies where full does and the module runs a
    matmul-class op whose output there is to keep (capture's
    ``selective_saved_bytes_per_sample``): with nothing to keep it would be
    full recompute under another name. A kind that does not apply runs as none
    (:func:`recompute_runs_as`).

The solver searches the replicated and the sharded mode (:class:`DataParallelism`)
as configurations of their own — in the sharded one, the root units' single
ZeRO stage is a CP-SAT choice unless pins fix it — and offers each layer only
the choices that run as priced (:func:`offered_zeros`, :func:`recompute_applies`),
so a plan it returns lowers exactly as it was priced. A hand-made plan is lowered by the
same rules and priced by them too (:func:`layout`, ``planning.pricing.evaluate``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from autopar.choice import LayerChoice, Recompute
from autopar.contract_cp import (  # cp's rules, in a module of their own; the planner reads them as contract.*
    cp_admits_sequence,  # noqa: F401
    cp_admits_style,  # noqa: F401
    cp_methods,  # noqa: F401
    cp_refusal,  # noqa: F401
    data_ranks,
    method_refusal,  # noqa: F401
    ring_device_refusal,  # noqa: F401
    ring_refusal,  # noqa: F401
    ulysses_refusal,  # noqa: F401
)
from autopar.contract_loss import *  # noqa: F403 - the loss's rules (its __all__), read as contract.*
from autopar.cost_models.pipeline import SPLIT_BACKWARD, V_SHAPED, ScheduleKind, stage_rank
from autopar.units import MiB

if TYPE_CHECKING:
    from autopar.graph import Layer, LayerGraph
    from autopar.mesh import Mesh
    from autopar.plan import Plan
    from autopar.tp_style import TPStyle

DDP_BUCKET_BYTES = 25 * MiB  # DistributedDataParallel's default bucket_cap_mb
ROOT = ""  # the unit path of a part's root module
ZERO_STAGES = (0, 1, 2, 3)
ROOT_STAGES = (1, 2, 3)  # a sharded plan's root units: never a replicate around fully_shard units


class Engine(Enum):
    """What runs a layer's data parallelism."""

    NONE = "none"  # dp = 1
    DDP = "ddp"  # the composable DDP at the model's root
    REPLICATE = "replicate"  # an FSDP2 replicate unit
    FULLY_SHARD = "fully_shard"  # an FSDP2 fully_shard unit


class Buffers(IntEnum):
    """FSDP2's buffers a rank holds because of the units it runs (ordered: each holds the previous)."""

    NONE = 0
    REDUCE_SCATTER = 1  # two units of unsharded gradients around a reduce-scatter (ZeRO ≥ 1)
    PREFETCH = 2  # + the next unit's weights gathered ahead (ZeRO-3)


@dataclass(frozen=True, order=True)
class DataParallelism:
    """The plan-wide half of the contract: replicated (every layer zero 0) or sharded, and
    the ZeRO stage every root unit runs at when sharded. ``root_zero`` 0 in a sharded mode
    leaves that stage to the solver, which gives all root-unit layers one stage of 1–3
    (or no root unit holds parameters); a plan's own mode (:func:`mode_of`) names it."""

    sharded: bool = False
    root_zero: int = 0

    def __str__(self) -> str:
        if not self.sharded:
            return "replicated"
        return f"sharded, root ZeRO-{self.root_zero}" if self.root_zero else "sharded"


REPLICATED = DataParallelism()


def plan_engine(mesh: Mesh, mode: DataParallelism) -> Engine:
    """The plan's data-parallel engine: none at dp = 1; DDP or one FSDP2 replicate unit per part
    for a replicated plan; FSDP2 units (:attr:`Engine.FULLY_SHARD`) for a sharded one, where a
    ZeRO-0 block's own unit is a replicate (:func:`unit_engine`). DDP only where dp is the one
    axis above 1 (ep folded into it): it neither runs inside a pipeline stage nor takes tp's DTensors.
    ep's experts it leaves out, given the dp group, not a sliced mesh, whose TP hooks would turn
    them into plain tensors after each forward (``passes/zero.py``)."""
    if data_ranks(mesh) <= 1:
        return Engine.NONE
    if mode.sharded:
        return Engine.FULLY_SHARD
    return Engine.DDP if mesh.world_size == mesh.dp else Engine.REPLICATE


def ep_refusal(mesh: Mesh, graph: LayerGraph) -> str | None:
    """Why ``mesh``'s expert parallelism cannot run on ``graph`` (None when it can). ep reroutes each
    experts module's call (``passes/expert_parallel.py``): inside pipeline stages it runs where the
    stages call the layer modules, as they do for FX-traced models and for export-captured ones that
    kept their layers' module calls (``"export-layers"``); an ``"export"`` graph's stages are single
    ATen graphs in which no experts module is called."""
    if mesh.ep > 1 and not tp_applies(graph, mesh.pp):
        return (f"ep={mesh.ep} with pp={mesh.pp} cannot run on {graph.model_name}: its pipeline stages are "
                "single ATen graphs (torch.export could not keep its layers' module calls), in which no "
                "experts module is called for ep to reroute; use pp=1")
    return None


def unit_engine(zero: int) -> Engine:
    return Engine.FULLY_SHARD if zero >= 1 else Engine.REPLICATE


# ---------------------------------------------------------------- per layer, from the graph


@dataclass(frozen=True)
class Wrapping:
    """Which layers own an FSDP unit and which share their part's root unit, for one graph
    and pipeline degree (sharded plans; replicated ones wrap each part whole)."""

    own: tuple[bool, ...]
    root: tuple[bool, ...]
    root_params: int  # parameters of the root-unit layers, all parts together
    largest_unit_params: int  # the largest unit: a block, or a part's root unit


_WRAPPINGS: WeakKeyDictionary[LayerGraph, dict[int, Wrapping]] = WeakKeyDictionary()


def wrapping(graph: LayerGraph, pp: int) -> Wrapping:
    """A block — a repeated layer with parameters, whose module no other layer calls and holds
    all of them — owns a unit, except inside an export-captured model's pipeline stages, where
    no layer module is called and each stage is one unit. Cached per graph."""
    cached = _WRAPPINGS.get(graph)  # a hit makes no weak reference: setdefault's makes one a call
    if cached is None:
        cached = _WRAPPINGS.setdefault(graph, {})
    if pp not in cached:
        calls = Counter(layer.module_path for layer in graph if layer.module_path)
        called = tp_applies(graph, pp)

        def owns(layer: Layer, repeated: bool) -> bool:
            path = layer.module_path
            return bool(called and repeated and path and calls[path] == 1 and layer.param_count
                        and all(name.startswith(path + ".") for name in layer.param_names))

        own = tuple(owns(layer, rep) for layer, rep in zip(graph, graph.repeated))
        root = tuple(bool(layer.param_count) and not o for layer, o in zip(graph, own))
        root_params = sum(layer.param_count for layer, r in zip(graph, root) if r)
        root_unit = root_params if called else -(-root_params // pp)  # export: a stage's share
        largest = max([layer.param_count for layer, o in zip(graph, own) if o] + [root_unit])
        cached[pp] = Wrapping(own, root, root_params, largest)
    return cached[pp]


def recompute_applies(graph: LayerGraph, index: int, pp: int, kind: Recompute = Recompute.FULL) -> bool:
    """Whether layer ``index`` can run recompute ``kind`` (see the module docstring); none always can."""
    if kind is Recompute.NONE:
        return True
    hooked = tp_applies(graph, pp) and graph[index].module_path is not None and not graph[index].recompute_refusal
    if kind is Recompute.SELECTIVE:
        return hooked and graph[index].selective_saved_bytes_per_sample > 0
    if kind is Recompute.ALTERNATE_MM:
        return hooked and graph[index].alternate_saved_bytes_per_sample > 0
    return hooked


SEARCHED_RECOMPUTES = (Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE)  # ALTERNATE_MM: when pinned


def offered_recomputes(graph: LayerGraph, index: int, pp: int, split_backward: bool = False) -> tuple[Recompute, ...]:
    """The recompute kinds the solver searches for layer ``index``, each of which runs as priced
    (torchtitan's ``ALTERNATE_MM`` runs when pinned). Under a schedule that splits backward into input
    and weight gradients none: each half unpacks the checkpoint and recomputes, and torch's checkpoint
    cannot run its recompute twice (``tests/passes/test_zero_bubble.py``)."""
    if split_backward:
        return (Recompute.NONE,)
    return tuple(k for k in SEARCHED_RECOMPUTES if recompute_applies(graph, index, pp, k))


def recompute_runs_as(graph: LayerGraph, index: int, pp: int, kind: Recompute | bool) -> Recompute:
    """The recompute layer ``index`` asking for ``kind`` runs with: ``kind``, or none where it does not apply."""
    kind = Recompute.of(kind)
    return kind if recompute_applies(graph, index, pp, kind) else Recompute.NONE


def experts_split_refusal(style: TPStyle, mesh: Mesh) -> str | None:
    """Why ``style``'s experts split across their hidden dim (``autopar/sharding/experts.py``) cannot run
    under ``mesh`` (None when it can, or when the style splits no experts). ``passes/expert_tensor.py`` runs
    it with tp, beside dp at every ZeRO stage (the DDP/FSDP2 engines take its DTensors as any tensor-parallel
    weight: ``tests/runtime/test_expert_tensor.py``); beside cp, ep or pp its layout and gradients are not
    proved against one device, so those meshes price and run the experts replicated over tp instead."""
    if not style.experts:
        return None
    others = {"cp": mesh.cp, "ep": mesh.ep, "pp": mesh.pp}
    beside = [f"{k}={v}" for k, v in others.items() if v > 1]
    if beside:
        return (f"style {style.name!r} (experts split over tp) runs beside dp, not beside "
                f"{', '.join(beside)}; plan the layer with tp=megatron (experts replicated over tp)")
    return None


def tp_applies(graph: LayerGraph, pp: int) -> bool:
    """Whether layer modules are called, so the sharding rules and checkpoint hooks can be lowered:
    not inside the pipeline stages of a model whose export graph could not keep its layers'
    module calls (capture's tracer ``"export"``; ``"export-layers"`` keeps them)."""
    return not (pp > 1 and graph.tracer == "export")


def tied_across_stages(graph: LayerGraph, index: int, pp: int) -> bool:
    """Whether layer ``index`` is an end of tied embeddings that a pipeline splits (pp > 1: the first
    and last layer sit in the first and last stage). Its stage holds the tied weight and sums its
    gradient with the other end's; it runs replicated over tp, since both ends must shard the
    weight alike."""
    return pp > 1 and bool(graph[index].tied_params)


def split_backward_mesh_refusal(mesh: Mesh) -> str | None:
    """Why the split-backward schedules (interleaved_zb, zbv, dualpipev) are not offered on ``mesh`` (None: they
    are): their runs are held to one device's numbers beside dp alone (``tests/passes/test_zero_bubble.py``: pp × dp,
    ZeRO ≤ 2); beside tp, cp, ep or HSDP replicas torch's separate input- and weight-gradient backwards have never
    been checked, so no plan, pinned or searched, runs them there."""
    beside = [f"{axis}={getattr(mesh, axis)}" for axis in ("tp", "cp", "ep", "dp_replicate") if getattr(mesh, axis) > 1]
    if not beside:
        return None
    return (f"the split-backward schedules (interleaved_zb, zbv, dualpipev) are held to one device's numbers beside "
            f"dp alone; beside {', '.join(beside)} they are not offered yet: use 1f1b or interleaved_1f1b there")


def schedule_refusal(graph: LayerGraph, kind: ScheduleKind, compiled: bool, recompute: bool = False,
                     zero3: bool = False) -> str | None:
    """Why a plan of ``graph`` cannot run the split-backward schedule ``kind`` (None: it can, or ``kind``
    splits nothing): pinned recompute or ZeRO-3 (:func:`offered_recomputes`, :func:`offered_zeros`), torch.compile
    (torch refuses it), or tied embeddings in a V (the first and last stage share a rank)."""
    if kind not in SPLIT_BACKWARD:
        return None
    if recompute:
        return (f"{kind.value} splits each backward into input and weight gradients, and a checkpointed layer "
                "would recompute its forward in both, which torch's checkpoint cannot: pin recompute=none")
    if zero3:
        return (f"{kind.value} runs each weight gradient apart from its input gradient, which FSDP2's resharded "
                "ZeRO-3 weights do not survive (wrong gradients): pin zero ≤ 2")
    if compiled:
        return (f"torch's {kind.value} splits each backward into input and weight gradients, which it does "
                "not run on torch.compile'd stages: plan it eager or use 1f1b / interleaved_1f1b")
    if kind in V_SHAPED and any(layer.tied_params for layer in graph):
        return (f"{kind.value} places the first and last stage on one rank (a V), where the tied input and "
                "output embeddings would be one weight in two stages: use interleaved_zb")
    return None


def data_parallel_modes(graph: LayerGraph, pp: int, dp: int, root_floor: int | None = None) -> list[DataParallelism]:
    """The data-parallel modes the solver searches for a mesh, each a configuration of its own:
    replicated, and sharded — with the root stage the pins force (:func:`root_floor`), else
    one the solver chooses."""
    if dp <= 1:
        return [REPLICATED]
    return [REPLICATED, DataParallelism(True, root_floor or 0)]


def offered_zeros(graph: LayerGraph, index: int, mode: DataParallelism, pp: int,
                  split_backward: bool = False) -> tuple[int, ...]:
    """The ZeRO stages layer ``index`` may take in ``mode``, each of which runs as priced. Under a schedule
    that splits backward, not ZeRO-3: FSDP2's resharded weights and torch's separate weight-gradient pass
    give wrong gradients (interleaved_zb × 2 and zbv, ``tests/passes/test_zero_bubble.py``)."""
    if not mode.sharded or not graph[index].param_count:
        return (0,)
    stages = ((mode.root_zero,) if mode.root_zero else ROOT_STAGES) if wrapping(graph, pp).root[index] else ZERO_STAGES
    return tuple(z for z in stages if z != 3) or (2,) if split_backward else stages


def admits_zero_pin(graph: LayerGraph, index: int, pinned: int, mode: DataParallelism, pp: int, *,
                    root_floor: int | None) -> bool:
    """Whether a layer pinned to ZeRO stage ``pinned`` can be planned in ``mode``.

    A layer without parameters has no unit, so any pin is moot. A root-unit
    layer runs at the root's stage. Where the pins shard some layer, the plan is
    sharded whatever a root layer asks, so the root runs at ``root_floor`` — the
    least stage that runs every pinned root layer, max(1, their pins) — and a
    layer pinned lower keeps its pin in the plan, is priced as it runs
    (:func:`effective_zero`) and is noted; ``root_floor`` is None when the pins
    shard nothing or pin no root layer, and then a root layer's pin must be the
    mode's own stage.
    """
    if not graph[index].param_count:
        return True
    if not mode.sharded:
        return pinned == 0
    if wrapping(graph, pp).root[index]:
        wanted = pinned if root_floor is None else root_floor
        return wanted == mode.root_zero if mode.root_zero else wanted in ROOT_STAGES
    return True


def effective_zero(graph: LayerGraph, index: int, zero: int, mode: DataParallelism, dp: int, pp: int) -> int:
    """The ZeRO stage layer ``index`` asking for ``zero`` runs at in ``mode`` (see the rules)."""
    if dp <= 1 or not graph[index].param_count or not mode.sharded:
        return 0
    if wrapping(graph, pp).root[index] and mode.root_zero:
        return mode.root_zero
    return zero


def root_floor(graph: LayerGraph, pinned_zeros: list[int | None], pp: int) -> int | None:
    """See :func:`admits_zero_pin`: the root stage pins force, from each layer's pinned zero (or None)."""
    params = [bool(layer.param_count) for layer in graph]
    if not any(z is not None and z >= 1 and p for z, p in zip(pinned_zeros, params)):
        return None
    roots = [z for z, root in zip(pinned_zeros, wrapping(graph, pp).root) if root and z is not None]
    return max([1, *roots]) if roots else None


def buffers_of(zero: int, has_params: bool = True) -> Buffers:
    """FSDP2's buffers a ZeRO stage makes its rank hold (a layer without parameters: none)."""
    if not has_params or zero <= 0:
        return Buffers.NONE
    return Buffers.PREFETCH if zero == 3 else Buffers.REDUCE_SCATTER


def dp_collectives(zero: int, microbatches: int) -> tuple[int, int, int]:
    """(all-reduces, reduce-scatters, all-gathers) a unit issues per step at ``zero``: ZeRO-0
    one all-reduce; ZeRO-1 RS + AG once (sync deferred to the last microbatch); ZeRO-2 RS per
    microbatch + AG; ZeRO-3 (2 AG + RS) per microbatch (weights gathered for forward and backward)."""
    m = microbatches
    return {0: (1, 0, 0), 1: (0, 1, 1), 2: (0, m, 1), 3: (0, m, 2 * m)}[zero]


def collective_share(graph: LayerGraph, index: int, engine: Engine, pp: int, grad_bytes: int) -> float:
    """How many of its engine's collectives (per kind, per step) layer ``index``'s traffic rides
    in: its share of their latency. ``engine`` is the plan's (:func:`plan_engine`). DDP packs
    every gradient into 25 MiB buckets; a replicated plan's one unit per part, and a sharded
    plan's root unit, are shared by a part's layers (a part holds about 1/pp of them); a
    block's unit is its own."""
    layer = graph[index]
    if layer.param_count == 0 or engine is Engine.NONE:
        return 0.0
    if engine is Engine.DDP:
        buckets = 1 + grad_bytes * graph.total_params / DDP_BUCKET_BYTES
        return layer.param_count / graph.total_params * buckets
    if engine is Engine.REPLICATE:
        return min(1.0, pp * layer.param_count / max(graph.total_params, 1))
    wrap = wrapping(graph, pp)
    if wrap.own[index]:
        return 1.0
    return min(1.0, pp * layer.param_count / max(wrap.root_params, 1))


# ---------------------------------------------------------------- rank layout


def pipeline_rank(stage: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank holding virtual stage ``stage`` (looped: s mod pp; in a V, zbv and dualpipev:
    s and 2·pp − 1 − s on one rank, :func:`autopar.cost_models.pipeline.stage_rank`)."""
    return stage_rank(stage, pp, v_shape)


def pipeline_ranks_per_node(mesh: Mesh, ranks_per_node: int) -> int:
    """How many consecutive pipeline ranks share one node: pipeline neighbours are
    ``mesh.stride("pp")`` ranks apart (every other axis's degrees), so a node of g ranks holds
    g / stride of them."""
    return max(1, min(ranks_per_node, mesh.world_size) // mesh.stride("pp"))


# ---------------------------------------------------------------- a plan's layout


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit (or the DDP root) of a part: the module it wraps and the layers it holds."""

    path: str  # module path in the model ("" = the part's root)
    zero: int
    engine: Engine
    layers: tuple[str, ...]

    @property
    def deferred(self) -> bool:
        """Whether gradient sync (and resharding) waits for the last microbatch (ZeRO-0/1)."""
        return self.zero <= 1


@dataclass(frozen=True)
class LayerRole:
    """What one layer runs as: its unit, the ZeRO stage that unit runs at, its engine, recompute."""

    name: str
    stage: int
    rank: int  # pipeline rank
    zero: int
    engine: Engine
    unit: str | None  # the unit's path; None when the layer has no parameters or dp = 1
    recompute: Recompute
    buffers: Buffers


@dataclass(frozen=True)
class Layout:
    """The contract for one plan: every layer's role and every part's units, innermost first."""

    mesh: Mesh
    mode: DataParallelism
    engine: Engine
    layers: tuple[LayerRole, ...]
    units: dict[int, tuple[Unit, ...]]  # per virtual stage

    def role(self, name: str) -> LayerRole:
        return next(r for r in self.layers if r.name == name)

    def stage_units(self, stage: int) -> tuple[Unit, ...]:
        return self.units.get(stage, ())

    def recompute_paths(self, graph: LayerGraph, stage: int | None = None) -> list[str]:
        """Module paths checkpointed in ``stage`` (every stage if None), in layer order."""
        return list(self.recompute_kinds(graph, stage))

    def recompute_kinds(self, graph: LayerGraph, stage: int | None = None) -> dict[str, Recompute]:
        """Each module checkpointed in ``stage`` (every stage if None) and how, in layer order; a
        module called by several layers is checkpointed as its first layer says (one set of hooks)."""
        kinds: dict[str, Recompute] = {}
        for layer, role in zip(graph, self.layers):
            if role.recompute and (stage is None or role.stage == stage):
                kinds.setdefault(layer.module_path, role.recompute)  # type: ignore[arg-type]
        return kinds

    def rank_buffers(self, rank: int) -> Buffers:
        """The FSDP2 buffers pipeline rank ``rank`` holds: the most any of its layers' units needs."""
        held = [r.buffers for r in self.layers if r.rank == rank]
        return max(held, default=Buffers.NONE)


def mode_of(graph: LayerGraph, dp: int, zeros: tuple[int, ...], pp: int) -> DataParallelism:
    """The data-parallel mode a plan's ZeRO stages put it in."""
    sharded = dp > 1 and any(z >= 1 and layer.param_count for layer, z in zip(graph, zeros))
    if not sharded:
        return REPLICATED
    roots = [z for z, root in zip(zeros, wrapping(graph, pp).root) if root]
    return DataParallelism(True, max(roots + [1]) if roots else 0)


def layout(graph: LayerGraph, mesh: Mesh, stages: tuple[int, ...], choices: tuple[LayerChoice, ...],
           v_shape: bool = False) -> Layout:
    """Every layer's role and every part's units for an assignment (see the module docstring); ``v_shape``:
    the schedule places its stages in a V (:func:`pipeline_rank`)."""
    pp, dp = mesh.pp, data_ranks(mesh)
    zeros = tuple(c.zero for c in choices)
    mode = mode_of(graph, dp, zeros, pp)
    engine = plan_engine(mesh, mode)
    wrap = wrapping(graph, pp)
    own, root = wrap.own, wrap.root
    index = {layer.name: i for i, layer in enumerate(graph)}
    units: dict[int, tuple[Unit, ...]] = {}
    unit_of: dict[int, tuple[str, int, Engine]] = {}
    for stage in sorted(set(stages)):
        members = [i for i, s in enumerate(stages) if s == stage]
        units[stage] = _part_units(graph, members, zeros, mode, engine, own, root)
        for unit in units[stage]:
            for name in unit.layers:
                unit_of[index[name]] = (unit.path, unit.zero, unit.engine)
    roles = []
    for i, layer in enumerate(graph):
        path, zero, eng = unit_of.get(i, (None, 0, Engine.NONE))
        has = path is not None and bool(layer.param_count)
        roles.append(LayerRole(layer.name, stages[i], pipeline_rank(stages[i], pp, v_shape), zero if has else 0,
                               eng if has else Engine.NONE, path if has else None,
                               recompute_runs_as(graph, i, pp, choices[i].recompute),
                               buffers_of(zero, has) if eng is not Engine.DDP else Buffers.NONE))
    return Layout(mesh, mode, engine, tuple(roles), units)


def _part_units(graph: LayerGraph, members: list[int], zeros: tuple[int, ...], mode: DataParallelism,
                engine: Engine, own: tuple[bool, ...], root: tuple[bool, ...]) -> tuple[Unit, ...]:
    """One part's units, innermost first and the root last."""
    names = tuple(graph[i].name for i in members)
    if engine is Engine.NONE:
        return ()
    if engine in (Engine.DDP, Engine.REPLICATE):
        return (Unit(ROOT, 0, engine, names),)
    blocks = [i for i in members if own[i]]
    if any(root[i] for i in members):
        root_zero = mode.root_zero
    else:
        root_zero = 2 if any(zeros[i] >= 1 for i in blocks) else 0
    out = [Unit(graph[i].module_path or ROOT, zeros[i], unit_engine(zeros[i]), (graph[i].name,))
           for i in sorted(blocks, key=lambda i: -(graph[i].module_path or "").count("."))]
    rest = tuple(graph[i].name for i in members if not own[i])
    return (*out, Unit(ROOT, root_zero, unit_engine(root_zero), rest))


def plan_layout(graph: LayerGraph, plan: Plan) -> Layout:
    """The contract for a Plan made for ``graph`` (as a pipeline runs it: :meth:`LayerGraph.pipeline_view`)."""
    if plan.mesh.pp > 1:
        graph = graph.pipeline_view()
    by_name = {lp.name: lp for lp in plan.layers}
    lps = [by_name[layer.name] for layer in graph]
    return layout(graph, plan.mesh, tuple(lp.stage for lp in lps), tuple(lp.choice for lp in lps),
                  plan.schedule in V_SHAPED)
