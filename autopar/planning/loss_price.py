"""The loss priced: which loss a configuration runs (the whole logits' cross-entropy, or the chunked loss of
:mod:`autopar.runtime.chunked_loss`), its peak memory on the last pipeline rank, its kernels' time, and the
head GEMM the chunked loss recomputes. :class:`~.pricing.PriceTable`
reads these (``loss``, ``loss_bytes``, the last layer's compute); the rules are the contract's
(:func:`autopar.contract.chunked_loss_refusal`, :func:`autopar.contract.loss_chunk_tokens`).
"""

from __future__ import annotations

import math
from typing import Any

from autopar import contract
from autopar.choice import LossKind
from autopar.cost_models import compute
from autopar.cost_models.pipeline import ScheduleKind
from autopar.graph import Layer

PriceTable = Any  # a planning.pricing.PriceTable (not imported: pricing imports this module)

FP32_BYTES = 4


def loss_runs(table: PriceTable) -> LossKind:
    """Chunked where the training asks for it and the contract lets it run on this mesh, else full."""
    if table.training.loss is LossKind.CHUNKED and not contract.chunked_loss_refusal(
            table.graph, table.config.mesh, table.training.float8):
        return LossKind.CHUNKED
    return LossKind.FULL


def loss_bytes(table: PriceTable) -> tuple[int, int]:
    """(peak, kept beside a layer's backward) of the last rank's loss in fp32 logits of S/cp tokens: log-probs
    kept per microbatch in flight and, while log-softmax's backward runs, the gradients it takes and gives,
    gone before any layer's (three at a bf16 GPT's peak on an H200: ``benchmarks/gpu_memory_peak.py``);
    chunked, one chunk's (:func:`chunked_peak_bytes`), nothing kept between microbatches."""
    if table.loss is LossKind.CHUNKED:
        return chunked_peak_bytes(table), 0
    kept = table.config.microbatches if table.config.schedule.kind is ScheduleKind.GPIPE else 1
    one = table.microbatch_size * table.graph.output_bytes_per_sample * FP32_BYTES / table.graph.dtype_bytes
    cp = table.config.mesh.cp
    return math.ceil((kept + 2) * one / cp), math.ceil((kept - 1) * one / cp)


def loss_time_s(table: PriceTable) -> tuple[float, float]:
    """(forward, backward) of the loss per microbatch on the last layer's rank: cross-entropy over the output's
    S/cp tokens in fp32 (``cost_models.compute.loss_time_s``; chunked, the same kernels' work in pieces)."""
    elements = table.microbatch_size * table.graph.output_bytes_per_sample / table.graph.dtype_bytes
    return compute.loss_time_s(elements / table.config.mesh.cp, table.prec.activation_bytes, table.cluster.device)


def _tokens_per_sample(table: PriceTable) -> float:
    """Positions of one sample the loss runs on: the prediction's elements over the vocabulary."""
    head = table.graph.loss_head
    assert head is not None
    return table.graph.output_bytes_per_sample / table.graph.dtype_bytes / head.out_features


def chunk_tokens(table: PriceTable) -> int:
    """Tokens in one chunk as this configuration runs it: the contract's, at most a microbatch's (S/cp)."""
    head = table.graph.loss_head
    assert head is not None
    tokens = math.ceil(table.microbatch_size * _tokens_per_sample(table) / table.config.mesh.cp)
    return min(contract.loss_chunk_tokens(head.out_features), max(tokens, 1))


def chunked_peak_bytes(table: PriceTable) -> int:
    """The chunked loss's peak: two fp32 logits of one chunk — the chunk's logits and its log-softmax in
    forward; in backward its logits (the softmax computed in place) and log-sum-exp's temporary — beside
    the gradients of the hidden state and the weight, which are priced as the head layer's backward and
    its gradient (measured: 2.0–2.1 chunks beside them on a CPU, ``tests/runtime/test_chunked_loss.py``);
    and, where the head's weight is not fp32, its gradient accumulated over the chunks in fp32."""
    head = table.graph.loss_head
    assert head is not None
    accumulator = FP32_BYTES * head.out_features * head.in_features if table.prec.param_bytes != FP32_BYTES else 0
    return 2 * chunk_tokens(table) * head.out_features * FP32_BYTES + accumulator


def recomputes(table: PriceTable, layer: Layer) -> bool:
    """Whether ``layer`` holds the head whose GEMM the chunked loss runs again in backward (the last)."""
    return table.loss is LossKind.CHUNKED and layer.index == len(table.graph) - 1


def recompute_s(table: PriceTable, layer: Layer, forward_s: float) -> float:
    """Per microbatch, what the chunked loss adds to the last layer: the head's GEMM forward again in
    backward (each chunk's logits recomputed), priced as the layer's forward time in the share of its
    FLOPs that is the head's GEMM (2 · hidden · vocabulary a token)."""
    if not recomputes(table, layer) or layer.flops_per_sample <= 0:
        return 0.0
    head = table.graph.loss_head
    assert head is not None
    head_flops = 2.0 * head.in_features * head.out_features * _tokens_per_sample(table)
    return forward_s * min(1.0, head_flops / layer.flops_per_sample)


__all__ = ["chunk_tokens", "chunked_peak_bytes", "loss_bytes", "loss_runs", "loss_time_s", "recompute_s",
           "recomputes"]
