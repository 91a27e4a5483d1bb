"""Admission: every reason a plan cannot run here, decided in one place.

One function, :func:`refusals`, of (the graph, the plan, :class:`Here`: what this run is and asks — the
world launched, the device, torch.compile, float8, the MoE bias step) returns every reason the runtime
would not run the plan exactly as priced, each with the typed error it is raised as. The planner asks the
same rules of a mesh before offering it (:func:`mesh_refusal`: what the compiled and float8 runtimes run),
``compile`` calls :func:`admit` once before lowering and ``verify`` before it builds the model, so what is
offered and what is refused cannot drift apart (a plan offered and then refused at rank start was the bug
this module exists to prevent). Torch-free: the runtime gathers the facts (:mod:`autopar.runtime.here`).

The rules, by feature:

* **world**: the plan's world size is the ranks launched (and the ``world_size`` given).
* **layout**: hybrid sharding only where it runs; batch-coupled layers run as ``batch_coupled`` says.
* **torch.compile**: asked (``torch_compile``) only as priced (``training.compiled``); a compiled plan's
  mesh must be one the compiled runtime runs (:func:`autopar.contract_compile.compile_refusal`), its recompute
  one an op-level policy can see, and its experts not split over tp (:func:`compiled_refusals`).
* **float8**: asked only as priced, in the recipe priced; DDP and ZeRO/FSDP2 plans only (no tp, pp or
  ep: :func:`float8_refusals`); a CUDA device of compute capability 8.9 or later, or a CPU (emulated).
* **tensor, expert and context parallelism** (:func:`layer_refusals`, from the graph alone): each tp layer's
  style admits the degree, its sequence parallelism and segments too; ep divides every block's experts under
  :func:`autopar.contract.ep_refusal`; cp splits the sequence, with an attention method the model takes. The
  passes ask the same before lowering, and add only what they read from the module itself (that it is the
  module captured).
* **pipelines** (:func:`pipeline_refusals`, from the graph alone): a split-backward schedule only beside what it
  splits; inside stages that call no layer module, no tp, recompute or dp-summed BatchNorm.
* **MoE bias updates** (DeepSeek-V3's auxiliary-loss-free balancing): γ finite and ≥ 0; a model with a
  biased router; not under pp, torch.compile, or sequence parallelism on an MoE layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.batch_coupling import refusal as coupling_refusal
from autopar.batch_coupling import synced
from autopar.choice import CpAttention
from autopar.contract import (
    cp_admits_style,
    cp_refusal,
    data_ranks,
    ep_refusal,
    experts_split_refusal,
    ring_refusal,
    schedule_refusal,
    split_backward_mesh_refusal,
    tp_applies,
    ulysses_refusal,
)
from autopar.contract_compile import BREAK_RECOMPUTES, compile_refusal, compiled_break
from autopar.contract_hsdp import hsdp_refusal
from autopar.cost_models.gpu_figures import FP8_MIN_COMPUTE_CAPABILITY
from autopar.cost_models.pipeline import SPLIT_BACKWARD
from autopar.errors import AutoparError, CompileError, Float8Error, LoweringError, PlanError
from autopar.experts.layouts import ROUTER_BIAS as BIAS
from autopar.float8 import NEEDS
from autopar.graph import LayerGraph
from autopar.mesh import Mesh
from autopar.plan import Plan

FLOAT8_AXES = ("tp", "pp", "ep")  # the axes float8 training does not run above degree 1 (float8_refusals)


@dataclass(frozen=True)
class Here:
    """What this run is and asks, as the runtime found it (:func:`autopar.runtime.here.here`).

    ``launched_world``: the process group's size (None: not launched). ``device``: ``"cpu"``, ``"cuda"`` or
    another torch device type; ``capability``/``device_name`` describe a CUDA device. ``torch_compile`` and
    ``float8``: what was asked (None: as the plan says). ``biased_routers``: the model's routers with a
    balance bias (:data:`autopar.experts.layouts.ROUTER_BIAS`) (counted only when ``moe_bias_update`` asks for them)."""

    world_size: int
    launched_world: int | None = None
    device: str = "cpu"
    capability: tuple[int, int] | None = None
    device_name: str = ""
    torch_compile: bool | None = None
    float8: Any = None
    moe_bias_update: float = 0.0
    biased_routers: int = 0


@dataclass(frozen=True)
class Refusal:
    """One reason a plan does not run here, and the error it is raised as."""

    error: type[AutoparError]
    reason: str


def admit(graph: LayerGraph | None, plan: Plan, here: Here) -> None:
    """Raise the first of :func:`refusals` (its own error type); return when the plan runs here."""
    found = refusals(graph, plan, here)
    if found:
        raise found[0].error(found[0].reason)


def refusals(graph: LayerGraph | None, plan: Plan, here: Here) -> list[Refusal]:
    """Every reason ``plan`` does not run here as priced (empty: it runs). ``graph`` None: the rules that
    need the model's layers are left out (checked again once it is captured)."""
    return [*_world(plan, here), *_layout(graph, plan), *_compiled(graph, plan, here), *_float8(plan, here),
            *_bias_update(graph, plan, here), *(layer_refusals(graph, plan) if graph is not None else [])]


def layer_refusals(graph: LayerGraph, plan: Plan) -> list[Refusal]:
    """Why the passes cannot lower ``plan``'s tp, ep or cp on this graph (empty: they can), each a
    :class:`LoweringError`; the module docstring's rules."""
    return [Refusal(LoweringError, why) for why in
            (*tensor_parallel_refusals(graph, plan), *expert_parallel_refusals(graph, plan),
             *context_parallel_refusals(graph, plan), *pipeline_refusals(graph, plan))]


def mesh_refusal(graph: LayerGraph | None, mesh: Mesh, compiled: bool, float8: bool) -> str | None:
    """Why the runtime asked for (compiled, float8) does not run ``mesh`` (None when it does): what the
    planner leaves out before pricing, by the rules :func:`refusals` applies to a plan."""
    if compiled and (why := compile_refusal(graph, mesh)):
        return why
    if why := hsdp_refusal(mesh, compiled=compiled, float8=float8):
        return why
    if float8 and (axes := [f"{a}={mesh[a]}" for a in FLOAT8_AXES if mesh[a] > 1]):
        return f"float8 training does not run {', '.join(axes)} yet"
    return None


def compiled_refusals(plan: Plan, graph: LayerGraph | None = None) -> list[str]:
    """What in ``plan`` the compiled runtime does not run yet (empty when it does): the contract's
    :func:`~autopar.contract_compile.compile_refusal` (``graph`` None: the mesh's axes only), selective or
    alternate-mm recompute of a block compiled around an eager exchange, a layer planned tensor parallel on
    a mesh without tp, and experts split over tp (eager only)."""
    why = [r] if (r := compile_refusal(graph, plan.mesh)) else []
    if graph is not None:
        index = {layer.name: layer.index for layer in graph}
        broken = sorted(f"{lp.name} ({lp.choice.recompute})" for lp in plan.layers
                        if lp.choice.recompute not in BREAK_RECOMPUTES and lp.name in index
                        and compiled_break(graph, index[lp.name], plan.mesh, plan.cp_attention))
        if broken:  # full recompute runs there, the checkpoint eager around the compiled block
            why.append(f"recompute of {', '.join(broken)} in a block compiled around an eager "
                       f"{'experts dispatch (ep)' if plan.mesh.ep > 1 else 'ring (cp)'}, whose compiled ops an "
                       f"op-level policy cannot see (pin recompute=full there)")
    if plan.mesh.tp == 1 and any(lp.choice.tp is not None for lp in plan.layers):
        why.append("tensor parallelism (tp=1 with tensor-parallel layer choices)")
    split = [lp.name for lp in plan.layers if graph is not None and lp.choice.tp is not None
             and graph.layer(lp.name).tp_style(lp.choice.tp).experts]
    if split:  # passes/expert_tensor.py's forward is eager only (not traced under the sharding rules)
        why.append(f"routed experts split over tp (megatron+experts: {', '.join(split[:2])})")
    return why


def float8_refusals(plan: Plan) -> list[str]:
    """What in ``plan`` the float8 runtime does not run (empty when it does): tensor parallelism (autopar's
    sharding runtime rewrites the linears' ops itself; torchao's float8 tensor-parallel styles are not wired
    in), pipelines and experts (not tried)."""
    m, why = plan.mesh, []
    if m.tp > 1 or any(lp.choice.tp is not None for lp in plan.layers):
        why.append(f"tensor parallelism (tp={m.tp})")
    for axis, what in (("pp", "a pipeline"), ("ep", "expert parallelism")):
        if m[axis] > 1:
            why.append(f"{what} ({axis}={m[axis]})")
    return why


def float8_device_refusal(here: Here) -> str | None:
    """Why this process's device cannot run the float8 matmuls (None: it can, or a CPU emulates them)."""
    if here.device == "cpu":
        return None
    if here.device != "cuda":
        return f"--float8: this process's device is {here.device}, which torchao's float8 does not run on; {NEEDS}"
    if here.capability is not None and here.capability < FP8_MIN_COMPUTE_CAPABILITY:
        major, minor = here.capability
        return f"--float8: {here.device_name} is SM {major}.{minor} and has no float8 matmuls; {NEEDS}"
    return None


def launch_hint(world_size: int) -> str:
    return (f"launch one process per rank: `torchrun --nproc-per-node {world_size} script.py` "
            f"or `autopar run script.py --nproc {world_size}`")


def _world(plan: Plan, here: Here) -> list[Refusal]:
    out = []
    if here.launched_world is not None and here.launched_world != plan.world_size:
        out.append(Refusal(PlanError, f"the plan is for {plan.world_size} ranks but {here.launched_world} were "
                                      f"launched: re-plan for {here.launched_world} or {launch_hint(plan.world_size)}"))
    if plan.world_size != here.world_size:
        out.append(Refusal(PlanError, f"the plan is for {plan.world_size} ranks but world_size is "
                                      f"{here.world_size}: re-plan for this world size"))
    return out


def _layout(graph: LayerGraph | None, plan: Plan) -> list[Refusal]:
    """The mesh's own rules: hybrid sharding where it runs (:func:`autopar.contract_hsdp.hsdp_refusal`), and the
    batch-coupled layers run as the plan's ``batch_coupled`` says (:func:`autopar.batch_coupling.refusal`)."""
    t, out = plan.training, []
    if why := hsdp_refusal(plan.mesh, compiled=t.compiled, float8=t.float8 is not None):
        out.append(Refusal(LoweringError, why))
    if graph is not None and (why := coupling_refusal(graph, plan.mesh, plan.microbatches, t.batch_coupled)):
        out.append(Refusal(LoweringError, why))
    return out


def _compiled(graph: LayerGraph | None, plan: Plan, here: Here) -> list[Refusal]:
    priced = plan.training.compiled
    if here.torch_compile is not None and bool(here.torch_compile) != priced:
        return [Refusal(CompileError, f"the plan was priced {'compiled' if priced else 'eager'} (training.compiled "
                                      f"{str(priced).lower()}) but torch_compile={here.torch_compile} was asked: "
                                      f"re-plan {'without' if priced else 'with'} --compile, or leave "
                                      f"torch_compile unset")]
    why = compiled_refusals(plan, graph) if priced else []
    if why:
        return [Refusal(CompileError, f"torch.compile runs DDP, ZeRO/FSDP2, pipeline, tensor-, expert- and "
                                      f"context-parallel plans (with or without recompute) only; this plan has "
                                      f"{' and '.join(why)}: run it eagerly (drop --compile / torch_compile), or "
                                      f"pin it to what compiles (ep or cp beside dp alone, pp=1 for a refused "
                                      f"pipeline)")]
    return []


def _float8(plan: Plan, here: Here) -> list[Refusal]:
    priced, asked = plan.training.float8, here.float8
    if asked is not None and bool(asked) != (priced is not None):
        return [Refusal(Float8Error, f"the plan was priced {'with' if priced else 'without'} float8 "
                                     f"(training.float8) but float8={asked!r} was asked: re-plan "
                                     f"{'without' if priced else 'with'} --float8, or leave float8 unset")]
    if priced is None:
        return []
    out = []
    if asked not in (None, True, False) and str(asked) != priced.recipe.value:
        out.append(Refusal(Float8Error, f"the plan was priced with {priced.recipe.value} float8 scaling, not "
                                        f"{asked}: re-plan with --float8 {asked}"))
    if why := float8_refusals(plan):
        out.append(Refusal(Float8Error, f"float8 training runs DDP and ZeRO/FSDP2 plans only; this plan has "
                                        f"{' and '.join(why)}: re-plan with --float8 (which pins "
                                        f"{' '.join(a + '=1' for a in FLOAT8_AXES)})"))
    if why := float8_device_refusal(here):
        out.append(Refusal(Float8Error, why))
    return out


def _bias_update(graph: LayerGraph | None, plan: Plan, here: Here) -> list[Refusal]:
    gamma = here.moe_bias_update
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma >= 0 or math.isinf(gamma):
        return [Refusal(LoweringError, f"moe_bias_update must be a finite float ≥ 0 (the bias step γ; 0 = off), "
                                       f"got {gamma!r}")]
    if gamma == 0:
        return []
    out = []
    if not here.biased_routers:
        out.append(Refusal(LoweringError, f"moe_bias_update={gamma:g} moves each router's {BIAS}, and no MoE "
                                          "router of this model has one (DeepSeek-V3-style routers do)"))
    if plan.mesh.pp > 1:
        out.append(Refusal(LoweringError, f"moe_bias_update does not run under a pipeline yet (pp={plan.mesh.pp}): "
                                          "plan with pp=1"))
    if plan.training.compiled:
        out.append(Refusal(LoweringError, "moe_bias_update does not run with torch.compile yet (its counting hook "
                                          "would run inside the compiled blocks): plan without --compile"))
    sp = [lp.name for lp in plan.layers if graph is not None and lp.choice.sp and graph.layer(lp.name).moe]
    if sp:
        out.append(Refusal(LoweringError, f"moe_bias_update does not run with sequence parallelism on an MoE layer "
                                          f"yet ({sp[0]!r}: its router would count one tp rank's share of the "
                                          "tokens)"))
    return out


def tensor_parallel_refusals(graph: LayerGraph, plan: Plan, tp: int | None = None) -> list[str]:
    """Why the plan's tensor-parallel layers do not run at ``tp`` (default: the mesh's)."""
    tp, names, out = plan.mesh.tp if tp is None else tp, {layer.name for layer in graph}, []
    for lp in plan.layers:
        if lp.choice.tp is None:
            continue
        if lp.name not in names:
            out.append(f"the plan names layer {lp.name!r}, which the model does not have")
            continue
        try:
            style = graph.layer(lp.name).tp_style(lp.choice.tp)
        except KeyError as exc:
            out.append(str(exc.args[0]))
            continue
        if not style.admits(tp):
            proved = f"; capture proved it exact at tp={list(style.checked)}" if style.checked else ""
            out.append(f"layer {lp.name!r}: tp={tp} does not divide the sizes its {style.name!r} style splits "
                       f"{list(style.divisors)}{proved}; pick such a tp or plan the layer with tp=none")
            continue
        if why := experts_split_refusal(style, plan.mesh):
            out.append(f"layer {lp.name!r}: {why}")
        if lp.choice.sp and not style.admits_sequence(tp):
            why = style.sequence_refusal or f"capture proved it at tp={list(style.sequence)}"
            out.append(f"layer {lp.name!r}: sequence parallelism does not run at tp={tp} ({why}); plan it with sp=off")
        out += [f"module {path!r}: tp={tp} does not divide its output's segments {list(segs)}"
                for path, segs in style.segments.items()
                if any(s % tp for i, s in enumerate(segs) if i not in style.whole.get(path, ()))]
    return out


def expert_parallel_refusals(graph: LayerGraph, plan: Plan) -> list[str]:
    """Why the plan's ep does not run on these layers (what the module itself must also be: the pass's)."""
    ep = plan.mesh.ep
    if ep <= 1:
        return []
    names = {layer.name for layer in graph}
    blocks = [(lp.name, m) for lp in plan.layers if lp.name in names for m in graph.layer(lp.name).moe]
    if not blocks:
        return [f"ep={ep} shards experts, but none of the model's {len(graph)} layers has any"]
    if why := ep_refusal(plan.mesh, graph):
        return [why]
    return [f"layer {name!r}: ep={ep} does not divide its {facts.num_experts} experts"
            for name, facts in blocks if facts.num_experts % ep]


def context_parallel_refusals(graph: LayerGraph, plan: Plan) -> list[str]:
    """Why the plan's cp does not run on this graph."""
    cp, mesh = plan.mesh.cp, plan.mesh
    if cp <= 1:
        return []
    if why := cp_refusal(mesh, graph):
        return [why]
    if graph.cp_refusal:
        return [f"cp={cp} cannot split this model's sequence: {graph.cp_refusal}"]
    out = []
    whole = [lp.name for lp in plan.layers if lp.choice.tp is not None and mesh.tp > 1
             and not cp_admits_style(graph.layer(lp.name).tp_style(lp.choice.tp), mesh)]
    if whole:
        out.append(f"cp={cp} with tp={mesh.tp}: {', '.join(whole)} hold key/value projections whole on every tp "
                   "rank, which cp cannot gather per head; plan them with tp=none")
    if plan.cp_attention is CpAttention.ULYSSES and (why := ulysses_refusal(graph, mesh)):
        out.append(why)
    if plan.cp_attention is CpAttention.RING and (why := ring_refusal(graph, mesh)):
        out.append(why)
    if not graph.seq_len or graph.seq_len % (2 * cp):
        out.append(f"cp={cp} needs the sequence length divisible by 2·cp = {2 * cp}, got {graph.seq_len}")
    loose = [p for p in (*graph.cp_positions, *graph.cp_attention) if mesh.pp > 1 and owning_layer(graph, p) is None]
    if loose:
        out.append(f"cp={cp} with pp={mesh.pp}: {', '.join(loose[:3])} belong to no layer, so no pipeline stage is "
                   "known to hold them; use pp=1")
    return out


def pipeline_refusals(graph: LayerGraph, plan: Plan) -> list[str]:
    """Why the plan's pipeline does not run on this graph as priced: a split-backward schedule beside what it
    cannot split (:func:`autopar.contract.schedule_refusal`: recompute, ZeRO-3, torch.compile, tied ends in a V),
    and, where the stages are single traced graphs that call no layer module (:func:`autopar.contract.tp_applies`),
    the per-module rules a stage cannot hook: tensor parallelism, recompute, and BatchNorm statistics summed over
    dp. A plan the planner made never has these; one written or edited by hand is refused before any rank starts
    (it would run with the wrong gradients, or fail in the pipeline pass)."""
    pp, mesh = plan.mesh.pp, plan.mesh
    if pp <= 1:
        return []
    out = []
    recomputed = [lp.name for lp in plan.layers if lp.choice.recompute]
    zero3 = data_ranks(mesh) > 1 and any(lp.choice.zero == 3 for lp in plan.layers)
    if why := schedule_refusal(graph, plan.schedule, plan.training.compiled, bool(recomputed), zero3):
        out.append(why)
    if plan.schedule in SPLIT_BACKWARD and (why := split_backward_mesh_refusal(mesh)):
        out.append(why)
    if tp_applies(graph, pp):
        return out
    inlined = f"the pipeline stages of {graph.model_name} are single traced graphs that call no layer module"
    tp = [lp.name for lp in plan.layers if lp.choice.tp is not None]
    if tp and mesh.tp > 1:
        out.append(f"tensor parallelism inside pipeline stages splits layer modules, but {inlined}; plan layers "
                   f"{tp[:3]} with tp=none, or use pp=1")
    if recomputed:
        out.append(f"recompute inside pipeline stages checkpoints layer modules, but {inlined}; plan layers "
                   f"{recomputed[:3]} with recompute=off, or use pp=1")
    norms = [layer.name for layer in graph if layer.sync_norm_channels]
    if norms and mesh.dp > 1 and synced(plan.training.batch_coupled):
        out.append(f"BatchNorm under dp={mesh.dp} sums its statistics over the dp group in its module, but {inlined} "
                   f"({norms[0]!r}'s norms are ops there): pin pp=1, dp=1 or batch_coupled=split")
    return out


def owning_layer(graph: LayerGraph, path: str) -> str | None:
    """The layer whose module holds module ``path`` (the innermost such layer), None if none does: which
    pipeline stage runs a module cp rewrites."""
    best = None
    for layer in graph:
        mp = layer.module_path
        if mp and (path == mp or path.startswith(mp + ".")) and (best is None or len(mp) > len(best[1])):
            best = (layer.name, mp)
    return best[0] if best else None


__all__ = ["FLOAT8_AXES", "Here", "Refusal", "admit", "compiled_refusals", "context_parallel_refusals",
           "expert_parallel_refusals", "float8_device_refusal", "float8_refusals", "launch_hint", "layer_refusals",
           "mesh_refusal", "owning_layer", "pipeline_refusals", "refusals", "tensor_parallel_refusals"]
