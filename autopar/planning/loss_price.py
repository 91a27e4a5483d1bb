"""The loss priced: which loss a configuration runs (the whole logits' cross-entropy, the chunked loss of
:mod:`autopar.runtime.chunked_loss`, or its vocabulary-parallel form, :mod:`autopar.runtime.vocab_loss`),
its peak memory on the last pipeline rank, its kernels' time, its collectives over tp, and the head GEMM
the chunked loss recomputes. :class:`~.pricing.PriceTable` reads these (``loss``, ``loss_bytes``, the
last layer's compute and tp communication); the rules are the contract's
(:func:`autopar.contract.loss_engine`, :func:`autopar.contract.loss_chunk_tokens`).

Vocabulary-parallel, a rank holds V/tp of the vocabulary: its chunk is as many tokens as fit the
contract's bytes over V/tp classes, its peak two such fp32 chunks, its kernels a tp-th of the loss's,
and it moves, per chunk, an all-gather over tp of two fp32 numbers a token (each rank's log-sum-exp and
target logit: the logits are never gathered) in forward; in backward the hidden state's gradient,
summed over tp, is the head style's all-reduce already priced.
"""

from __future__ import annotations

import math
from typing import Any

from autopar import contract
from autopar.choice import LossKind
from autopar.cost_models import compute
from autopar.cost_models.communication import Collective, collective_time_s
from autopar.cost_models.pipeline import ScheduleKind
from autopar.graph import Layer
from autopar.tp_style import TPStyle

PriceTable = Any  # a planning.pricing.PriceTable (not imported: pricing imports this module)

FP32_BYTES = 4


FP32_PER_TOKEN = 2  # the vocabulary-parallel loss's all-gather: a rank's log-sum-exp and target logit


def loss_runs(table: PriceTable) -> LossKind:
    """The contract's engine for this mesh when the training asks for a chunked loss, else full."""
    return contract.loss_engine(table.graph, table.config.mesh, table.training.loss, table.training.float8)


def vocab_shards(table: PriceTable) -> int:
    """Over how many ranks the loss splits the vocabulary: tp under the vocabulary-parallel loss, else 1."""
    return table.config.mesh.tp if table.loss is LossKind.VOCAB_PARALLEL else 1


def loss_bytes(table: PriceTable) -> tuple[int, int]:
    """(peak, kept beside a layer's backward) of the last rank's loss in fp32 logits of S/cp tokens: log-probs
    kept per microbatch in flight and, while log-softmax's backward runs, the gradients it takes and gives,
    gone before any layer's (three at a bf16 GPT's peak on an H200: ``benchmarks/gpu_memory_peak.py``);
    chunked, one chunk's (:func:`chunked_peak_bytes`), nothing kept between microbatches."""
    if table.loss.chunked:
        return chunked_peak_bytes(table), 0
    kept = table.config.microbatches if table.config.schedule.kind is ScheduleKind.GPIPE else 1
    one = table.microbatch_size * table.graph.output_bytes_per_sample * FP32_BYTES / table.graph.dtype_bytes
    cp = table.config.mesh.cp
    return math.ceil((kept + 2) * one / cp), math.ceil((kept - 1) * one / cp)


def loss_time_s(table: PriceTable) -> tuple[float, float]:
    """(forward, backward) of the loss per microbatch on the last layer's rank: cross-entropy over the output's
    S/cp tokens in fp32 (``cost_models.compute.loss_time_s``; chunked, the same kernels' work in pieces; over
    a rank's vocabulary shard under the vocabulary-parallel loss)."""
    elements = table.microbatch_size * table.graph.output_bytes_per_sample / table.graph.dtype_bytes
    return compute.loss_time_s(elements / table.config.mesh.cp / vocab_shards(table), table.prec.activation_bytes,
                               table.cluster.device)


def tokens(table: PriceTable) -> int:
    """Tokens of one microbatch the loss runs on (S/cp a sample)."""
    return max(math.ceil(table.microbatch_size * _tokens_per_sample(table) / table.config.mesh.cp), 1)


def vocab_comm_s(table: PriceTable) -> float:
    """Forward, per microbatch: the vocabulary-parallel loss's all-gathers over tp (one a chunk, of
    :data:`FP32_PER_TOKEN` fp32 numbers a token of this rank's); 0 under any other loss."""
    if table.loss is not LossKind.VOCAB_PARALLEL:
        return 0.0
    n, chunk = tokens(table), chunk_tokens(table)
    nbytes = FP32_PER_TOKEN * FP32_BYTES * n * table.config.mesh.tp  # the gathered buffer, every rank's
    return collective_time_s(Collective.ALL_GATHER, nbytes, table.tp_group, table.paced_cluster,
                             count=math.ceil(n / chunk))


def _tokens_per_sample(table: PriceTable) -> float:
    """Positions of one sample the loss runs on: the prediction's elements over the vocabulary."""
    head = table.graph.loss_head
    assert head is not None
    return table.graph.output_bytes_per_sample / table.graph.dtype_bytes / head.out_features


def output_gather_s(table: PriceTable, layer: Layer, style: TPStyle, elem: float) -> float:
    """Forward, per microbatch: the all-gather of a tensor-parallel style's output over tp (a vocab head's
    logits, ``elem`` bytes a sample's element) — or, on the head the vocabulary-parallel loss runs on,
    that loss's own collectives (:func:`vocab_comm_s`), the logits never gathered."""
    if style.vocab and table.loss is LossKind.VOCAB_PARALLEL and layer.index == len(table.graph) - 1:
        return vocab_comm_s(table)
    return collective_time_s(Collective.ALL_GATHER, style.fwd_allgather_elems * elem, table.tp_group,
                             table.paced_cluster)


def shard_vocab(table: PriceTable) -> int:
    """Classes a rank's loss holds: the vocabulary, or its tp-th under the vocabulary-parallel loss."""
    head = table.graph.loss_head
    assert head is not None
    return head.out_features // vocab_shards(table)


def chunk_tokens(table: PriceTable) -> int:
    """Tokens in one chunk as this configuration runs it: the contract's for the classes a rank holds, at
    most a microbatch's (S/cp)."""
    return min(contract.loss_chunk_tokens(shard_vocab(table)), tokens(table))


def chunked_peak_bytes(table: PriceTable) -> int:
    """The chunked loss's peak: two fp32 logits of one chunk (over a rank's vocabulary shard when
    vocabulary-parallel) — the chunk's logits and its log-softmax in forward; in backward its logits (the
    softmax computed in place) and log-sum-exp's temporary — beside the gradients of the hidden state and
    the weight, which are priced as the head layer's backward and its gradient (measured: 2.0–2.1 chunks
    beside them on a CPU, ``tests/runtime/test_chunked_loss.py``; vocabulary-parallel, two in forward,
    the log-sum-exp kept, one in backward: ``tests/runtime/test_vocab_loss_ranks.py``); and, where the
    head's weight is not fp32, its gradient (of the rank's shard) accumulated over the chunks in fp32."""
    head = table.graph.loss_head
    assert head is not None
    classes = shard_vocab(table)
    accumulator = FP32_BYTES * classes * head.in_features if table.prec.param_bytes != FP32_BYTES else 0
    return 2 * chunk_tokens(table) * classes * FP32_BYTES + accumulator


def recomputes(table: PriceTable, layer: Layer) -> bool:
    """Whether ``layer`` holds the head whose GEMM the chunked loss runs again in backward (the last)."""
    return table.loss.chunked and layer.index == len(table.graph) - 1


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


__all__ = ["chunk_tokens", "chunked_peak_bytes", "loss_bytes", "loss_runs", "loss_time_s", "output_gather_s",
           "recompute_s", "recomputes", "shard_vocab", "tokens", "vocab_comm_s", "vocab_shards"]
