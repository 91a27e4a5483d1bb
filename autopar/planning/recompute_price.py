"""What a layer's recompute costs and keeps: none, full, selective, or torchtitan's alternate-mm policy.

A function of a :class:`~autopar.planning.pricing.PriceTable` (its configuration,
microbatch, device and dtypes) and a layer under a strategy; pricing calls it for
every strategy it prices, so the lowering's policies and their prices stay in
one place each (``passes/recompute.py``, here).
"""

from __future__ import annotations

from typing import Any

from autopar.choice import Recompute
from autopar.cost_models.compute import compute_time_s, memory_bound_time_s
from autopar.cost_models.gpu_figures import CHECKPOINT_HOST_OPS, COMPILED_HOST_SHARE
from autopar.graph import Layer, OpKind
from autopar.planning.context_price import kept_bytes as context_kept_bytes
from autopar.planning.layer_compute import LayerCompute, host_ops
from autopar.planning.sequence import sequence_input_bytes


def compiled_ops(table: Any, layer: Layer) -> bool:
    """Whether ``layer``'s memory-bound ops are priced fused (``layer_compute``'s ``compiled``): a block of a
    compiled plan, except a mixture-of-experts block under ep, whose experts run eagerly inside the
    exchange the compiled block breaks around (``passes/expert_dispatch.py``); capture does not tell
    the experts' ops from the rest of the layer's, so the whole layer is priced unfused, an upper bound
    on its compute. Under the ring the block compiles around ``ring_attention``, whose kernels and
    elementwise work are priced as eager already (``ring_elementwise_s``, ``attention_op_time_s``)."""
    return (table.training.compiled and table.graph.blocks[layer.index]
            and not (table.config.mesh.ep > 1 and bool(layer.moe)))  # contract_compile.compiled_break's ep half


def recompute_part(table: Any, layer: Layer, strategy: Any, fwd_s: float, acts: float,
                   times: LayerCompute | None = None) -> tuple[float, float]:
    """(time re-run in backward per microbatch, bytes kept per sample) under the layer's recompute.

    Checkpointing the module keeps its inputs (with sequence parallelism, this rank's
    share of the hidden state) and what its glue ops (outside the module) save. Full
    re-runs the forward. Selective also keeps the outputs of its matmul-class ops and
    re-runs the rest: their counted FLOPs, and the bytes they read and write at the
    device's memory bandwidth; torchtitan's ``alternate_mm`` keeps fused attention's and
    every other ``mm``'s outputs and re-runs the rest, those matmuls included. A
    Megatron style splits over tp what lies between its column and row projections.
    Under cp a rank keeps and re-runs 1/cp of the tokens' share; under all-gather, selective
    recompute is counted as keeping the K and V gathered from the other cp ranks and the attention
    masks (an upper bound: they are what attention's backward reads); under Ulysses nothing more
    (``context_price.kept_bytes``). In a block under
    torch.compile, full re-runs the compiled forward (``fwd_s`` as priced compiled) and
    selective's memory-bound re-run is fused as the forward's is
    (the op model's ``compiled_memory_bound_fraction``, where the op model
    prices memory-bound ops apart); what is kept is priced as eager (the partitioner keeps
    what the policy saves: measured on a tiny GPT block, compiled full kept the block's input).
    A block compiled around an eager exchange (``contract_compile.compiled_break``: the ring, ep's dispatch)
    recomputes in full only, its eager checkpoint rerunning the compiled forward, the exchange
    included: ``fwd_s`` as priced for that block (the ring's work unfused, an MoE block under ep
    unfused whole) and, in ``pricing``, the exchange's forward collectives again; it keeps its input.
    """
    kind = strategy.recompute
    if kind is Recompute.NONE:
        return 0.0, acts
    c = table.config
    inputs = layer.input_bytes_per_sample
    if strategy.sp:
        inputs = sequence_input_bytes(layer, layer.tp_style(strategy.tp), c.mesh.tp, table.graph.dtype_bytes)
    cp = c.mesh.cp
    base = (inputs + layer.glue_saved_bytes_per_sample) / cp
    machinery = checkpoint_host_s(table, layer, kind)
    if kind is Recompute.FULL:  # the device re-runs the forward, the host re-issues it after the machinery
        if times is None:
            return fwd_s, base
        device_rerun = fwd_s - times.fwd_s + times.device_fwd_s  # a BatchNorm's sync again, on the device's side
        return backward_share(times, device_rerun, times.host_fwd_s + machinery), base
    split = 1 - 1 / c.mesh.tp if strategy.tp is not None and layer.tp_style(strategy.tp).row else 0.0
    p = "alternate" if kind is Recompute.ALTERNATE_MM else "selective"  # torchtitan's policy, or autopar's
    saved = getattr(layer, f"{p}_saved_bytes_per_sample") - split * getattr(layer, f"{p}_sharded_bytes_per_sample")
    moved = (getattr(layer, f"{p}_recompute_bytes_per_sample")
             - split * getattr(layer, f"{p}_recompute_sharded_bytes_per_sample"))
    b, device = table.microbatch_size, table.cluster.device
    # a compiled block re-runs its memory-bound ops fused, as its forward does (layer_compute)
    fused = (device.op_model.compiled_memory_bound_fraction
             if compiled_ops(table, layer) and device.op_model is not None
             and layer.ops else 1.0)
    rerun = (compute_time_s(b * getattr(layer, f"{p}_recompute_flops_per_sample") / cp, device,
                            table.dtype_for_compute)
             + memory_bound_time_s(b * moved * table.act_scale * fused / cp, device))
    if times is not None:
        host = machinery + selective_host_s(layer, device, compiled_ops(table, layer),
                                            alternate=kind is Recompute.ALTERNATE_MM)
        rerun = backward_share(times, rerun, host)
    # cp's attention: under all-gather the gathered K/V and prefix masks, per sample; nothing under Ulysses
    return rerun, base + saved / cp + context_kept_bytes(table, layer)


def backward_share(times: LayerCompute, device_rerun_s: float, host_rerun_s: float) -> float:
    """What a re-run adds to its layer's backward: backward and re-run together take the longer of the
    device's and the host's time for both, so a re-run the host issues while the device is still busy with
    backward's kernels costs only what the host's side then outlasts."""
    together = max(times.device_bwd_s + device_rerun_s, times.host_bwd_s + host_rerun_s)
    return together - times.bwd_s


def checkpoint_host_s(table: Any, layer: Layer, kind: Recompute) -> float:
    """What a checkpointed call of ``layer`` costs the host beyond the ops it re-runs: the non-reentrant
    checkpoint's saved-tensor hooks, its recompute and (selective) its policy called on every op,
    :data:`~autopar.cost_models.gpu_figures.CHECKPOINT_HOST_OPS` per forward op at the host's per-op time
    (``benchmarks/host_overheads.py`` measures it). A compiled block traces the checkpoint away: nothing."""
    ops = table.cluster.device.op_model
    if ops is None or ops.host_op_s <= 0 or not layer.ops or compiled_ops(table, layer):
        return 0.0
    return CHECKPOINT_HOST_OPS[kind.name.lower()] * host_ops(layer)[0] * ops.host_op_s


def selective_host_s(layer: Layer, device: Any, compiled: bool, *, alternate: bool) -> float:
    """The host's time issuing a selective re-run: the layer's memory-bound ops again, and under torchtitan's
    policy every other GEMM too, in eager ops (``compiled``: :data:`COMPILED_HOST_SHARE` of them;
    ``layer_compute.host_time_s``)."""
    ops = device.op_model
    if ops is None or not layer.ops or ops.host_op_s <= 0:
        return 0.0
    memory = sum(op.count for op in layer.ops if op.kind is OpKind.MEMORY)
    gemms = sum(op.count for op in layer.ops if op.kind is OpKind.GEMM) / 2 if alternate else 0.0
    return (memory + gemms) * ops.host_op_s * (COMPILED_HOST_SHARE if compiled else 1.0)


__all__ = ["checkpoint_host_s", "recompute_part", "selective_host_s"]
