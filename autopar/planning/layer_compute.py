"""A layer call's compute time, forward and backward, op by op where capture recorded its ops.

Per microbatch of b samples, under a tensor-parallel style on tp ranks
(``cost_models.compute`` has each op's formula):

    forward  = Σ_GEMM count · t(m, n, k, batch) + Σ_attention count · t_attn(b·F / share)
               + t_mem(b · bytes / share, kernels) + rest
    backward = Σ_GEMM count · (t(m, k, n, batch) + t(k, n, m, batch))     dX = dY·Wᵀ, dW = Xᵀ·dY
               + Σ_attention count · t_attn_bwd(b·F / share) + t_mem(2 · b · bytes / share, 2 · kernels)
               + 2 · rest

An attention call that passes its own ``attn_mask`` (a padding or sliding-window mask; capture
records it, ``OpRecord.masked``) is priced at the device's masked rate: CUDA's flash kernel takes no
mask, so such a call runs the memory-efficient one there (``OpModel.masked_attention_fwd``; 1 on a CPU).

Each direction takes at least the host's time issuing its ops (:func:`host_time_s`): eager PyTorch
dispatches every op from one CPU thread, so a layer of small kernels runs at the host's pace, not the
device's (``OpModel.host_op_s``; 0 on a CPU, where the host is the device).

Under torch.compile (a compiled block), the memory-bound term's bytes and kernels are scaled by
the op model's ``compiled_memory_bound_fraction`` (fusion; presets: 0.5); GEMMs and attention
are priced as eager (inductor calls the same library kernels for them).

with each GEMM's shape after the style's sharding (:meth:`autopar.graph.OpRecord.gemm_shape`),
bytes rescaled from the captured dtype to the plan's (``act_scale``), and ``rest`` the layer's
counted FLOPs that no record covers, priced by the FLOPs model without its per-call overhead.
A layer without records, or a device without an ``op_model``, is priced by the FLOPs model
(:func:`autopar.cost_models.compute.compute_time_s`), as before per-op records existed.

Under context parallelism (cp ranks split the sequence, ``passes/context_parallel.py``) every op
does 1/cp of the tokens, but attention does what the lowering runs: each rank holds two query
chunks of L = S/(2·cp) tokens, chunk r and chunk 2·cp − 1 − r, and runs one SDPA per chunk on the
key prefix it can see, under an explicit boolean mask (so the kernel computes the whole rectangle,
at the non-causal rate of a masked call: on CUDA the memory-efficient kernel's, flash taking no mask,
``OpModel.masked_attention_fwd``): L × (r + 1)·L and L × (2·cp − r)·L, together L × (2·cp + 1)·L whatever r
(the head-tail balance). Against the full S × S = 4·cp²·L² work each kernel's FLOPs are counted
for, that is

    cp_attention_share(cp) = (2·cp + 1) / (4·cp²)    (5/16 at cp = 2; → 1/(2·cp) as cp grows)

of it, in :data:`CP_ATTENTION_CALLS` kernels — the factor (2·cp + 1)/(4·cp) of the S/cp × S
rectangle a single masked call would compute. Attention's time is linear in its work plus a
per-kernel overhead, so the two calls are priced as two of half the pair's work each.

Under Ulysses (``cp_attention`` ``ulysses``: the head all-to-all) a rank runs one causal call over
the whole sequence for heads/cp of the heads: 1/cp of the call's work, causal as at cp = 1 (no
imbalance, no masked rectangle: :func:`cp_attention_share` is 1/cp, in one kernel).

Under ring attention (``cp_attention`` ``ring``, torch's ring: ``passes/context_ring.py``) a call runs
cp kernels on one rank: step 0 its 2L queries against its own 2L keys, causal ((2L)² = 1/cp² of the
S × S work, at the causal rate), then cp − 1 steps of one unmasked 2L × L block each (the head-tail
layout makes every later step half a block: 1/(2·cp²) of the work, at the non-causal rate):
:func:`cp_attention_share` (cp + 1)/(2·cp²) (3/8 at cp = 2), the steps' times :func:`ring_step_times`.
"""


from __future__ import annotations

from dataclasses import dataclass

from autopar.choice import CpAttention
from autopar.cost_models.compute import (
    BACKWARD_FLOPS_FACTOR,
    FLOAT8_CAST_COMPILED_KERNELS,
    FLOAT8_CAST_EAGER_KERNELS,
    MEMORY_BOUND_BACKWARD_FACTOR,
    attention_time_s,
    compute_time_s,
    float8_cast_time_s,
    gemm_time_s,
    memory_bound_time_s,
)
from autopar.cost_models.gpu_figures import COMPILED_HOST_SHARE
from autopar.cost_models.hardware import DeviceSpec
from autopar.graph import Layer, OpKind, OpRecord, SampleDim

CP_ATTENTION_CALLS = 2  # under cp, one SDPA per query chunk (head and tail) of each attention call


def cp_attention_share(cp: int, method: CpAttention = CpAttention.ALL_GATHER) -> float:
    """The share of an attention call's full S × S work one of ``cp`` ranks computes: under all-gather
    its two query chunks of L = S/(2·cp) against their key prefixes, L × (2·cp + 1)·L of 4·cp²·L²;
    under Ulysses its heads/cp over the whole sequence, 1/cp (module docstring); the whole at cp = 1,
    where the call runs causal and is priced so."""
    if cp <= 1:
        return 1.0
    if method is CpAttention.RING:
        return (cp + 1) / (2 * cp * cp)
    return 1 / cp if method is CpAttention.ULYSSES else (2 * cp + 1) / (4 * cp * cp)


def ring_step_times(op: OpRecord, microbatch: int, style: str | None, tp: int, device: DeviceSpec,
                    dtype: str, cp: int, *, share: float = 1.0) -> tuple[float, float, float, float]:
    """Under ring attention, one call of ``op`` on one rank: (step 0 forward, a later step's forward,
    step 0 backward, a later step's backward), seconds (module docstring: step 0 the causal (2L)²
    block, each of the cp − 1 later steps one unmasked 2L × L block). ``share``: of the heads (a tp rank's)."""
    work = microbatch * op.flops_per_sample * op.split(style, tp) * share
    first, later = work / (cp * cp), work / (2 * cp * cp)
    return (attention_time_s(first, device, dtype, causal=op.causal),
            attention_time_s(later, device, dtype),
            attention_time_s(first, device, dtype, backward=True, causal=op.causal),
            attention_time_s(later, device, dtype, backward=True))


def attention_op_time_s(op: OpRecord, microbatch: int, style: str | None, tp: int, device: DeviceSpec,
                        dtype: str, cp: int = 1,
                        method: CpAttention = CpAttention.ALL_GATHER) -> tuple[float, float]:
    """(forward, backward) time of ``op``'s attention kernels for one microbatch on one rank: at cp = 1
    its causal kernels; under cp by all-gather its :data:`CP_ATTENTION_CALLS` masked prefix kernels per
    call, doing :func:`cp_attention_share` of the full work together; under Ulysses its causal kernels
    on 1/cp of the heads; under ring its cp step kernels per call, their compute alone (the transfers
    they hide or wait for: ``context_price.ring_s``) (module docstring)."""
    if cp > 1 and method is CpAttention.RING:
        f0, f, b0, b = ring_step_times(op, microbatch, style, tp, device, dtype, cp)
        return op.count * (f0 + (cp - 1) * f), op.count * (b0 + (cp - 1) * b)
    work = microbatch * op.flops_per_sample * op.split(style, tp)
    if cp > 1 and method is CpAttention.ULYSSES:
        work /= cp
    if cp <= 1 or method is CpAttention.ULYSSES:  # a call with its own mask at the masked rate
        return (op.count * attention_time_s(work, device, dtype, causal=op.causal, masked=op.masked),
                op.count * attention_time_s(work, device, dtype, backward=True, causal=op.causal,
                                            masked=op.masked))
    calls, each = op.count * CP_ATTENTION_CALLS, work * cp_attention_share(cp) / CP_ATTENTION_CALLS
    return (calls * attention_time_s(each, device, dtype, masked=True),
            calls * attention_time_s(each, device, dtype, backward=True, masked=True))


@dataclass(frozen=True)
class LayerCompute:
    """Forward and backward time of one layer call, seconds: each the longer of its kernels' time on the
    device and the host's time issuing them (:func:`host_time_s`)."""

    device_fwd_s: float
    device_bwd_s: float
    host_fwd_s: float = 0.0
    host_bwd_s: float = 0.0

    @property
    def fwd_s(self) -> float:
        return max(self.device_fwd_s, self.host_fwd_s)

    @property
    def bwd_s(self) -> float:
        return max(self.device_bwd_s, self.host_bwd_s)


def host_ops(layer: Layer, cp: int = 1, method: CpAttention = CpAttention.ALL_GATHER,
             float8: frozenset[tuple[int, int]] = frozenset(), compiled: bool = False) -> tuple[float, float]:
    """(forward, backward) ops the host issues for one call of ``layer``, in eager ops, from capture's records:
    each GEMM once forward and twice backward (dX, dW), each attention kernel once each way (under cp its
    :data:`CP_ATTENTION_CALLS` chunks, or the ring's cp steps), each memory-bound kernel once forward and
    :data:`MEMORY_BOUND_BACKWARD_FACTOR` times backward, and backward's gradient accumulation, one op per
    parameter; a float8 linear's casts (:func:`float8_casts_s`: two forward, four backward, each
    ``cost_models.compute``'s eager kernel count). Views, which launch nothing, are not counted (an
    underestimate where a layer is all views). A compiled block costs its host
    :data:`~autopar.cost_models.gpu_figures.COMPILED_HOST_SHARE` of that (its casts fused to the compiled kernel
    count): guards, compiled autograd's wrappers and fused launches in place of eager's dispatches."""
    gemms = attention = memory = casts = 0.0
    calls = cp if cp > 1 and method is CpAttention.RING else (
        CP_ATTENTION_CALLS if cp > 1 and method is CpAttention.ALL_GATHER else 1)
    for op in layer.ops:
        if op.kind is OpKind.GEMM:
            gemms += op.count
            casts += op.count if float8 and is_float8(op, float8) else 0
        elif op.kind is OpKind.ATTENTION:
            attention += op.count * calls
        else:
            memory += op.count
    params = len(layer.param_names)
    fwd = gemms + attention + memory
    bwd = 2 * gemms + attention + MEMORY_BOUND_BACKWARD_FACTOR * memory + params
    if compiled:
        share, per_cast = COMPILED_HOST_SHARE, FLOAT8_CAST_COMPILED_KERNELS
        return share * fwd + 2 * casts * per_cast, share * bwd + 4 * casts * per_cast
    per_cast = FLOAT8_CAST_EAGER_KERNELS
    return fwd + 2 * casts * per_cast, bwd + 4 * casts * per_cast


def host_time_s(layer: Layer, device: DeviceSpec, cp: int = 1, method: CpAttention = CpAttention.ALL_GATHER,
                float8: frozenset[tuple[int, int]] = frozenset(), compiled: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds the host spends issuing one call of ``layer`` (:func:`host_ops` ×
    the op model's ``host_op_s``); 0 without an op model or records (the FLOPs model's per-call
    overhead covers it there)."""
    if device.op_model is None or not layer.ops or device.op_model.host_op_s <= 0:
        return 0.0, 0.0
    fwd, bwd = host_ops(layer, cp, method, float8, compiled)
    return fwd * device.op_model.host_op_s, bwd * device.op_model.host_op_s


def master_hooks_s(layer: Layer, times: LayerCompute, device: DeviceSpec) -> float:
    """What a bf16 plan's fp32 master weights add to ``layer``'s backward where the host paces it. Outside
    FSDP2 (dp = 1, or DDP) each parameter's post-accumulate hook moves its bf16 gradient into the fp32
    master's (``runtime/precision.py``, ``MasterWeights``): one more eager op a parameter a microbatch, issued
    by the host beside the backward's own. 0 without a host term (on a CPU the host is the device, and the
    copy is priced by its bytes with the gradient)."""
    if device.op_model is None or device.op_model.host_op_s <= 0 or not layer.param_names:
        return 0.0
    host = times.host_bwd_s + len(layer.param_names) * device.op_model.host_op_s
    return max(0.0, host - times.bwd_s)


def style_flops_per_sample(layer: Layer, style: str | None, tp: int) -> float:
    """The layer's forward FLOPs per sample on one rank under ``style`` (the style's sharded share split)."""
    if style is None or tp <= 1:
        return layer.flops_per_sample
    return layer.flops_per_sample - layer.tp_style(style).sharded_flops_per_sample * (1 - 1 / tp)


def op_flops_per_sample(layer: Layer, style: str | None, tp: int) -> float:
    """The forward FLOPs per sample one rank's recorded GEMM and attention kernels do under ``style``."""
    total = 0.0
    for op in layer.ops:
        if op.kind is OpKind.GEMM:
            total += op.gemm_flops_per_sample() * op.split(style, tp)
        elif op.kind is OpKind.ATTENTION:
            total += op.count * op.flops_per_sample * op.split(style, tp)
    return total


def cp_flops_per_sample(layer: Layer, flops: float, style: str | None, tp: int, cp: int,
                        method: CpAttention = CpAttention.ALL_GATHER) -> float:
    """One of ``cp`` ranks' forward FLOPs per sample, the layer's being ``flops`` on one rank under
    ``style``: 1/cp of every op, and of the recorded attention kernels :func:`cp_attention_share`
    instead. A layer without records cannot tell its attention apart: 1/cp of all (an upper bound)."""
    if cp <= 1:
        return flops
    attention = sum(op.count * op.flops_per_sample * op.split(style, tp)
                    for op in layer.ops if op.kind is OpKind.ATTENTION)
    return flops / cp - attention * (1 / cp - cp_attention_share(cp, method))


def is_float8(op: OpRecord, float8: frozenset[tuple[int, int]]) -> bool:
    """Whether ``op`` is the GEMM of a converted linear: a plain (unbatched) product whose weight
    shape (n, k) is a converted linear's (out_features, in_features) in this layer."""
    return (op.kind is OpKind.GEMM and op.batch == 1 and op.per_sample is SampleDim.M
            and (round(op.n), round(op.k)) in float8)


def float8_casts_s(m: float, n: float, k: float, device: DeviceSpec, dtype: str,
                   compiled: bool) -> tuple[float, float]:
    """(forward, backward) time of one converted GEMM's casts to float8 (``cost_models.compute``):
    forward the input (m × k) and the weight (n × k); backward the output's gradient (m × n) twice,
    the weight and the input once each."""
    size = 2.0 if dtype == "bf16" else 4.0

    def cast(elements: float) -> float:
        return float8_cast_time_s(elements, size, device, compiled=compiled)

    return cast(m * k) + cast(n * k), 2 * cast(m * n) + cast(n * k) + cast(m * k)


def layer_compute(layer: Layer, style: str | None, tp: int, microbatch: int, device: DeviceSpec,
                  dtype: str, act_scale: float = 1.0, cp: int = 1, *, compiled: bool = False,
                  method: CpAttention = CpAttention.ALL_GATHER,
                  float8: frozenset[tuple[int, int]] = frozenset()) -> LayerCompute:
    """Forward and backward time of ``layer`` for one microbatch (module docstring), on one of ``cp``
    ranks that split the sequence: every op does 1/cp of the tokens; attention its two query chunks
    against their key prefixes, or under Ulysses its heads/cp over S (``method``,
    :func:`attention_op_time_s`). ``compiled``: its memory-bound ops
    fused by torch.compile (the op model's ``compiled_memory_bound_fraction``). ``float8``: the (n, k) of the
    layer's converted linears (:func:`is_float8`): their three GEMMs at the device's float8 peak (at
    ``dtype``'s on a device without one: emulated), plus their casts (:func:`float8_casts_s`)."""
    flops = style_flops_per_sample(layer, style, tp)
    b = microbatch
    f8 = "fp8" if device.peak_flops_fp8 > 0 else dtype
    if device.op_model is None or not layer.ops:
        one = cp_flops_per_sample(layer, flops, style, tp, cp, method)
        fwd = compute_time_s(b * one, device, dtype)
        bwd = compute_time_s(BACKWARD_FLOPS_FACTOR * b * one, device, dtype)
        for op in layer.ops if float8 else ():  # the FLOPs model: converted GEMMs' FLOPs moved to float8's rate
            if is_float8(op, float8):
                m, n, k, _ = op.gemm_shape(b, style, tp)
                work = 2.0 * op.count * (m / cp) * n * k
                faster = work / (device.peak_flops(f8) * device.matmul_efficiency) - work / (
                    device.peak_flops(dtype) * device.matmul_efficiency)
                c_fwd, c_bwd = float8_casts_s(m / cp, n, k, device, dtype, compiled)
                fwd += faster + op.count * c_fwd
                bwd += BACKWARD_FLOPS_FACTOR * faster + op.count * c_bwd
        return LayerCompute(fwd, bwd)
    fwd = bwd = 0.0
    fused = device.op_model.compiled_memory_bound_fraction if compiled else 1.0
    for op in layer.ops:
        if op.kind is OpKind.GEMM:
            m, n, k, batch = op.gemm_shape(b, style, tp)
            m, batch = (m / cp, batch) if op.per_sample is SampleDim.M else (m, batch / cp)
            kind = dtype
            if float8 and is_float8(op, float8):
                kind = f8
                c_fwd, c_bwd = float8_casts_s(m, n, k, device, dtype, compiled)
                fwd, bwd = fwd + op.count * c_fwd, bwd + op.count * c_bwd
            fwd += op.count * gemm_time_s(m, n, k, batch, device, kind)
            bwd += op.count * (gemm_time_s(m, k, n, batch, device, kind)
                               + gemm_time_s(k, n, m, batch, device, kind))
        elif op.kind is OpKind.ATTENTION:
            a_fwd, a_bwd = attention_op_time_s(op, b, style, tp, device, dtype, cp, method)
            fwd, bwd = fwd + a_fwd, bwd + a_bwd
        else:
            nbytes = b * op.bytes_per_sample * op.split(style, tp) * act_scale * fused / cp
            fwd += memory_bound_time_s(nbytes, device, op.count * fused)
            bwd += memory_bound_time_s(MEMORY_BOUND_BACKWARD_FACTOR * nbytes, device,
                                       MEMORY_BOUND_BACKWARD_FACTOR * op.count * fused)
    if cp > 1 and method is CpAttention.RING:
        m_fwd, m_bwd = ring_elementwise_s(layer, b, device, dtype, act_scale, cp,
                                          share=1.0 / tp if style is not None and tp > 1 else 1.0)
        fwd, bwd = fwd + m_fwd, bwd + m_bwd
    rest = max(0.0, flops - op_flops_per_sample(layer, style, tp)) * b / cp
    rate = device.peak_flops(dtype) * device.matmul_efficiency
    fwd, bwd = fwd + rest / rate, bwd + BACKWARD_FLOPS_FACTOR * rest / rate
    host_fwd, host_bwd = host_time_s(layer, device, cp, method, float8, compiled)
    return LayerCompute(fwd, bwd, host_fwd, host_bwd)


def ring_elementwise_s(layer: Layer, microbatch: int, device: DeviceSpec, dtype: str, act_scale: float, cp: int,
                       *, share: float = 1.0) -> tuple[float, float]:
    """Ring attention's elementwise work around its kernels, (forward, backward) of one microbatch on the
    heaviest rank, as torch's ``_templated_ring_attention`` and its backward do it, with E_o the rank's
    output elements and E_kv its K and V elements of one call, p the plan dtype's bytes, c = p + 4 the
    bytes of a cast to fp32 and back where p < 4 (0 at fp32, where the casts are no-ops):

        forward:  per send (cp − 1) packing K/V, 2·p·E_kv; per step (cp) the block output cast to fp32,
                  c·E_o, and once back; per later step (cp − 1) the merge ``out − σ(lse_b − lse)·(out −
                  out_b)`` over the whole output on rank cp − 1 (three fp32 elementwise passes, 32·E_o)
        backward: the fp32 gradient buffers zeroed, 4·(E_o + E_kv); step 0 accumulating both, A·(E_o +
                  E_kv), A = 8 + p; each later step on rank 0 the K/V gradient plain, A·E_kv, and the
                  query's into its second half, rebuilt whole (``_partial_update``: A/2 + 8 per element of
                  E_o); per send packing K/V (cp − 1, 2·p·E_kv) and their fp32 gradients (cp, 8·E_kv);
                  the gradients cast back, c·(E_o + E_kv)

    The log-sum-exp's own updates (1/head_dim of the output's bytes) are left out. ``share``: of the
    heads (a tp rank's). 0 where capture recorded no attention call's bytes."""
    calls = layer.attention_calls
    if cp <= 1 or not calls or not layer.qo_bytes_per_sample:
        return 0.0, 0.0
    p = 2.0 if dtype == "bf16" else 4.0
    captured = p / act_scale  # the captured dtype's bytes
    e_o = microbatch * layer.qo_bytes_per_sample / 2 / captured / cp / calls * share
    e_kv = microbatch * layer.kv_bytes_per_sample / captured / cp / calls * share
    c = p + 4 if p < 4 else 0.0
    a = 8 + p
    fwd = (cp - 1) * 2 * p * e_kv + (cp + 1) * c * e_o + (cp - 1) * 32 * e_o
    bwd = (4 * (e_o + e_kv) + a * (e_o + e_kv) + (cp - 1) * (a * e_kv + (a / 2 + 8) * e_o)
           + (cp - 1) * 2 * p * e_kv + cp * 8 * e_kv + c * (e_o + e_kv))
    casts = 2 if c else 0
    fwd_kernels = (cp - 1) + (cp + 1) * casts // 2 + (cp - 1) * 6
    bwd_kernels = 2 + 2 + (cp - 1) * 3 + (cp - 1) + cp + casts
    return (calls * memory_bound_time_s(fwd, device, fwd_kernels),
            calls * memory_bound_time_s(bwd, device, bwd_kernels))
