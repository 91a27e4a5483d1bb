"""What a layer holds on its rank, and the least memory any plan of a configuration holds.

:mod:`.pricing` prices a layer's memory here (:func:`held_bytes`, :func:`kept_mb_bytes`), and the
screen (:func:`memory_floor_bytes`) reads the same two functions without pricing a row's times, so a
configuration the screen drops is one whose priced rows could not fit either. Why a screen: most
configurations of a long-sequence search cannot fit at all (Llama 3 8B at 131,072 tokens on 64 GPUs,
cp inside pipeline stages searched: 1,916 of 3,036), and pricing every choice of every layer to find
that out was most of the search's time.
"""

from __future__ import annotations

import math
from typing import Any

from autopar.choice import LayerChoice
from autopar.contract import Engine
from autopar.cost_models.memory import model_state_bytes
from autopar.graph import Layer
from autopar.planning import expert_price
from autopar.planning.recompute_price import recompute_part

FP32_BYTES = 4  # a bf16 plan's experts' gradients outside FSDP2 are fp32 (as pricing's)


def held_bytes(table: Any, layer: Layer, runs: LayerChoice) -> tuple[int, int, int, int]:
    """(weights, gradients, optimizer state with a bf16 plan's fp32 master gradients, DDP's buckets) a rank
    holds for ``layer`` running as ``runs`` (:meth:`~autopar.planning.pricing.PriceTable.runs_as`)."""
    prec = table.prec
    params = table.effective_params(layer, runs)
    experts = expert_price.local_params(table, layer)  # ep: this rank's experts, outside the dp engine
    dense = params - expert_price.split_params(table, layer)
    ez, edp = expert_price.expert_zero(table, layer, runs.zero), table.edp_group.size  # the experts' ZeRO over edp
    weights = (prec.param_bytes * (dense if runs.zero < 3 else dense // table.shard_ranks)
               + prec.param_bytes * (experts if ez < 3 else experts // edp))
    grads = (prec.grad_bytes * (dense if runs.zero < 2 else dense // table.shard_ranks)
             + prec.grad_bytes * (experts if ez < 2 else experts // edp))
    # outside FSDP2 the experts' gradients are fp32 whatever the plan's dtype (fp32 weights on bf16 copies)
    expert_grads = max(FP32_BYTES - prec.grad_bytes, 0) * experts if ez == 0 else 0
    grads += expert_grads
    buckets = prec.grad_bytes * dense if table.engine is Engine.DDP else 0  # ep's experts: outside DDP
    state = (model_state_bytes(dense, runs.zero, table.shard_ranks, prec) + model_state_bytes(experts, ez, edp, prec)
             + expert_grads + buckets + master_grad_bytes(table, dense))
    return weights, grads, state - weights - grads - buckets, buckets  # the ZeRO formula's rounding: optimizer's


def master_grad_bytes(table: Any, params: int) -> int:
    """Where no FSDP2 unit holds a bf16 plan's weights (dp = 1, or DDP), the runtime keeps fp32
    masters whose gradients are fp32 (runtime/precision.py): 2 bytes a parameter more than
    the bf16 gradients the ZeRO formula counts."""
    if table.prec.grad_bytes >= FP32_BYTES or table.engine not in (Engine.NONE, Engine.DDP):
        return 0
    return (FP32_BYTES - table.prec.grad_bytes) * params


def kept_mb_bytes(table: Any, layer: Layer, runs: LayerChoice, fwd_s: float, acts: float,
                  times: Any = None) -> tuple[float, int]:
    """(forward re-run in backward per microbatch, activation bytes kept per microbatch) of ``layer``
    running as ``runs``, from its style's saved activations per sample ``acts`` (``times``: its
    compute's device and host parts, for the re-run's)."""
    acts += expert_price.imbalance_bytes(table, layer)
    refwd, kept = recompute_part(table, layer, runs, fwd_s, acts, times)
    return refwd, math.ceil(table.microbatch_size * max(kept, 0.0) * table.act_scale)


def least_held(table: Any, layer: Layer, choices: list[LayerChoice]) -> dict[str | None, int]:
    """Per tensor-parallel style (or none) among ``choices``, the least state bytes (:func:`held_bytes`)
    its ZeRO stages leave a rank: a style's state reads its ZeRO stage, not its recompute."""
    least: dict[str | None, int] = {}
    for zero in {c.zero for c in choices}:
        for tp in {c.tp for c in choices}:
            held = sum(held_bytes(table, layer, table.runs_as(layer.index, LayerChoice(tp, zero))))
            least[tp] = min(least.get(tp, held), held)
    return least


def least_kept(table: Any, layer: Layer, choices: list[LayerChoice]) -> dict[str | None, int]:
    """Per tensor-parallel style (or none) among ``choices``, the least activation bytes a microbatch keeps
    (:func:`kept_mb_bytes`) over its sequence parallelism and recompute: they read no ZeRO stage."""
    least: dict[str | None, int] = {}
    for tp, sp, recompute in {(c.tp, c.sp, c.recompute) for c in choices}:
        runs = table.runs_as(layer.index, LayerChoice(tp, 0, recompute, sp))
        kept = kept_mb_bytes(table, layer, runs, 0.0, table.style_activation_bytes(layer, runs.tp, runs.sp))[1]
        least[tp] = min(least.get(tp, kept), kept)
    return least


def memory_floor_bytes(table: Any) -> int:
    """The least memory the pipeline ranks of any plan of ``table``'s configuration hold together: every
    rank's workspace, and each layer at the least its row offers (at the fewest microbatches in flight
    any rank holds). A plan fits only if this is at most pp × the budget: the knapsack bound's own test
    (:func:`~autopar.planning.bounds.lower_bound_s`), over every choice a row offers rather than those
    the pins allow, so it drops only configurations the bound would find cannot fit, before their
    times are priced. With a layer pinned outside the search space (a row extended, which may hold
    less) it is no bound: the search does not screen then.

    A row's least is min over its styles of (least state + least activations ⌈× in flight⌉): a style's
    state and activations read apart parts of a choice (ZeRO; sequence parallelism and recompute), and
    every combination is offered. What it reads is kept in the search's :class:`SharedPrices` by what it
    depends on (the rows by data-parallel mode and pp; states by mesh and mode; activations by mesh,
    microbatches and cp's method), so a search of 9,000 configurations computes each once."""
    c, memo = table.config, table.shared.floors
    graph, f = table.graph, min(table.in_flight)
    search = (id(graph), id(table.cluster), id(table.training))
    if (rows_key := (*search, "rows", c.data_parallel, c.mesh.pp, c.schedule.split_backward)) not in memo:
        rows: dict[tuple, list] = {}
        for layer, key, zeros in table.row_keys():
            rows.setdefault(key, [layer, zeros, 0])[2] += 1
        memo[rows_key] = (graph, rows)
    total = (c.mesh.pp - 1) * table.rank_workspace_bytes(0) + table.rank_workspace_bytes(c.mesh.pp - 1)
    # the layers' part, alike over the schedules with as few microbatches in flight (the split-backward ones)
    if (layers := (*rows_key, "layers", c.mesh, c.microbatches, c.cp_attention, f)) not in memo:
        part = 0
        for key, (layer, zeros, count) in memo[rows_key][1].items():
            if (held := (*search, "held", key, c.mesh, c.data_parallel)) not in memo:
                memo[held] = (graph, least_held(table, layer, table.offered_choices(layer, zeros)))
            if (kept := (*search, "kept", key, c.mesh, c.microbatches, c.cp_attention)) not in memo:
                memo[kept] = (graph, least_kept(table, layer, table.offered_choices(layer, zeros)))
            acts = memo[kept][1]
            part += count * min(state - (-acts[tp] * f.numerator // f.denominator)
                                for tp, state in memo[held][1].items())
        memo[layers] = (graph, part)
    return total + memo[layers][1]


__all__ = ["held_bytes", "kept_mb_bytes", "least_held", "least_kept", "master_grad_bytes", "memory_floor_bytes"]
