"""What a proved style adds to its price beyond a Megatron pair's two all-reduces.

**Replicated key/value projections.**

Multi-query and grouped-query attention with fewer key/value heads than the tp degree cannot split
the key/value projections by heads; Megatron-Core and vLLM replicate them across the tp group
instead. The simulation (:func:`autopar.sharding.check.check_style`) proves a style that way when
the attention refuses key/value shares (``NoShardRule.replicate``): those projections leave the
style's columns, so the runtime leaves their weights whole; the sharding rules hand each rank the
key/value heads its query heads read, and the gradient of the whole key/value (each rank's part)
is summed over the tp group where it meets the query's share
(:meth:`~autopar.sharding.rules.Collectives.grad_sum`).

Priced so: the replicated projections' parameters and FLOPs are no longer divided by tp, and the
gradient sum is one more all-reduce in backward per replicated projection, of its output's size.

**Key/value rows of one fused projection run whole** (GPTBigCode's multi-query ``c_attn``,
:mod:`autopar.sharding.whole`): the projection's parameters are held whole on every rank; the
whole rows' FLOPs are not divided by tp; backward all-reduces the whole rows' output (one
all-reduce per key and value, where they meet the query's share) and the query rows' weight
gradient (priced per sample, so over-counted by the micro-batch size: a bound, not an estimate).

**Statistics over a sharded dimension.** A norm over the whole query or key projection (OLMo2's
q_norm/k_norm) sums its squares over the heads every rank holds a share of: one all-reduce of one
value per token in forward, and one in backward where the statistic meets the share again.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from autopar.sharding.rules import projection_dims
from autopar.tp_style import TPStyle


def without_replicated(style: TPStyle, module: nn.Module, prefix: str, replicated: tuple[str, ...],
                       tokens_per_sample: int) -> TPStyle:
    """``style`` with the columns ``replicated`` (paths relative to ``module``, the layer at ``prefix``)
    run whole: out of ``column`` and the sharded figures, their gradient sums added to backward."""
    if not replicated:
        return style
    full = {f"{prefix}.{c}": module.get_submodule(c) for c in replicated}
    params = sum(p.numel() for m in full.values() for p in m.parameters(recurse=False))
    dims = {path: projection_dims(m) for path, m in full.items()}
    flops = sum(2.0 * d[0] * d[1] * tokens_per_sample for d in dims.values() if d is not None)
    out_elems = float(sum(d[1] * tokens_per_sample for d in dims.values() if d is not None))
    kept = tuple(c for c in style.column if c not in full)
    widths = {projection_dims(module.get_submodule(c[len(prefix) + 1:]))[1] for c in kept}  # type: ignore[index]
    others = {d for d in style.divisors if d not in {dd[1] for dd in dims.values() if dd is not None}}
    return dataclasses.replace(
        style, column=kept, divisors=tuple(sorted(others | widths)),
        sharded_params=max(0, style.sharded_params - params),
        sharded_flops_per_sample=max(0.0, style.sharded_flops_per_sample - flops),
        bwd_allreduce_elems=style.bwd_allreduce_elems + out_elems,
        bwd_allreduce_count=style.bwd_allreduce_count + len(full))


def with_whole(style: TPStyle, module: nn.Module, prefix: str, whole: dict[str, tuple[int, ...]],
               segments: dict[str, tuple[int, ...]], tokens_per_sample: int) -> TPStyle:
    """``style`` with the ``whole`` segments of fused columns (paths relative to the layer at
    ``prefix``) run whole on every rank, priced as the module docstring says."""
    params, flops, elems, count = 0, 0.0, 0.0, 0
    dropped: set[int] = set()  # a whole column's width is no size tp must divide; its shared segments are
    kept: set[int] = set()
    for c, idx in whole.items():
        mod = module.get_submodule(c)
        dims = projection_dims(mod)
        if dims is None:
            continue
        width = sum(segments[c][i] for i in idx)
        dropped.add(dims[1])
        kept.update(s for i, s in enumerate(segments[c]) if i not in idx)
        params += sum(p.numel() for p in mod.parameters(recurse=False))
        flops += 2.0 * dims[0] * width * tokens_per_sample
        elems += float(width * tokens_per_sample) + (dims[0] + 1) * (dims[1] - width)
        count += len(idx) + 1
    return dataclasses.replace(
        style, whole={f"{prefix}.{c}": i for c, i in whole.items()},
        divisors=tuple(sorted({d for d in style.divisors if d not in dropped} | kept)),
        sharded_params=max(0, style.sharded_params - params),
        sharded_flops_per_sample=max(0.0, style.sharded_flops_per_sample - flops),
        bwd_allreduce_elems=style.bwd_allreduce_elems + elems,
        bwd_allreduce_count=style.bwd_allreduce_count + count)


def with_statistics(style: TPStyle, count: int, tokens_per_sample: int, values_per_token: float,
                    grad_sums: tuple[int, float] | None = None) -> TPStyle:
    """``style`` with ``count`` all-reduces per call inside the layer, of ``values_per_token`` values per
    token in all (a norm's statistic: one; a Mamba mixer's ``x_proj``: its ``dt``, ``B`` and ``C``), the
    same again backward; or, with ``grad_sums`` (count, elements per token), those backward instead: the
    gradient sums of the replicated tensors the simulation counted (a Mamba mixer's ``dt``, ``B``, ``C`` and
    ``x_proj``'s weight, whose sum is per call, priced per token of the simulated call: an upper bound
    once a microbatch holds more tokens)."""
    elems = float(values_per_token * tokens_per_sample)
    bwd_count, bwd_elems = (count, elems) if grad_sums is None else (grad_sums[0], grad_sums[1] * tokens_per_sample)
    if not count and not bwd_count:
        return style
    return dataclasses.replace(
        style, fwd_allreduce_count=style.fwd_allreduce_count + count,
        fwd_allreduce_elems=style.fwd_allreduce_elems + elems,
        bwd_allreduce_count=style.bwd_allreduce_count + bwd_count,
        bwd_allreduce_elems=style.bwd_allreduce_elems + bwd_elems)


__all__ = ["with_statistics", "with_whole", "without_replicated"]
