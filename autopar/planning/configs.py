"""Configurations: every mesh, microbatch count, schedule and data-parallel mode the pins allow.

A configuration (:class:`~autopar.planning.configuration.Configuration`) is what one
CP-SAT model is solved for: a mesh of the declared axes (:func:`autopar.mesh.meshes`:
degrees multiplying to the world size, each dividing what its axis splits, tp
within a node unless pinned), a microbatch count m dividing the per-replica batch, a
schedule (GPipe only where 1F1B cannot run, since under this cost model 1F1B
has GPipe's time and never more memory; interleaved 1F1B with 2 or 4 chunks
per rank), each data-parallel mode the contract offers
(:func:`autopar.contract.data_parallel_modes`), and under cp each attention method
that runs on the model (:func:`autopar.contract.cp_methods`: all-gather, the head
all-to-all where cp divides the key/value heads, the ring where it runs), so the solver takes the
cheapest.
"""

from __future__ import annotations

import math

from autopar import contract, contract_hsdp
from autopar.admission import mesh_refusal
from autopar.batch_coupling import refusal as coupling_refusal
from autopar.choice import CpAttention, Recompute
from autopar.cost_models.hardware import ClusterSpec
from autopar.cost_models.pipeline import SPLIT_BACKWARD, V_SHAPED, Schedule, ScheduleKind, schedule_refusal
from autopar.errors import CompileError, Float8Error, PinError
from autopar.graph import LayerGraph
from autopar.mesh import AXES, AxisLimits, Mesh, hosts_text, meshes
from autopar.mesh import axis as mesh_axis
from autopar.pins import Pins
from autopar.planning.configuration import Configuration, TrainingSpec

INTERLEAVED_CHUNKS = (2, 4)
ZB_CHUNKS = (1, 2, 4)  # interleaved_zb: ZB-H1 on one chunk a rank, interleaved on more
# The split-backward schedules (interleaved_zb, zbv, dualpipev) are searched with the others. Searching them once
# cost HF Llama 3 70B × 512 at 8,192 tokens 28,394 configurations keyed instead of 12,037 and 42 s of planning
# instead of 17 (load 5): the memory screen walked torch's action lists for their activations in flight, and each
# w simulated them at every microbatch count. Now their activations in flight are in closed form
# (cost_models.pipeline.split_backward_in_flight), w is simulated at 2p microbatches at most
# (schedule_sim.steady_microbatches), they are keyed from their GPipe/1F1B sibling's table and their own table is
# built only when the search reaches them (planning.candidates), and their pooled bound reads the floor of w. The
# free plan with them is never worse than without (tests/planning/test_zero_bubble_search.py, by brute force).
# The free search takes them on the meshes their runs against one device cover (split_proven: pp beside dp
# alone), which also keeps the 70B's count at 12,157. False plans them only where pinned.
SEARCH_SPLIT_BACKWARD = True
# cp inside pipeline stages (a mesh with both above 1, neither pinned) multiplies the configurations: Llama 3
# 70B at 131,072 tokens on 512 H100s has 8,914 with them against 1,318 without, DeepSeek-V3 on 1,024 100,954
# against 13,552. The free search takes them where the whole count stays within CP_PP_SEARCHED_UP_TO: the 70B
# then plans pp=2 × dp=8 × cp=32, 5.6% faster than the best plan without (OPTIMAL, 3.9 s of solve, 9.2-9.3 s
# whole process on an idle machine, best-first search: solver.solve), where DeepSeek-V3's 100,954 took 11.5 s
# to key by their cheap bounds alone and its search ran out the 30 s limit FEASIBLE. Past it they are left
# out and the plan says so (notes.search_notes); pinned, cp with pp is planned and lowered like any mesh.
CP_PP_SEARCHED_UP_TO = 16_384
CP_UNSEARCHED = "cp inside pipeline stages was not searched"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cut_positions(graph: LayerGraph) -> list[int]:
    """Positions q (cut before layer q) where a pipeline may be cut."""
    return [i + 1 for i, layer in enumerate(graph.layers[:-1]) if layer.can_cut_after]


def axis_limits(graph: LayerGraph, world_size: int, cluster: ClusterSpec, training: TrainingSpec) -> AxisLimits:
    """What every mesh axis's degree must divide or stay within for this request."""
    return AxisLimits(world_size=world_size, global_batch=training.global_batch,
                      max_stages=len(cut_positions(graph)) + 1, gpus_per_node=cluster.gpus_per_node,
                      experts=tuple(m.num_experts for layer in graph for m in layer.moe), layers=len(graph),
                      expert_refusal=next((m.ep_refusal for layer in graph for m in layer.moe if m.ep_refusal), ""),
                      seq_len=graph.seq_len or 0, context_refusal=graph.cp_refusal)


def enumerate_configs(graph: LayerGraph, world_size: int, cluster: ClusterSpec,
                      training: TrainingSpec, pins: Pins) -> list[Configuration]:
    """Every configuration the search takes (:func:`searched_configs`)."""
    return searched_configs(graph, world_size, cluster, training, pins)[0]


def idle_tp(graph: LayerGraph, mesh: Mesh) -> bool:
    """Whether ``mesh``'s tp ranks can only repeat each other's work: tp > 1, and no layer has a tensor-parallel
    style that runs on tp ranks (its heads and widths do not divide), so every layer is replicated over them."""
    return mesh.tp > 1 and not any(style.admits(mesh.tp) for layer in graph for style in layer.tp_styles)


def searched_configs(graph: LayerGraph, world_size: int, cluster: ClusterSpec,
                     training: TrainingSpec, pins: Pins, *, keep_idle: bool = False) -> tuple[list[Configuration], int]:
    """Every configuration the pins allow, less those with cp inside pipeline stages where neither is pinned
    and the whole count would pass :data:`CP_PP_SEARCHED_UP_TO`, and how many those are (0: none left out);
    raises PinError naming why none remain. A mesh whose tp ranks would repeat each other's work
    (:func:`idle_tp`) is searched only where tp is pinned, ``keep_idle`` is set, or no other mesh is left:
    a faster step it may price is one rank's step, with the other tp − 1 ranks spent on nothing."""
    pins.check_form()
    limits = axis_limits(graph, world_size, cluster, training)
    pinned = pins.mesh_degrees()
    _check_pinned_mesh(pinned, limits)
    check_cp_attention_pin(graph, pins, world_size)
    ring_device = contract.ring_device_refusal(cluster.backend, training.dtype)
    if ring_device and pins.cp_attention is CpAttention.RING:
        raise PinError(f"pin cp_attention=ring: {ring_device}")
    layer_pins = pins.resolve_layers([layer.name for layer in graph])
    pinned_zeros = [pin.get("zero") for pin in layer_pins]
    recomputed = any(Recompute.of(pin.get("recompute", Recompute.NONE)) is not Recompute.NONE for pin in layer_pins)
    zero3 = any(z == 3 for z in pinned_zeros)
    refused = {k: why for k in SPLIT_BACKWARD
               if (why := contract.schedule_refusal(graph, k, training.compiled, recomputed, zero3))}
    if pins.schedule in refused:
        raise PinError(f"pin schedule={pins.schedule.value}: {refused[pins.schedule]}")
    configs: list[Configuration] = []
    unmet = ""  # why a mesh was left out only because the pinned method cannot run on it
    compile_refused: list[str] = []
    split_refused = ""  # why a configuration was left out only because it splits a batch-coupled layer's batch
    staged: list[Configuration] = []  # cp inside pipeline stages, neither pinned: searched up to a count
    hsdp_refused = ""  # why a mesh was left out only because its pinned dp_replicate cannot run
    unproven = ""  # why a mesh was left out only because the pinned split-backward schedule is unproven on it
    for mesh in meshes(limits, pinned):
        if contract.ep_refusal(mesh, graph) or contract.cp_refusal(mesh, graph):
            continue
        if not _replicas_searched(mesh, pins, pinned, cluster):
            continue
        if why := contract_hsdp.hsdp_refusal(mesh, sharded=False if pins.zero == 0 else None,
                                             compiled=training.compiled, float8=training.float8 is not None):
            hsdp_refused = hsdp_refused or why
            continue
        methods = tuple(m for m in _cp_methods(graph, mesh, pins) if not (ring_device and m is CpAttention.RING))
        if not methods:
            unmet = unmet or contract.method_refusal(pins.cp_attention, graph, mesh) or ""
            continue
        if why := mesh_refusal(graph, mesh, training.compiled, training.float8 is not None):
            compile_refused.append(why)  # the runtime asked for would not run it (autopar.admission): not offered
            continue
        if pins.schedule in SPLIT_BACKWARD and (why := contract.split_backward_mesh_refusal(mesh)):
            unproven = unproven or why  # a pinned split-backward schedule is never planned where it is unproven
            continue
        floor = contract.root_floor(graph, pinned_zeros, mesh.pp)
        per_replica = training.global_batch // mesh.dp
        for m in [pins.microbatches] if pins.microbatches else _divisors(per_replica):
            if per_replica % m:
                continue
            if why := coupling_refusal(graph, mesh, m, training.batch_coupled):
                split_refused = split_refused or why  # not one device's numbers: never offered
                continue
            into = staged if mesh.cp > 1 and mesh.pp > 1 and not {"cp", "pp"} & set(pinned) else configs
            into += [Configuration(mesh, m, s, mode, method)
                     for s in _schedules(mesh.pp, m, limits.max_stages, pins, refused, split_proven(mesh))
                     for mode in contract.data_parallel_modes(graph, mesh.pp, contract.data_ranks(mesh), floor)
                     if mode.sharded or mesh.dp_replicate == 1  # replicas of ZeRO's shards: sharded plans only
                     for method in methods]
    # counted as measured before the split-backward schedules were searched: their twins are keyed by a floor of
    # w (pipeline_price.bubble_weight_floor) and most are never priced
    counted = sum(not c.schedule.split_backward for c in (*configs, *staged))
    left_out = len(staged) if configs and counted > CP_PP_SEARCHED_UP_TO else 0
    configs += [] if left_out else staged
    if not keep_idle and "tp" not in pinned:
        configs = [c for c in configs if not idle_tp(graph, c.mesh)] or configs
    if not configs and unmet:
        raise PinError(f"pin cp_attention={pins.cp_attention}: {unmet} (and no other mesh the pins allow runs it)")
    if not configs and pins.dp_shard is not None:
        raise PinError(f"pin dp_shard={pins.dp_shard}: no mesh the other pins and batch size "
                       f"{training.global_batch} allow has a dp that is {pins.dp_shard} × dp_replicate"
                       + (f" ({hsdp_refused})" if hsdp_refused else ""))
    if not configs and hsdp_refused:
        raise PinError(f"{hsdp_refused} (and no other mesh the pins allow runs)")
    if not configs and split_refused:
        raise PinError(split_refused)
    if not configs and unproven:
        raise PinError(f"pin schedule={pins.schedule.value}: {unproven}")
    if not configs and compile_refused and not training.compiled:
        raise Float8Error(f"{compile_refused[0]}: plan it without --float8, or pin tp=1 pp=1 ep=1")
    if not configs and compile_refused:
        raise CompileError(f"torch.compile does not run {compile_refused[0]}: pin pp=1 for a refused pipeline, "
                           "ep or cp beside dp alone, or plan it eager (drop --compile / torch_compile)")
    if not configs:
        raise PinError(why_no_config(graph, world_size, training, pins, limits.max_stages))
    return configs, left_out


def _replicas_searched(mesh: Mesh, pins: Pins, pinned: dict[str, int], cluster: ClusterSpec) -> bool:
    """Whether ``mesh``'s dp_replicate is one this request plans: the pinned ``dp_shard`` (dp / dp_replicate),
    the pinned ``dp_replicate``, or with neither pinned 1 and the node-sized shard group
    (:func:`autopar.contract_hsdp.searched_replicas`)."""
    if pins.dp_shard is not None:
        return contract_hsdp.dp_shard(mesh) == pins.dp_shard
    return "dp_replicate" in pinned or contract_hsdp.searched_replicas(mesh, cluster.gpus_per_node)


def _cp_methods(graph: LayerGraph, mesh: Mesh, pins: Pins) -> tuple[CpAttention, ...]:
    """The attention methods this mesh is searched with: the one pinned (at cp = 1 moot: all-gather),
    else every one that runs (:func:`autopar.contract.cp_methods`)."""
    if mesh.cp <= 1:
        return (CpAttention.ALL_GATHER,)
    offered = contract.cp_methods(graph, mesh)
    return offered if pins.cp_attention is None else tuple(m for m in offered if m is pins.cp_attention)


def check_cp_attention_pin(graph: LayerGraph, pins: Pins, world_size: int) -> None:
    """A Ulysses or ring pin where no cp degree it may run at (the pinned one, else any above 1 dividing
    the world) runs it beside the pinned tp, pp and ep (Ulysses: cp × tp dividing the key/value heads;
    ring: on SDPA calls): one line naming why, before anything is priced."""
    method = pins.cp_attention
    if method is None or method is CpAttention.ALL_GATHER:
        return
    pinned = pins.mesh_degrees()
    if pinned.get("cp") == 1:
        raise PinError(f"pin cp_attention={method} splits attention over cp ranks, but cp=1 is pinned")
    degrees = [pinned["cp"]] if "cp" in pinned else [d for d in range(2, world_size + 1) if world_size % d == 0]
    beside = {a: pinned.get(a, 1) for a in ("tp", "pp", "ep")}
    whys = [contract.method_refusal(method, graph, Mesh.of({"cp": d, **beside})) for d in degrees]
    if whys and all(whys):
        raise PinError(f"pin cp_attention={method}: {whys[0]}")


def _check_pinned_mesh(pinned: dict[str, int], limits: AxisLimits) -> None:
    """Pinned degrees that cannot multiply into the world, each named (a folded axis, ep, borrows
    its host's ranks: it must divide its host's pin and multiplies nothing)."""
    for a in AXES:
        if (a.folds is not None and a.name in pinned and all(h in pinned for h in a.folds)
                and math.prod(pinned[h] for h in a.folds) % pinned[a.name]):
            raise PinError(f"the pinned {a.name}={pinned[a.name]} does not divide the pinned "
                           f"{hosts_text(a, pinned)} ({a.name} borrows its ranks from {' × '.join(a.folds)})")
        if a.folds is not None and a.name in pinned and (why := a.refusal(pinned[a.name], limits)):
            raise PinError(f"pin {a.name}={pinned[a.name]}: {why}")
        # what cp splits is the model's (its sequence, its attention): say so before the batch is blamed
        if a.name == "cp" and a.name in pinned and (why := a.refusal(pinned[a.name], limits)):
            raise PinError(f"pin {a.name}={pinned[a.name]}: {why}")
    pinned = {k: v for k, v in pinned.items() if mesh_axis(k).folds is None}
    product = math.prod(pinned.values())
    if limits.world_size % product:
        names = " × ".join(f"{k}={v}" for k, v in pinned.items())
        total = f" = {product}" if len(pinned) > 1 else ""
        raise PinError(f"world size {limits.world_size} is not a multiple of the pinned {names}{total}")
    # every axis that could take a degree above 1 pinned (cp on a model it cannot split stays at 1)
    free = [a for a in AXES if a.folds is None and a.name not in pinned
            and not (a.name == "cp" and a.searched_degrees(limits) == [1])]
    if not free and product != limits.world_size:
        names = " × ".join(pinned)
        raise PinError(f"pinned {names} = {product} but the world size is {limits.world_size}")


def split_proven(mesh: Mesh) -> bool:
    """Whether the split-backward schedules are planned on ``mesh``, searched or pinned: pp beside dp alone (ZeRO ≤ 2,
    no HSDP replicas), the meshes their runs against one device cover (:func:`autopar.contract.
    split_backward_mesh_refusal`)."""
    return contract.split_backward_mesh_refusal(mesh) is None


def _schedules(pp: int, m: int, max_stages: int, pins: Pins,
               refused: dict[ScheduleKind, str] | None = None, split_searched: bool = True) -> list[Schedule]:
    """The schedules searched for pp ranks and m microbatches: GPipe only where 1F1B cannot run, interleaved
    1F1B with 2 or 4 chunks, and where pinned (or :data:`SEARCH_SPLIT_BACKWARD` and ``split_searched``:
    :func:`split_proven`) the split-backward ones (interleaved_zb with 1, 2 or 4 chunks, zbv and dualpipev with 2
    in a V) but those ``refused`` says the model cannot run (:func:`autopar.contract.schedule_refusal`); each where
    torch runs it (:func:`autopar.cost_models.pipeline.schedule_refusal`) and the stages can be cut."""
    if pp == 1:
        return [Schedule(ScheduleKind.NONE)] if pins.schedule in (None, ScheduleKind.NONE) else []
    out: list[Schedule] = []
    want = pins.schedule
    if want is ScheduleKind.GPIPE or (want is None and m < pp and pins.chunks in (None, 1)):
        out.append(Schedule(ScheduleKind.GPIPE))
    if want in (None, ScheduleKind.ONE_F_ONE_B) and m >= pp and pins.chunks in (None, 1):
        out.append(Schedule(ScheduleKind.ONE_F_ONE_B))
    chunked = {ScheduleKind.INTERLEAVED_1F1B: INTERLEAVED_CHUNKS, ScheduleKind.INTERLEAVED_ZB: ZB_CHUNKS,
               ScheduleKind.ZBV: (2,), ScheduleKind.DUALPIPE_V: (2,)}
    for kind, counts in chunked.items():
        if want not in (None, kind) or kind in (refused or {}) or (kind in SPLIT_BACKWARD and (
                not split_searched or (want is None and not SEARCH_SPLIT_BACKWARD))):
            continue
        for v in [pins.chunks] if pins.chunks else counts:
            if pp * v <= max_stages and v in counts and not schedule_refusal(kind, pp, m, v):
                out.append(Schedule(kind, v))
    return out


def _blocked(graph: LayerGraph) -> str:
    reasons = list(dict.fromkeys(l.cut_blocked_by for l in graph if l.cut_blocked_by))
    ties = [r for r in reasons if not r.startswith("a cut after ")]
    said = [f"no cut goes where {r}" if r in ties else r for r in reasons[:2]]
    return f"; {'; '.join(said)}" if said else ""


def _cp_stays_1(graph: LayerGraph, world: int, batch: int, max_stages: int, pinned: dict[str, int]) -> bool:
    """Whether cp can only be 1 here: the model cannot split its sequence, or the pins put it beside
    an axis cp is not lowered with (``contract.cp_refusal``)."""
    limits = AxisLimits(world, batch, max_stages, world, seq_len=graph.seq_len or 0, context_refusal=graph.cp_refusal)
    beside = Mesh.of({**{k: v for k, v in pinned.items() if k not in ("ep", "cp")}, "cp": 2})
    return mesh_axis("cp").searched_degrees(limits) == [1] or contract.cp_refusal(beside, graph) is not None


def why_no_config(graph: LayerGraph, world: int, training: TrainingSpec, pins: Pins, max_stages: int) -> str:
    b = training.global_batch
    pinned = pins.mesh_degrees()
    pp, dp = pinned.get("pp"), pinned.get("dp")
    chunks = pins.chunks or (2 if pins.schedule in V_SHAPED else 1)
    if pp and pp * chunks > max_stages:
        return (f"pp={pp}{f' × chunks={chunks}' if chunks > 1 else ''} needs "
                f"{pp * chunks} pipeline stages but the model can be cut into at "
                f"most {max_stages} (it has {max_stages - 1} places a cut may go)" + _blocked(graph))
    if dp and b % dp:
        return f"batch size {b} does not divide over the pinned dp={dp}"
    if (ep := pinned.get("ep", 1)) > 1 and (why := contract.ep_refusal(Mesh(pp=pp or 1, dp=ep, ep=ep), graph)):
        return why
    # ep with the pins' other axes (its ranks borrowed from the pinned cp, dp at least ep/cp): cp × ep is
    # refused beside tp or pp, and that is the reason to give
    beside = {k: v for k, v in pinned.items() if k != "ep"}
    if ep > 1 and beside.get("cp", 1) > 1:
        beside |= {"ep": ep, "dp": math.lcm(beside.get("dp", 1), ep // math.gcd(ep, beside["cp"]))}
    if pinned.get("cp", 1) > 1 and (why := contract.cp_refusal(Mesh.of(beside), graph)):
        return why
    if ep > 1:
        return (f"no mesh for world size {world} and batch size {b} has a dp × cp degree that the "
                f"pinned ep={ep} divides (ep borrows its ranks from dp × cp)")
    if dp and pins.microbatches and b % (dp * pins.microbatches):
        return (f"batch size {b} does not divide into the pinned dp={dp} × "
                f"microbatches={pins.microbatches}")
    if pp and pins.microbatches and pins.schedule and (why := schedule_refusal(pins.schedule, pp, pins.microbatches,
                                                                                chunks)):
        return why
    if pins.microbatches:
        return (f"batch size {b} cannot give microbatches={pins.microbatches} on any data-parallel "
                f"degree of world size {world} that the other pins allow")
    if pins.schedule or pins.chunks:
        return (f"no mesh for world size {world} and batch size {b} can run the pinned schedule "
                f"({pins.schedule.value if pins.schedule else 'interleaved_1f1b'}); interleaved "
                "1F1B and interleaved_zb need microbatches divisible by pp, dualpipev at least 2 × pp, and zbv "
                "and dualpipev 2 × pp stages")
    axes = " × ".join(a.name for a in AXES if a.searched and a.folds is None)  # ep multiplies nothing
    if not pinned:
        return (f"no mesh {axes} = {world} divides batch size {b}; use a batch size divisible "
                "by the data-parallel degree")
    named = " × ".join(f"{k}={v}" for k, v in pinned.items())
    free = [a.name for a in AXES if a.searched and a.name not in pinned and a.folds is None
            and not (a.name == "cp" and _cp_stays_1(graph, world, b, max_stages, pinned))]
    if free == ["dp"]:  # every other axis pinned: dp is what is left of the world size
        dp = world // math.prod(v for k, v in pinned.items() if mesh_axis(k).folds is None)
        return (f"the pinned {named} leave dp={dp} for world size {world}, which does not divide batch "
                f"size {b}; use a batch size divisible by {dp}")
    return (f"no mesh {axes} = {world} with the pinned {named} divides batch size {b}; use a "
            "batch size divisible by the data-parallel degree")
