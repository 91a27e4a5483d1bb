"""Plan notes: where a plan runs otherwise than its entries ask, or looks as it does for a reason
a reader may not guess, said in the price table's own figures (``Plan.notes``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar import contract, contract_compile
from autopar.choice import CpAttention, LossKind, Recompute
from autopar.cost_models.hardware import ClusterSpec
from autopar.experts import Dispatch, ExpertLayout
from autopar.float8 import emulated
from autopar.graph import LayerGraph
from autopar.loss_head import NOT_CHECKED
from autopar.pins import Pins
from autopar.planning import loss_price
from autopar.planning.configs import CP_PP_SEARCHED_UP_TO, CP_UNSEARCHED, idle_tp
from autopar.planning.configuration import TrainingSpec
from autopar.planning.cut_checks import withdrawn_cut_notes
from autopar.planning.evaluate import evaluate
from autopar.planning.solver import LossRunnerUp, Solution


def contract_notes(graph: LayerGraph, solution: Solution) -> tuple[str, ...]:
    """Where a layer runs otherwise than its plan entry asks (the contract's rules), say so."""
    table, raised, kept, bare, root = solution.table, [], [], [], 0
    for i, (layer, s) in enumerate(zip(graph, solution.choices)):
        runs = table.runs_as(i, s)
        if layer.param_count and solution.config.mesh.dp * solution.config.mesh.cp > 1 and runs.zero != s.zero:
            raised.append(f"{layer.name} (zero={s.zero})")
            root = runs.zero
        if s.recompute and not runs.recompute:  # no recompute at all runs there, or only not this kind
            hookless = not table.runs_as(i, replace(s, recompute=Recompute.FULL)).recompute
            (kept if hookless else bare).append(layer.name)
    notes = []
    if raised:
        notes.append(f"{', '.join(raised)}: in the root FSDP unit, which runs at "
                     f"ZeRO-{root}; priced and run at that stage")
    if kept:
        notes.append(f"{', '.join(kept)}: recompute asked for, but the layer has no module of its own "
                     "to checkpoint (or sits in an export-captured pipeline stage): runs without it")
    if bare:
        notes.append(f"{', '.join(bare)}: selective recompute asked for, but the layer runs no matmul-class op "
                     "whose output it could keep: runs without recompute")
    if solution.config.mesh.cp > 1 and solution.config.cp_attention is CpAttention.ULYSSES:
        notes.append(f"cp attention by Ulysses' head all-to-all (cp={solution.config.mesh.cp}): not priced, the two "
                     "index-selects per all-to-all that put the gathered tokens in global order and back "
                     "(a copy of q, k, v and the output of each attention call)")
    if solution.config.mesh.cp > 1 and solution.config.cp_attention is CpAttention.RING:
        notes.append(f"cp attention by ring (cp={solution.config.mesh.cp}): not priced, the updates of each "
                     "call's log-sum-exp as the ring merges its partial outputs (1/head_dim of the output's bytes "
                     "a step)")
    broken = [layer.name for layer in graph if solution.table.training.compiled and contract_compile.compiled_break(
        graph, layer.index, solution.config.mesh, solution.config.cp_attention)]
    if broken:  # runtime/compiled.py: fullgraph=False where blocks break at an eager exchange
        notes.append(f"{broken[0]}{' …' if len(broken) > 1 else ''} ({len(broken)}): compiled around an eager "
                     "exchange (ep's dispatch or cp's ring) with fullgraph=False, so a graph break in the model's "
                     "own code there runs that part eagerly without a warning, priced as compiled")
    cut = withdrawn_cut_notes(graph) if solution.config.mesh.pp > 1 else ()
    split = [layer.name for layer, c in zip(graph, solution.choices) if c.tp and layer.tp_style(c.tp).experts]
    moe = moe_notes(graph, solution.config.mesh.ep, contract.data_ranks(solution.config.mesh), bool(split))
    if split:  # autopar/sharding/experts.py, passes/expert_tensor.py
        tp = solution.config.mesh.tp
        notes.append(f"{', '.join(split[:3])}{' …' if len(split) > 3 else ''} ({len(split)}): routed experts split "
                     f"across their hidden dim over tp={tp} (style megatron+experts): 1/{tp} of each expert's "
                     f"parameters, gradients, optimizer state and FLOPs per rank, the router replicated; one "
                     "all-reduce of the experts' [tokens, H] output forward and two backward (the input's and the "
                     "top-k weights' gradients); their saved activations priced whole on every rank (an "
                     "overestimate)")
    manual = manual_attention_notes(graph, solution.config.mesh.cp, solution.config.cp_attention)
    return tuple(notes) + refusal_notes(graph) + whole_notes(graph, solution) + cut + moe + manual + \
        unpriced_notes(graph)


def whole_notes(graph: LayerGraph, solution: Solution) -> tuple[str, ...]:
    """The tensor-parallel layers of the plan that leave a part whole on every tp rank (the style's
    ``runs_whole``), runs of layers saying the same folded into one note."""
    if solution.config.mesh.tp <= 1:
        return ()
    tp = {layer.name: c.tp for layer, c in zip(graph, solution.choices)}
    return tuple(f"{_who(names)}: {why}" for names, why in
                 _runs(graph, lambda layer: layer.tp_style(tp[layer.name]).runs_whole if tp[layer.name] else ""))


def _runs(graph: LayerGraph, key) -> list[tuple[list[str], Any]]:
    """Runs of consecutive layers with an equal, non-empty ``key(layer)``."""
    runs: list[tuple[list[str], Any]] = []
    for layer in graph:
        value = key(layer)
        if not value:
            continue
        if runs and runs[-1][1] == value:
            runs[-1][0].append(layer.name)
        else:
            runs.append(([layer.name], value))
    return runs


def _who(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)})"


def _held(f, ep: int, dp: int, tp_split: bool = False) -> str:
    if ep <= 1:
        where = " (1/tp of each on the layers whose experts the plan splits over tp: see that note)" if tp_split else ""
        return f"every expert's {f.routed_params:,} parameters held with their gradients and optimizer state{where}"
    return (f"1/{ep} of the experts' {f.routed_params:,} parameters held per rank (ep={ep}), with their "
            f"gradients and optimizer state: whole over the {dp // ep} ranks of the expert-data-parallel group "
            "where the layer is at ZeRO-0, an FSDP2 unit of their own sharded over those ranks at ZeRO 1-3 (the "
            "layer's stage shards its dense weights over dp), tokens dispatched and combined by all-to-all (the "
            "breakdown's ep all-to-all line)")


def moe_notes(graph: LayerGraph, ep: int = 1, dp: int = 1, tp_split: bool = False) -> tuple[str, ...]:
    """Each run of mixture-of-experts layers: what capture read of the block and how it is priced (at
    expert-parallel degree ``ep`` over ``dp``, the dp × cp ranks ep borrows from)."""
    notes = []
    def unplaced(layer):  # the facts but where they sit: equal blocks of consecutive layers fold into one note
        return tuple(replace(f, module_path="", experts_path="", router_path="", shared_paths=()) for f in layer.moe)

    for names, facts in _runs(graph, unplaced):
        for f in facts:
            note = (f"{_who(names)}: mixture of experts, {f.describe()}; priced at top-{f.top_k} experts "
                    f"+ router{' + shared experts' if f.shared_params else ''} per token "
                    f"({f.flops_per_token / 1e9:.3g} GFLOP forward), {_held(f, ep, dp, tp_split)}")
            if f.dispatch is Dispatch.STAND_IN:
                note += ("; its routing loop cannot run on the meta device: the block is traced whole and "
                         "priced from its structure, a balanced step (the router, each expert on "
                         "tokens × top-k / experts rows); tensor parallelism never splits it (its experts and "
                         "router run whole on every rank), and splits the rest of its layer only where capture "
                         "ran on real inputs, which proved the layer's own code")
            elif f.dispatch is Dispatch.HF_EAGER:
                note += ("; HF's eager loop over the experts is data-dependent: captured through HF's "
                         "grouped_mm path, the same function of the same weights")
            if ep > 1 and f.layout is ExpertLayout.MODULE_LIST:
                extra = f.flops_per_token - f.top_k * f.expert_flops_per_token
                note += (f"; under ep its own loop runs twice (record the rows, replay the experts' outputs: "
                         f"passes/expert_list.py), its router{' and shared experts' if f.shared_params else ''} "
                         f"once more a microbatch ({extra / 1e9:.3g} GFLOP a token forward, not in the price)")
            notes.append(note)
    return tuple(notes)


def search_notes(solution: Solution) -> tuple[str, ...]:
    """What the search left out on its own, for a reader who would take OPTIMAL for the whole space; and under
    a pipeline, the schedule chosen beside the best plan found on its mesh under another (:func:`schedule_note`)."""
    notes = schedule_note(solution)
    if left := solution.cp_pp_left_out:
        notes += (f"{CP_UNSEARCHED}: its {left:,} configurations would have taken the search past "
                  f"{CP_PP_SEARCHED_UP_TO:,} (OPTIMAL is over the meshes searched): pin cp or pp, e.g. --pin pp=2, "
                  "to plan meshes with both, or price one with autopar explain --why-not 'pp=2 cp=2'",)
    return notes


def schedule_note(solution: Solution) -> tuple[str, ...]:
    """Under a pipeline: the schedule chosen, its bubble, and the runner-up schedule's price — the best plan the
    search found on the same mesh under another schedule, or that none was solved (each other schedule's
    bound, or its memory, left it no better)."""
    if solution.config.mesh.pp <= 1:
        return ()
    chosen, step = solution.config.schedule, solution.prediction.step_time_s
    head = (f"pipeline schedule {chosen} chosen ({step:.4g} s a step, {solution.prediction.breakdown.bubble_s:.3g} s "
            "of it bubble)")
    other = solution.schedule_runner_up
    if other is None:
        return (f"{head}; no plan under another schedule on this mesh was solved: none could beat it by its bound, "
                "or none fit",)
    c = other.config
    return (f"{head}; runner-up schedule {c.schedule} (m={c.microbatches}): {other.step_time_s:.4g} s a step "
            f"({(other.step_time_s - step) / step:+.1%})",)


def idle_axis_notes(graph: LayerGraph, solution: Solution, pins: Pins, global_batch: int) -> tuple[str, ...]:
    """A mesh axis of degree > 1 that no layer uses: its ranks repeat each other's work, the world size
    spent on nothing. Only tp can be so (each layer takes it or not); dp splits the batch, pp the layers, cp
    every sample's sequence, and ep is refused on a model without experts."""
    mesh = solution.config.mesh
    tp = mesh.tp
    if tp <= 1 or any(c.tp for c in solution.choices):
        return ()
    world = mesh.world_size
    fewer = world // tp
    if "tp" in pins.mesh_degrees():
        why = f"tp={tp} is pinned: unpin it, or pin a style on the layers that admit one ('GLOB:tp=megatron')"
    elif idle_tp(graph, mesh):
        why = (f"no layer's tensor-parallel style runs on {tp} ranks, and no other mesh of {world} ranks runs this "
               f"model at batch {global_batch} (dp divides the batch, pp the layers, cp the sequence): plan "
               "another world size")
    else:
        why = ("replicating every layer priced faster than any tensor-parallel style: pin a style "
               "('GLOB:tp=megatron') to split the layers that admit one")
    return (f"tp={tp} is used by no layer, so the {tp} ranks of each tp group repeat each other's work ({world} "
            f"ranks do the work of {fewer}): {why}, or --world-size {fewer} for the same step",)


def float8_notes(cluster: ClusterSpec, training: TrainingSpec, solution: Solution) -> tuple[str, ...]:
    """What float8 prices otherwise than a reader may assume: emulation on a CPU; how sharded weights are
    gathered (in float8 under tensorwise scaling, in the plan's dtype under rowwise)."""
    if training.float8 is None:
        return ()
    notes = []
    if emulated(cluster):
        notes.append(f"float8 on {cluster.device.name} is torchao's emulation (real casts to float8, the "
                     f"matmuls in fp32 on the rounded values): its matmuls are priced at the "
                     f"{training.dtype} peak, plus the casts, with no float8 speedup")
    if any(c.zero >= 1 for c in solution.choices) and training.float8.fsdp_all_gather:
        notes.append("float8: FSDP2 gathers the converted weights of sharded layers in float8, 1 byte an "
                     "element, their scales from one all-reduce of the weights' amaxes a step, as priced")
    elif any(c.zero >= 1 for c in solution.choices):
        notes.append(f"float8: FSDP2 gathers the converted weights in {training.dtype}, as priced (its float8 "
                     f"all-gather runs tensorwise scaling only, not {training.float8.recipe.value})")
    return tuple(notes)


def loss_notes(graph: LayerGraph, solution: Solution, pins: Pins) -> tuple[str, ...]:
    """How the loss runs, in one line: chunked (and its chunk), or full and why it is not chunked."""
    table = solution.table
    head = graph.loss_head
    other = solution.loss_runner_up  # the plan's choices under the other loss (api.whole_logits_if_faster)
    if table.loss is LossKind.CHUNKED and head is not None:
        chunk, peak = loss_price.chunk_tokens(table), _bytes(loss_price.chunked_peak_bytes(table))
        return (f"loss: chunked cross-entropy on {head.module_path}'s weight, {chunk:,} tokens a chunk (fp32 logits "
                f"of one chunk at a time, {peak} at its peak; each chunk's logits "
                f"recomputed in backward): the whole logits are never held{_whole_logits(other)}; pin loss=full to "
                "hold them" + _tied_whole(graph, solution),)
    if table.loss is LossKind.VOCAB_PARALLEL and head is not None:
        chunk, peak = loss_price.chunk_tokens(table), _bytes(loss_price.chunked_peak_bytes(table))
        tp = solution.config.mesh.tp
        return (f"loss: vocabulary-parallel cross-entropy on {head.module_path}'s weight split over tp={tp} "
                f"({loss_price.shard_vocab(table):,} of {head.out_features:,} classes a rank), {chunk:,} tokens a "
                f"chunk (fp32 logits of one chunk of a shard at a time, {peak} at its peak; log-sum-exp and the "
                "target logit joined by one all-gather a chunk; each chunk's logits recomputed in backward): the "
                f"vocabulary is never gathered{_whole_logits(other)}; pin loss=full to hold the logits",)
    if graph.loss_refusal == NOT_CHECKED:
        return ()
    if other is not None and other.fits:
        kind = "vocabulary-parallel" if other.kind is LossKind.VOCAB_PARALLEL else "chunked"
        return (f"loss: the whole logits are held: this plan steps in {solution.prediction.step_time_s:.4g} s with "
                f"them and fits, against {other.step_time_s:.4g} s {kind} (each chunk's logits recomputed in "
                "backward); pin loss=chunked never to hold them",)
    if pins.loss is LossKind.FULL:
        why = "pinned loss=full"
    elif head is None:
        why = graph.loss_refusal
    else:
        why = (contract.chunked_loss_refusal(graph, solution.config.mesh, table.training.float8)
               or "a loss function was given (only the default cross-entropy runs chunked)")
    return (f"loss: the whole logits are held (not chunked: {why})",)


def _whole_logits(other: LossRunnerUp | None) -> str:
    """What the plan's choices would step in with the whole logits held, beside the chunked loss kept."""
    if other is None:
        return ""
    return (f" (the whole logits would step in {other.step_time_s:.4g} s" +
            ("" if other.fits else " and exceed the memory budget") + ")")


def _tied_whole(graph: LayerGraph, solution: Solution) -> str:
    """Why a head tied across pipeline stages runs whole beside tp, not vocabulary-parallel ("" elsewhere)."""
    mesh, head = solution.config.mesh, graph.loss_head
    if head is None or not head.tied or mesh.tp <= 1 or not contract.tied_across_stages(graph, len(graph) - 1,
                                                                                         mesh.pp):
        return ""
    return (f"; not vocabulary-parallel over tp={mesh.tp}: the head's weight is tied to {head.weight} in the first "
            "pipeline stage, and tied ends a pipeline splits run replicated over tp (contract.tied_across_stages): "
            "the two stages' gradient sum (passes/tied.py) has run on whole and dp-sharded weights only, never on "
            "vocabulary shards, so split over tp it is not offered")


def unpriced_notes(graph: LayerGraph) -> tuple[str, ...]:
    """Layers running compute-like ops no FLOP rule counts: their work is missing from the price."""
    return tuple(f"{_who(names)}: {', '.join(ops)} has no FLOP rule: its compute is not in the price "
                 "(the layer is priced as if the op were free)"
                 for names, ops in _runs(graph, lambda l: l.unpriced_ops))


def manual_attention_notes(graph: LayerGraph, cp: int,
                           method: CpAttention = CpAttention.ALL_GATHER) -> tuple[str, ...]:
    """Attention written by hand (capture followed its masked softmax: ``graph.cp_manual``) really holds
    its score matrix: S × S a sample and head; a rank under cp S/cp × S for every head (all-gather) or
    S × S for heads/cp (Ulysses), the same count, one device's ÷ cp; priced so, never as a fused kernel.
    Under Ulysses the S × S boolean causal mask each call keeps for ``masked_fill``'s backward is not
    priced beyond one device's ÷ cp (S² bytes a call: small beside the scores, b · heads/cp · S² elements):
    a note says so."""
    if not graph.cp_manual:
        return ()
    paths = list(graph.cp_manual)
    seq = f"S = {graph.seq_len}" if graph.seq_len else "S"
    ulysses = cp > 1 and method is CpAttention.ULYSSES
    share = ""
    if cp > 1 and graph.seq_len:
        share = (f" (S × S for heads/cp a rank under cp={cp} by Ulysses, as many elements as S/cp × S for every "
                 "head)" if ulysses else f" (S/cp × S = {graph.seq_len // cp} × {graph.seq_len} a rank under cp={cp})")
    mask = ("; not priced beyond one device's ÷ cp, the S × S boolean causal mask each call keeps for "
            "masked_fill's backward under Ulysses (S² bytes a call, where the all-gather keeps S/cp × S)"
            if ulysses else "")
    return (f"{_who(paths)}: attention written by hand (softmax over a masked q · kᵀ) holds its S × S score matrix "
            f"per head for backward, {seq}{share}, and is priced so; scaled_dot_product_attention(is_causal=True) "
            f"would let a fused kernel keep it out of memory{mask}",)


def refusal_notes(graph: LayerGraph) -> tuple[str, ...]:
    """Layers whose candidate tensor-parallel style capture withdrew, and the op that stopped it
    (runs of layers refused for the same reason folded into one note)."""
    notes: list[str] = []
    runs: list[tuple[list[str], str]] = []
    for layer in graph:
        if not layer.tp_refusal:
            continue
        if runs and runs[-1][1] == layer.tp_refusal:
            runs[-1][0].append(layer.name)
        else:
            runs.append(([layer.name], layer.tp_refusal))
    for names, why in runs:
        who = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)})"
        notes.append(f"{who}: {why}")
    return tuple(notes)



def choice_notes(graph: LayerGraph, solution: Solution) -> tuple[str, ...]:
    """Why the plan looks as it does where it may puzzle a reader, in the price table's figures:
    uneven interleaved stages, and recompute on a few layers but on no repeated block."""
    return tuple(n for n in (_uneven_stages_note(graph, solution), _recompute_note(graph, solution)) if n)


def _uneven_stages_note(graph: LayerGraph, solution: Solution) -> str | None:
    """Interleaved plans whose stages hold unequal numbers of blocks (repeated layers): the step
    prices each pipeline rank's chunks together, so stage sizes are free within a rank."""
    c = solution.config
    if c.schedule.chunks <= 1 or not any(graph.repeated):
        return None
    per_stage = [0] * c.stages
    for i, stage in enumerate(solution.stages):
        per_stage[stage] += bool(graph.repeated[i])
    if max(per_stage) - min(per_stage) <= 1:
        return None
    per_rank = [sum(n for s, n in enumerate(per_stage) if c.rank_of_stage(s) == j) for j in range(c.mesh.pp)]
    times = solution.prediction.rank_time_mb_s
    slowest = max(range(c.mesh.pp), key=lambda j: times[j])
    held = (f"every pipeline rank's {c.schedule.chunks} chunks add up to {per_rank[0]} blocks"
            if len(set(per_rank)) == 1 else
            f"pipeline ranks 0–{c.mesh.pp - 1} hold {', '.join(map(str, per_rank))} blocks over their chunks")
    note = (f"stages are uneven ({min(per_stage)}–{max(per_stage)} blocks each): a rank runs its chunks "
            f"in turn and the step is priced from each rank's total, so the cost model balances "
            f"ranks, not stages; {held}, {_seconds(min(times))} to {_seconds(max(times))} a microbatch, "
            f"and the slowest, rank {slowest}, paces the step")
    if len({n for j, n in enumerate(per_rank) if j != slowest}) > 1:
        note += " (moving blocks between the other ranks, none above it, would not change the prediction)"
    return note


def _recompute_note(graph: LayerGraph, solution: Solution) -> str | None:
    """A plan recomputing some layers but no repeated block: what that recompute saves on its
    rank and costs a step (the plan priced again without it), against the memory budget."""
    from autopar.units import format_bytes

    table, strategies, stages = solution.table, solution.choices, solution.stages
    runs = [table.runs_as(i, s).recompute for i, s in enumerate(strategies)]
    recomputed = [i for i, r in enumerate(runs) if r]
    if not recomputed or any(graph.repeated[i] for i in recomputed):
        return None
    without = tuple(replace(s, recompute=Recompute.NONE) if r else s for s, r in zip(strategies, runs))
    now, then = solution.prediction, evaluate(table, stages, without)  # the plan, and it without recompute
    saved = [b - a for a, b in zip(now.memory_per_rank_bytes, then.memory_per_rank_bytes)]
    rank = max(range(len(saved)), key=lambda j: saved[j])
    cost = now.step_time_s - then.step_time_s
    names = ", ".join(graph[i].name for i in recomputed)
    verb = "recomputes" if len(recomputed) == 1 else "recompute"
    blocks = " and no block does" if any(graph.repeated) else ""
    where = "per rank" if len(saved) == 1 else f"on pipeline rank {rank}"
    effect = f"saves {_bytes(saved[rank])}" if saved[rank] >= 0 else f"needs {_bytes(-saved[rank])} more"
    price = f"adds {_seconds(cost)} to the step" if cost > 0 else "costs the step nothing"
    note = f"{names} {verb}{blocks}: this {effect} {where} and {price}"
    free = all(table.prices[i][table.index_of(i, strategies[i])].time_mb_s
               == table.prices[i][table.index_of(i, without[i])].time_mb_s for i in recomputed)
    if free:
        it = "it does" if len(recomputed) == 1 else "they do"
        note += f" ({it} no FLOPs, and compute is priced by FLOPs: recompute is free there, so any saving is taken)"
    return note + (f"; peak memory {format_bytes(now.peak_memory_bytes)} of "
                   f"{format_bytes(solution.memory_budget_bytes)}")


def _bytes(n: int) -> str:
    from autopar.units import KiB, MiB, format_bytes

    return format_bytes(n) if n >= MiB else f"{n / KiB:.1f} KiB" if n >= KiB else f"{n} B"


def _seconds(s: float) -> str:
    return "no time" if s <= 0 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
