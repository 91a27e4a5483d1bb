"""The contract's rules for the plan's loss: which loss engine runs, its chunk of tokens, and the tp
styles it fixes.

Asked for ``chunked``, a configuration runs (:func:`loss_engine`): the whole logits where
:func:`chunked_loss_refusal` says why not; the vocabulary-parallel loss where tp splits the head on its
vocabulary (:func:`head_vocab_style`: the head's layer then runs that style, and a tied input embedding
the same split, :func:`loss_fixed_tp`); the chunked loss on a whole head elsewhere.

Kept apart from :mod:`autopar.contract` (which re-exports every name here) so that each stays small;
torch-free, like it. Pricing (``PriceTable.loss``, ``loss_bytes``), the solver's choices, the plan's notes
and the runtime (:mod:`autopar.runtime.chunked_loss`, :mod:`autopar.runtime.vocab_loss`) read these and
decide nothing of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.choice import LossKind
from autopar.loss_head import NOT_CHECKED
from autopar.units import MiB

if TYPE_CHECKING:
    from autopar.float8 import Float8Settings
    from autopar.graph import LayerGraph
    from autopar.mesh import Mesh
    from autopar.tp_style import TPStyle

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
    over ``vocab`` classes (a rank's vocabulary shard under the vocabulary-parallel loss), a multiple of
    64 where that is at least 64 (whole GEMM tiles)."""
    tokens = max(1, CHUNK_LOGITS_BYTES // (FP32 * max(vocab, 1)))
    return tokens - tokens % 64 if tokens >= 64 else tokens


def head_vocab_style(graph: LayerGraph, mesh: Mesh) -> TPStyle | None:
    """The head layer's vocabulary style when tp splits the head on ``mesh`` (the vocabulary-parallel loss
    runs on its shards), else None: tp > 1, a style splitting exactly the head's outputs that admits tp,
    and not a tied end a pipeline splits (those run replicated over tp: :func:`contract.tied_across_stages`)."""
    head = graph.loss_head
    last = graph[len(graph) - 1]
    if head is None or mesh.tp <= 1 or (mesh.pp > 1 and last.tied_params):
        return None
    return next((s for s in last.tp_styles if s.vocab == (head.module_path,) and s.admits(mesh.tp)), None)


def _tied_owner(graph: LayerGraph) -> int | None:
    """The layer that owns the head's tied weight (the input embedding), None for an untied head."""
    head = graph.loss_head
    if head is None or not head.tied:
        return None
    return next((l.index for l in graph if head.weight in l.param_names), None)


def chunked_loss_refusal(graph: LayerGraph, mesh: Mesh, float8: Float8Settings | None = None) -> str:
    """Why the chunked loss does not run for ``graph`` on ``mesh`` ("" when it does, vocabulary-parallel
    or not: :func:`loss_engine`).

    It runs where capture found the head (:class:`~autopar.loss_head.LossHead`: a plain linear whose
    output is the prediction, in the last layer) and the runtime calls that module: not inside the
    pipeline stages of an export-captured model (single ATen graphs, no module called); where tp may
    split the head's layer, only by the head's vocabulary style (and, the weight tied, only where the
    input embedding splits alike); not beside ep (a compiled run hung there); not where float8 converts
    the head (its GEMM would not be the one priced). Under cp it runs on each rank's S/cp tokens, whose
    mean the default loss takes too (``tests/runtime/test_vocab_loss_ranks.py``: each cp method)."""
    head = graph.loss_head
    if head is None:
        return graph.loss_refusal or NOT_CHECKED
    last = graph[len(graph) - 1]
    if mesh.pp > 1 and graph.tracer == "export":
        return "the pipeline stages of an export-captured model call no head module to replace"
    if mesh.tp > 1 and head_vocab_style(graph, mesh) is None and not (mesh.pp > 1 and last.tied_params):
        other = next((s for s in last.tp_styles if s.admits(mesh.tp)), None)
        if other is not None:
            return (f"tp={mesh.tp} may split the head's layer {last.name} by its {other.name!r} style, which "
                    "the vocabulary-parallel loss does not run on")
    if mesh.tp > 1 and head_vocab_style(graph, mesh) is not None and head.tied and mesh.pp == 1:
        owner = _tied_owner(graph)
        if owner is None or not any(s.name == "vocab" and s.admits(mesh.tp) for s in graph[owner].tp_styles):
            return f"the head's weight is tied to {head.weight}, which tp={mesh.tp} cannot split on its vocabulary"
    if mesh.ep > 1:  # a compiled Mixtral at dp 2 × ep 2, ZeRO-3, full recompute: both ranks stopped, once
        return (f"ep={mesh.ep}: beside the experts' exchange the chunked loss hung a run of the test suite "
                "(tests/runtime/test_compile_exchanges.py), not yet understood")
    if float8 is not None and any(l.path == head.module_path for l in float8.linears):
        return f"float8 converts the head {head.module_path}"
    return ""


def loss_engine(graph: LayerGraph, mesh: Mesh, asked: LossKind, float8: Float8Settings | None = None) -> LossKind:
    """The loss a configuration runs when ``asked`` for it: the whole logits where asked so or the chunked
    loss is refused; vocabulary-parallel where tp splits the head (:func:`head_vocab_style`); else chunked."""
    if asked is LossKind.FULL or chunked_loss_refusal(graph, mesh, float8):
        return LossKind.FULL
    return LossKind.VOCAB_PARALLEL if head_vocab_style(graph, mesh) is not None else LossKind.CHUNKED


KEEP = object()  # loss_fixed_tp: the loss leaves the layer's tp style to the solver


def loss_fixed_tp(graph: LayerGraph, index: int, mesh: Mesh, loss: LossKind) -> str | None | object:
    """The tp style the loss fixes for layer ``index`` (a style's name, or None: replicated over tp), or
    :data:`KEEP`. Under the vocabulary-parallel loss the head's layer runs its vocabulary style, and the
    input embedding its tied weight belongs to runs its own (both shard the weight's vocabulary rows over
    tp alike, so the one weight stays one). Elsewhere the two ends of tied embeddings in one stage run
    replicated over tp: split one way on one end and not (or otherwise) on the other, the tie would
    become two weights."""
    if mesh.tp <= 1:
        return KEEP
    if loss is LossKind.VOCAB_PARALLEL:
        style = head_vocab_style(graph, mesh)
        assert style is not None
        if index == len(graph) - 1:
            return style.name
        if mesh.pp == 1 and graph.loss_head.tied and index == _tied_owner(graph):  # type: ignore[union-attr]
            return "vocab"
    if mesh.pp == 1 and graph[index].tied_params:
        return None
    return KEEP


__all__ = ["CHUNK_LOGITS_BYTES", "KEEP", "chunked_loss_refusal", "head_vocab_style", "loss_chunk_tokens", "loss_engine",
           "loss_fixed_tp"]
