"""Ring attention under context parallelism (``cp_attention`` ``ring``): torch's own ring, driven with
SDPA's flash kernel of the device the tensors are on.

Each cp rank holds the head and tail chunks of the sequence (``passes/context_chunks.positions``, the
order torch's ``_HeadTailLoadBalancer`` makes). torch's ``_templated_ring_attention`` runs cp steps:
step 0 the rank's queries against its own K/V (causal), then K/V passed one rank along the ring per
step (``_RotateMethod.ALL_TO_ALL``: ``permute_tensor``, one send to the next rank and one receive from
the previous, issued before the step's attention so the transfer runs under it), each step's partial
output merged into the running one by the log-sum-exp both carry; with the head-tail layout every
step i ≥ 1 computes one unmasked half block (its queries against the earlier chunk of the K/V in hand,
or its later query chunk against all of it). Its backward, ``_templated_ring_attention_backward``,
passes K/V round again and the K/V gradients round with them (fp32), each rank's queries' gradients
summed on the way. No rank holds more than its own K/V and the pair in flight (the all-gather keeps all
cp chunks for the backward).

torch ties the two templates to its DTensor dispatch for CUDA's flash, efficient and cuDNN kernels
(``context_parallel``); SDPA's CPU flash kernel has no sharding rule there (pytorch#147793). The
templates themselves take any op returning (out, logsumexp, ...), so :class:`RingAttention` (an
autograd function: the forward template, and the backward template for its gradient) drives them with
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward on CPU; on CUDA the same with
``aten._scaled_dot_product_flash_attention``. Grouped-query K/V travel with their own heads and are
repeated to the query's inside the op (their gradients summed back there), so the ring moves h_kv
heads. Equal to one device's causal SDPA within 1e-5 in fp32, forward and gradients, at cp = 2 and 4
on gloo (``tests/runtime/test_context_ring.py``, the ``ring_op`` case). Beside tensor parallelism q, k and
v reach it as the tp rank's head shards (``passes/context_parallel._tp_heads``), so each tp rank passes
its h_kv/tp heads' K/V round its cp group; inside pipeline stages each stage's attention modules call it
(trained against one device at cp=2 × tp=2 and cp=2 × pp=2, ``tests/runtime/test_context_ring.py``). Beside
expert parallelism the MoE blocks dispatch over the ep group, which may hold the cp group's ranks or be the cp
group itself (cp=2 × ep=2 on two ranks: torch's world group); the ring's sends are awaited inside the call,
before the block's dispatch, in the same order on every rank (trained against one device at cp=2 × ep=2, also
beside dp, tp and inside pp stages, ``tests/runtime/test_context_experts.py``).
The CUDA branch is torch's own calls of its flash kernel and is not run on this project's CPU machines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from autopar.errors import LoweringError

SEQ_DIM = 2  # torch's ring splits and passes dim 2: [batch, heads, sequence, dim]


def ring_runtime() -> tuple[Any, Any]:
    """torch's context-parallel attention module and its options (LoweringError where this torch lacks them)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    except ImportError as exc:
        raise LoweringError(f"ring attention needs torch's _templated_ring_attention, absent from torch "
                            f"{torch.__version__} ({exc})") from None
    if not all(hasattr(ring, n) for n in ("_templated_ring_attention", "_templated_ring_attention_backward",
                                          "_cp_options", "_RotateMethod")):
        raise LoweringError(f"ring attention needs torch's _templated_ring_attention, absent from torch "
                            f"{torch.__version__}")
    return ring, ring._cp_options


@contextlib.contextmanager
def _ring_options(options: Any, rotate: Any) -> Iterator[None]:
    """torch's ring options set for one call (process-wide in torch): K/V passed by ring, not all-gathered,
    in the head-tail order the pass lays the tokens out in, partial outputs merged in fp32."""
    saved = (options.rotate_method, options.enable_load_balance, options.convert_to_f32)
    options.rotate_method, options.enable_load_balance, options.convert_to_f32 = rotate, True, True
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance, options.convert_to_f32 = saved


def _flash_ops(device: torch.device) -> tuple[Any, Any]:
    """SDPA's flash kernel returning (out, logsumexp) on ``device``, and its backward."""
    aten = torch.ops.aten
    if device.type == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward)
    if device.type == "cuda":
        return aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward
    raise LoweringError(f"ring attention runs on CPU and CUDA tensors, got {device.type}")


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """K or V of h_kv heads repeated to the query's h = groups · h_kv (SDPA's ``enable_gqa`` order)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of a repeated K or V summed back onto its h_kv heads."""
    if groups == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.reshape(b, h // groups, groups, n, d).sum(2)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's head-tail queries over the whole sequence by torch's ring (module
    docstring): forward ``_templated_ring_attention``, backward ``_templated_ring_attention_backward``,
    each with the flash kernel of the tensors' device, called as torch's own CUDA ring calls it
    (``_scaled_dot_product_ring_flash_attention`` and its backward: the forward's extra outputs, its
    sequence bounds and RNG state, handed to every backward step)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                scale: float | None) -> torch.Tensor:
        ring, options = ring_runtime()
        if q.device.type == "cuda" and q.dtype == torch.float32:  # contract.ring_device_refusal's rule
            raise LoweringError("ring attention on CUDA runs SDPA's flash kernel, which takes fp16 and bf16 "
                                "tensors, not fp32: re-plan with --dtype bf16, or pin cp_attention=allgather")
        fwd_op, _ = _flash_ops(q.device)
        groups = q.shape[1] // k.shape[1]

        def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> tuple:
            return tuple(fwd_op(query, _repeat(key, groups), _repeat(value, groups), **kw))

        with _ring_options(options, ring._RotateMethod.ALL_TO_ALL):
            out, lse, *rest = ring._templated_ring_attention(group, SEQ_DIM, op, q, k, v, is_causal=True,
                                                              dropout_p=0.0, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.groups, ctx.rest = group, scale, groups, rest
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ring, options = ring_runtime()
        q, k, v, out, lse = ctx.saved_tensors
        groups, (_, bwd_op) = ctx.groups, _flash_ops(q.device)
        extra: dict[str, Any] = {}
        if q.device.type == "cuda":  # flash's forward outputs past (out, lse), as torch's CUDA ring passes them
            names = ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset")
            extra = dict(zip(names, ctx.rest[:len(names)]))

        def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
               logsumexp: torch.Tensor, grad_out: torch.Tensor, **kw: Any) -> tuple:
            grads = bwd_op(grad_out=grad_out, query=query, key=_repeat(key, groups), value=_repeat(value, groups),
                           out=out, logsumexp=logsumexp, **kw)
            return grads[0], _fold(grads[1], groups), _fold(grads[2], groups)

        with _ring_options(options, ring._RotateMethod.ALL_TO_ALL):
            dq, dk, dv = ring._templated_ring_attention_backward(
                ctx.group, SEQ_DIM, op, grad.contiguous(), "grad_out", q, k, v, out, lse, is_causal=True,
                dropout_p=0.0, scale=ctx.scale, **extra)[:3]
        return dq, dk, dv, None, None


# Under torch.compile (autopar.runtime.compiled) the ring stays eager, a graph break the block compiles around:
# dynamo cannot trace torch's private ring (an lse buffer it keeps aliases a higher-order op's output).
@torch.compiler.disable
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, kwargs: dict) -> torch.Tensor:
    """Causal SDPA of this rank's head-tail tokens ``q`` [b, h, S/cp, d] against every key, by
    :class:`RingAttention` over ``group``; ``kwargs``: the call's other SDPA arguments (``scale``,
    ``enable_gqa``; no dropout, no mask: the ring's kernels run causal blocks without either). Under
    torch.compile it runs eagerly, the block compiled around it (``autopar.runtime.compiled.breaks_at_exchanges``)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise LoweringError(f"ring attention needs query, key and value [batch, heads, sequence, dim], got "
                            f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)} (capture proved them: the model "
                            "changed since)")
    if kwargs.get("dropout_p", 0.0):
        raise LoweringError(f"ring attention runs without attention dropout, got dropout_p={kwargs['dropout_p']}")
    if k.shape[1] != q.shape[1] and (not kwargs.get("enable_gqa", False) or q.shape[1] % k.shape[1]):
        raise LoweringError(f"ring attention: {q.shape[1]} query heads over {k.shape[1]} key/value heads "
                            "without enable_gqa")
    return RingAttention.apply(q, k.contiguous(), v.contiguous(), group, kwargs.get("scale"))


__all__ = ["RingAttention", "ring_attention", "ring_runtime"]
