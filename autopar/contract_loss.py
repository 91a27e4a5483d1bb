"""The contract's rules for the plan's loss: where the chunked loss runs, and its chunk of tokens.

Kept apart from :mod:`autopar.contract` (which re-exports every name here) so that each stays small;
torch-free, like it. Pricing (``PriceTable.loss_bytes``), the plan's notes and the runtime
(:mod:`autopar.runtime.chunked_loss`) read these and decide nothing of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.loss_head import NOT_CHECKED
from autopar.units import MiB

if TYPE_CHECKING:
    from autopar.float8 import Float8Settings
    from autopar.graph import LayerGraph
    from autopar.mesh import Mesh

# One chunk's fp32 logits at most: 256 MiB is 512 tokens of a 128K vocabulary, 1,280 of GPT-2's 50K. Each
# chunk's head GEMM (512 × hidden × 128K) stays far above the sizes where a GPU's GEMMs lose their rate, the
# loop runs tens of chunks a microbatch, not thousands, and the loss's peak (about two chunks' fp32 logits,
# PriceTable.loss_bytes) stays below one transformer block's activations at these widths. Liger's fused
# linear cross-entropy sizes its chunks so that a chunk's logits match the head's weight (≈ V·H elements);
# a fixed byte size is chosen here so that the peak does not grow with the hidden size.
CHUNK_LOGITS_BYTES = 256 * MiB
FP32 = 4


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens in one chunk of the chunked loss: as many as fit :data:`CHUNK_LOGITS_BYTES` of fp32 logits
    over ``vocab`` classes, a multiple of 64 where that is at least 64 (whole GEMM tiles)."""
    tokens = max(1, CHUNK_LOGITS_BYTES // (FP32 * max(vocab, 1)))
    return tokens - tokens % 64 if tokens >= 64 else tokens


def chunked_loss_refusal(graph: LayerGraph, mesh: Mesh, float8: Float8Settings | None = None) -> str:
    """Why the chunked loss does not run for ``graph`` on ``mesh`` ("" when it does).

    It runs where capture found the head (:class:`~autopar.loss_head.LossHead`: a plain linear whose
    output is the prediction, in the last layer) and the runtime calls that module: not inside the
    pipeline stages of an export-captured model (single ATen graphs, no module called); not where tp
    may split the head (its layer has a tensor-parallel style at the mesh's tp: the vocabulary-parallel
    cross-entropy is not built); not under cp (not yet run against one device there); not beside ep (a
    compiled run hung there); not where
    float8 converts the head (its GEMM would not be the one priced)."""
    head = graph.loss_head
    if head is None:
        return graph.loss_refusal or NOT_CHECKED
    last = graph[len(graph) - 1]
    if mesh.pp > 1 and graph.tracer == "export":
        return "the pipeline stages of an export-captured model call no head module to replace"
    if mesh.tp > 1 and any(s.admits(mesh.tp) for s in last.tp_styles):
        return (f"tp={mesh.tp} may split the head's layer {last.name} (a vocabulary-parallel cross-entropy "
                "is not built)")
    if mesh.cp > 1:
        return f"cp={mesh.cp}: the chunked loss is not yet run against one device under cp"
    if mesh.ep > 1:  # a compiled Mixtral at dp 2 × ep 2, ZeRO-3, full recompute: both ranks stopped, once
        return (f"ep={mesh.ep}: beside the experts' exchange the chunked loss hung a run of the test suite "
                "(tests/runtime/test_compile_exchanges.py), not yet understood")
    if float8 is not None and any(l.path == head.module_path for l in float8.linears):
        return f"float8 converts the head {head.module_path}"
    return ""


__all__ = ["CHUNK_LOGITS_BYTES", "chunked_loss_refusal", "loss_chunk_tokens"]
