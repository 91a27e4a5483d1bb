"""Compute time: of a layer call from its FLOPs, or of one op from its shape or bytes.

The FLOPs model (layers without per-op records, devices without an ``op_model``):

    time = flops / (peak · η(flops)),  η(flops) = η_max · flops / (flops + flops_½)

which is the same as time = (flops + flops_½) / (peak · η_max): large calls
reach the device's fitted ``matmul_efficiency`` (η_max), and every call pays a
fixed overhead worth ``half_efficiency_flops`` of work (kernel launches, thin
matmuls), which is why tiny microbatches or thin tensor-parallel shards do not
speed up for free.

The per-op model (a device with an :class:`~.hardware.OpModel`), one kernel at a time:

    GEMM (m × k)·(k × n), ``batch`` of them:
        time = 2·m·n·k·batch / (peak · η_max · u(m, n, batch) · k / (k + k_½)) + o
        u = m·n·batch / (waves · SMs · tile_m · tile_n),  waves = ⌈⌈m/tile_m⌉·⌈n/tile_n⌉·batch / SMs⌉
    fused attention: executed FLOPs / (peak · η_max · a) + o     (a: attention_fwd / attention_bwd)
    memory-bound:    bytes read + written / (bandwidth · f) + o per kernel

u is tile and wave quantisation (a thin or sharded GEMM leaves SMs idle),
k / (k + k_½) the ramp of a shallow reduction, o the per-kernel overhead and
f the achievable share of the memory bandwidth; the presets cite each
(``cost_models.hardware``) and ``autopar calibrate`` measures them.
"""

from __future__ import annotations

from .hardware import DeviceSpec

BACKWARD_FLOPS_FACTOR = 2.0  # backward = grad wrt inputs + grad wrt weights (2× forward)
# Backward of a memory-bound op reads the output's gradient and what it saved and writes the
# input's gradient: about twice the forward's bytes (a stated assumption, the elementwise rule).
MEMORY_BOUND_BACKWARD_FACTOR = 2.0
# Fused attention: backward does 2.5× the forward's FLOPs (five GEMMs to two, one recomputed),
# and a causal mask skips half the blocks; the convention of Dao-AILab/flash-attention's
# benchmarks/benchmark_flash_attention.py (``flops(..., mode="bwd") = 2.5 × fwd``, causal ÷ 2).
ATTENTION_BACKWARD_FLOPS_FACTOR = 2.5
CAUSAL_ATTENTION_WORK = 0.5
# A causal kernel runs its blocks slower than a full one (the diagonal blocks, uneven work):
# FlashAttention-2 on A100, batch 1, 4096 tokens, 32 heads: 156.3 TFLOP/s causal (half the FLOPs
# counted) against 184.0 non-causal (liangan1/GPU_travel, performance/flash-attn/README.md).
CAUSAL_ATTENTION_RATE = 156.3 / 184.0
# torch.compile (inductor) fuses chains of memory-bound ops (elementwise, norms, softmax) into one
# kernel that reads the chain's inputs and writes its outputs once, instead of a round trip to memory
# per op; GEMMs and fused attention stay library calls. An ASSUMPTION, not a measurement: each
# memory-bound op of a compiled block fuses with at least one neighbour, which halves its bytes and
# kernels — exact for a chain of two unary ops (Horace He, "Making Deep Learning Go Brrrr From First
# Principles", 2022: fused ``x.cos().cos()`` makes 2 memory accesses instead of 4, in one kernel
# instead of two), conservative for longer chains. It applies only where the op model prices
# memory-bound ops apart (a device with an ``op_model`` and a layer with op records); elsewhere a
# compiled layer is priced as eager. The presets take this fraction (``hardware.COMPILED_MEMORY_BOUND_FRACTION``,
# 0.5); ``autopar calibrate`` measures it on its device (``OpModel.compiled_memory_bound_fraction``: a
# two-op chain eager against compiled).


# float8 training (torchao's Float8Linear, ``autopar.float8``) casts each operand of each of a converted
# linear's three GEMMs to float8 with a dynamic scale: forward the input (m × k) and the weight (n × k);
# backward the output's gradient twice (for dX and for dW), the weight and the input again (torchao 0.18,
# ``matmul_with_hp_or_float8_args``: it saves the high-precision tensors and casts again in backward).
# One cast of E elements, counted from torchao 0.18's eager code (``tensor_to_amax``: abs, max;
# ``_ToFloat8ConstrFunc``: to(float32), × scale, clamp, to(float8); ``amax_to_scale``'s scalar ops): in a
# bf16 step abs reads 2 and writes 2 bytes an element, max reads 2, to(float32) reads 2 and writes 4,
# × scale and clamp each read 4 and write 4, to(float8) reads 4 and writes 1: 33 bytes an element (an
# fp32 step skips to(float32) and abs/max move 4: 33 again), in 6 kernels on the tensor and 4 on scalars.
# Compiled (inductor fuses the chain), the amax reads the tensor once and the cast reads it again and
# writes 1 byte: 2·s + 1 bytes an element (s: the step's element size) in 2 kernels — torchao's
# documented way to run float8 training, which its README benchmarks under torch.compile.
FLOAT8_CAST_EAGER_BYTES_PER_ELEMENT = 33.0
FLOAT8_CAST_EAGER_KERNELS = 10
FLOAT8_CAST_COMPILED_KERNELS = 2


def float8_cast_time_s(elements: float, element_bytes: float, device: DeviceSpec, *, compiled: bool) -> float:
    """Time of one dynamic-scale cast to float8 of ``elements`` values of ``element_bytes`` each (the
    amax pass, then the scale-and-cast pass): memory-bound, priced as such (constants above)."""
    if elements <= 0:
        return 0.0
    if compiled:
        return memory_bound_time_s(elements * (2 * element_bytes + 1), device, FLOAT8_CAST_COMPILED_KERNELS)
    return memory_bound_time_s(elements * FLOAT8_CAST_EAGER_BYTES_PER_ELEMENT, device, FLOAT8_CAST_EAGER_KERNELS)


# The loss: cross-entropy over the logits in fp32 (a bf16 plan's loss runs in full precision,
# ``runtime.model.fp32_loss``), memory-bound. Per logit element, with p the plan dtype's bytes: forward
# the cast to fp32 (p read, 4 written; nothing at fp32) and log-softmax (the input read twice, for its max
# and its sum of exponentials, the output written: 12), nll_loss's gather negligible; backward
# nll_loss's gradient zeroed (4), log-softmax's backward (the gradient and the output read, the input's
# gradient written: 12) and the cast back (4 read, p written). Kernels: 3 forward, 4 backward, each an op
# the host issues too. Counted from torch's eager kernels (aten::_log_softmax, its backward, nll_loss),
# not measured; the loss's memory is priced apart (``planning.pricing.PriceTable.loss_bytes``).
LOSS_FWD_KERNELS, LOSS_BWD_KERNELS = 3, 4


def loss_time_s(elements: float, element_bytes: float, device: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds of the default cross-entropy over ``elements`` logits of
    ``element_bytes`` each (the constants above), each at least the host's time issuing its ops."""
    if elements <= 0:
        return 0.0, 0.0
    cast = element_bytes + 4.0 if element_bytes < 4 else 0.0
    fwd = memory_bound_time_s(elements * (cast + 12.0), device, LOSS_FWD_KERNELS)
    bwd = memory_bound_time_s(elements * (cast + 16.0), device, LOSS_BWD_KERNELS)
    host = device.op_model.host_op_s if device.op_model is not None else 0.0
    return max(fwd, LOSS_FWD_KERNELS * host), max(bwd, LOSS_BWD_KERNELS * host)


def efficiency(work_flops: float, device: DeviceSpec) -> float:
    """Fraction of peak reached by one call doing ``work_flops``."""
    if work_flops <= 0:
        return 0.0
    return device.matmul_efficiency * work_flops / (work_flops + device.half_efficiency_flops)


def compute_time_s(flops: float, device: DeviceSpec, dtype: str) -> float:
    """Time of one layer call doing ``flops`` FLOPs (no FLOPs, no time)."""
    if flops <= 0:
        return 0.0
    return (flops + device.half_efficiency_flops) / (device.peak_flops(dtype) * device.matmul_efficiency)


# ATen ops whose outputs selective activation checkpointing keeps (torch's schema names, as a
# TorchDispatchMode sees them): the matmul class — GEMMs, convolutions and fused attention,
# whose work grows faster than the bytes they write, so recomputing them costs far more than
# keeping them (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models"; torchtitan's op-level SAC save list). Capture prices by this list and
# the recompute pass lowers by it, so what is priced is what runs. CompositeImplicit ops
# (linear, matmul) never reach a dispatch mode: they arrive as mm/addmm/bmm.
MATMUL_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
    # the grouped GEMM of mixture-of-experts layers, and Hugging Face's stand-in for it while
    # exporting weights not in bf16 (transformers/integrations/moe.py): eager runs the former
    "aten::_grouped_mm", "transformers::grouped_mm_fallback",
    "aten::convolution",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
})


# The fused attention kernels among MATMUL_OPS: torchtitan's op-level SAC keeps their outputs and every
# other ``aten::mm`` output, recomputing the rest (torchtitan/distributed/activation_checkpoint.py,
# ``_save_list`` and "Saves output of all compute ops, except every second mm").
FUSED_ATTENTION_OPS = frozenset(op for op in MATMUL_OPS if "attention" in op)


def memory_bound_time_s(nbytes: float, device: DeviceSpec, kernels: float = 0.0) -> float:
    """Time of memory-bound work (elementwise ops, norms, softmax) reading and writing ``nbytes``
    in ``kernels`` kernels: bytes over the bandwidth the device reaches (the roofline's bandwidth
    side; the op model's achievable fraction of it), plus each kernel's overhead."""
    ops = device.op_model
    if ops is None:
        return max(nbytes, 0.0) / device.memory_bandwidth_bytes_s
    return (max(nbytes, 0.0) / (device.memory_bandwidth_bytes_s * ops.bandwidth_fraction)
            + max(kernels, 0.0) * ops.kernel_overhead_s)


def gemm_efficiency(m: float, n: float, k: float, batch: float, device: DeviceSpec) -> float:
    """Fraction of peak one GEMM of ``batch`` (m × k)·(k × n) products reaches (module docstring):
    η_max, times tile and wave quantisation of its m × n output, times the ramp in k."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    ops = device.op_model
    if ops is None:
        return device.matmul_efficiency
    return device.matmul_efficiency * ops.shape_factor(m, n, k, batch)


def gemm_time_s(m: float, n: float, k: float, batch: float, device: DeviceSpec, dtype: str) -> float:
    """Time of one GEMM kernel: its FLOPs at :func:`gemm_efficiency`, plus the kernel overhead."""
    eta = gemm_efficiency(m, n, k, batch, device)
    if eta <= 0:
        return 0.0
    overhead = device.op_model.kernel_overhead_s if device.op_model is not None else 0.0
    return 2.0 * m * n * k * batch / (device.peak_flops(dtype) * eta) + overhead


def attention_time_s(flops: float, device: DeviceSpec, dtype: str, *, backward: bool = False,
                     causal: bool = False, masked: bool = False) -> float:
    """Time of one fused attention kernel (forward, or its backward) doing ``flops`` of the
    forward's counted FLOPs (the full T×T work: causal skips half, at its own rate); ``masked``: a call
    with an explicit ``attn_mask``, at the device's masked rate (on CUDA the memory-efficient kernel's)."""
    if flops <= 0:
        return 0.0
    ops = device.op_model
    relative = 1.0 if ops is None else (ops.attention_bwd if backward else ops.attention_fwd)
    if masked and ops is not None:
        relative *= ops.masked_attention_bwd if backward else ops.masked_attention_fwd
    work = flops * (ATTENTION_BACKWARD_FLOPS_FACTOR if backward else 1.0)
    if causal:
        work, relative = work * CAUSAL_ATTENTION_WORK, relative * CAUSAL_ATTENTION_RATE
    overhead = ops.kernel_overhead_s if ops is not None else 0.0
    return work / (device.peak_flops(dtype) * device.matmul_efficiency * relative) + overhead
