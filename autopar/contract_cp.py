"""The contract's rules for context parallelism (cp): where it runs, which attention method, which ranks
average gradients. Kept apart from :mod:`autopar.contract` (which re-exports every name here) so that
each stays small; torch-free, like it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.choice import CpAttention

if TYPE_CHECKING:
    from autopar.graph import Layer, LayerGraph
    from autopar.mesh import Mesh
    from autopar.tp_style import TPStyle


def data_ranks(mesh: Mesh) -> int:
    """The ranks that hold the same weights and average their gradients: dp × cp. A cp rank trains
    other tokens of the same samples, so its gradients average with its cp group's as with its dp
    group's, and ZeRO shards over both (torchtitan's ``dp_shard_cp``)."""
    return mesh.dp * mesh.cp


def cp_refusal(mesh: Mesh, graph: LayerGraph | None = None) -> str | None:
    """Why ``mesh``'s context parallelism cannot run (None when it can): this slice lowers cp beside
    dp, tp, pp and ep (``passes/context_parallel.py``). Beside dp, every
    per-layer choice the contract offers runs under cp as priced, each checked against one device
    (``tests/runtime/test_context_parallel.py``): ZeRO 0–3 per layer over dp × cp (a replicated plan
    on one FSDP2 replicate unit: :func:`plan_engine` gives DDP only where dp is the one axis above 1),
    recompute none, full, selective or alternate_mm per layer, and any microbatch count. Beside tp,
    each cp rank's tp ranks split the heads and MLP of the same tokens, with or without sequence
    parallelism, and K and V are gathered over the cp group for the tp rank's heads (run against one
    device at cp=2 × tp=2, the project's GPT and a Hugging Face Llama, sp off and on, also with ZeRO-3
    and selective recompute or ZeRO-1 and full recompute over 2 microbatches); a style whose
    key or value projections are held whole on every tp rank is not offered under cp
    (:func:`cp_admits_style`). Beside pp, each stage's attention modules gather K and V over the cp
    group, the stages pass the rank's S/cp tokens to each other, and the sequence is split once,
    before stage 0 (run against one device at cp=2 × pp=2 under GPipe, 1F1B and interleaved 1F1B);
    not where the stages are single ATen graphs (``graph``'s tracer ``"export"``), in which no
    attention module is called for cp to gather K and V in. Attention written by hand (nanoGPT's masked
    softmax, ``graph.cp_manual``: ``passes/manual_attention.py``) runs under cp beside dp, pp, tp and ep (run
    against one device at cp=2, cp=2 × dp=2, cp=2 × pp=2, cp=2 × tp=2 with sp off and on, and cp=2 × ep=2:
    beside tp its two products gather the tp rank's heads of kᵀ and v). Beside ep (beside dp, tp and pp), ep borrows its
    ranks from dp × cp (:mod:`autopar.mesh`): an MoE block dispatches the rank's S/cp tokens over its ep
    group, which may hold cp ranks of the same samples; the router is per token, with no capacity or drop
    rule in the blocks ep lowers, so splitting the sequence changes no routing decision, and the experts
    average over the (dp × cp)/ep ranks holding the same ones (run against one device at cp=2 × ep=2 on
    W=2 and at dp=2 × cp=2 × ep=2 on W=4, Mixtral and Qwen2-MoE, all-gather, Ulysses and the ring; at cp=2 ×
    ep=2 beside tp=2, Megatron attention with the ep group the cp pair of each tp rank, and inside pp=2
    stages under 1F1B, the ep group each stage's cp pair, W=4, all-gather and the ring; and inside pp=2
    stages beside tp=2, W=8; Mixtral; and attention written by hand at cp=2 × ep=2, nanoGPT with Mixtral's
    sparse MoE blocks for MLPs, all-gather and Ulysses: ``tests/runtime/test_context_experts.py``). The ring's
    sends and Ulysses' all-to-alls run on the cp group, the dispatch on the ep group, there the same pair (on
    two ranks the very same process group, at dp=2 × cp=2 another one); every rank issues them in one order."""
    if mesh.cp <= 1:
        return None
    capped = next((layer.name for layer in graph or () for m in layer.moe if m.capacity_factor is not None), None)
    if capped is not None:
        return (f"cp={mesh.cp} cannot split {graph.model_name}'s sequence: the mixture-of-experts block of "
                f"{capped} drops tokens past a capacity computed from the tokens of each call, so a rank's S/cp "
                "tokens would drop others than one device drops; use cp=1")
    if graph is not None and mesh.pp > 1 and graph.tracer == "export":  # contract.tp_applies's rule
        return (f"cp={mesh.cp} with pp={mesh.pp} cannot run on {graph.model_name}: its pipeline stages are "
                "single ATen graphs (torch.export could not keep its layers' module calls), in which no "
                "attention module is called for cp to gather K and V; use pp=1")
    return None


def cp_admits_style(style: TPStyle, mesh: Mesh) -> bool:
    """Whether a tensor-parallel style runs under ``mesh``'s cp: not one that holds some projections
    whole on every tp rank (multi-query key/value heads fewer than the tp ranks), whose attention
    the cp pass cannot gather per head (``passes/context_parallel.py``, :func:`_tp_heads`)."""
    return mesh.cp <= 1 or not style.whole


def cp_admits_sequence(seq_len: int, mesh: Mesh) -> bool:
    """Whether sequence parallelism can split a cp rank's S/cp tokens over the tp ranks."""
    return mesh.cp <= 1 or (seq_len // mesh.cp) % mesh.tp == 0


def ulysses_refusal(graph: LayerGraph, mesh: Mesh) -> str | None:
    """Why cp's head all-to-all (Ulysses, :attr:`CpAttention.ULYSSES`) cannot run ``graph``'s attention
    on ``mesh`` (None when it can). It hands each cp rank heads/cp of every call's query and key/value
    heads, so cp must divide the key/value heads (a query head's key/value head then lands on its rank:
    grouped-query heads stay grouped); beside tp it splits the tp rank's share, so cp × tp must divide
    them (a layer tp leaves whole holds all its heads: cp alone would do, cp × tp is asked of all).
    Attention written by hand (``graph.cp_manual``, ``passes/manual_attention.py``) moves q, kᵀ, v and its
    output alike, its heads recorded at capture from q, kᵀ and v (beside tp the tp rank's heads, split
    again over cp); it runs beside dp, tp, pp and ep (run against one device at cp=2, also with selective
    recompute over 2 microbatches, cp=4, cp=2 × dp=2 at ZeRO-3, cp=2 × tp=2 with sp off and on, cp=2 ×
    pp=2 under 1F1B and cp=2 × pp=2 × tp=2, nanoGPT: ``tests/runtime/test_context_ulysses.py``; cp=2 ×
    ep=2, nanoGPT with Mixtral's sparse MoE blocks for MLPs: ``tests/runtime/test_context_experts.py``).
    Head counts come from capture (``capturing.context``); a graph captured before they were recorded,
    or a call whose key and value are not 4-D [batch, heads, sequence, dim], gets no Ulysses. Inside
    pipeline stages it runs as the all-gather does there (each stage's attention modules hold the mode;
    run against one device at cp=2 × pp=2, the project's GPT and a Hugging Face Llama, 1F1B, GPipe at
    ZeRO-3 with full recompute, interleaved 1F1B: ``tests/runtime/test_context_ulysses.py``)."""
    if mesh.cp <= 1:
        return "Ulysses splits attention over the cp ranks, and cp is 1"
    split, by = mesh.cp * mesh.tp, (f"cp × tp = {mesh.cp} × {mesh.tp} = {mesh.cp * mesh.tp}" if mesh.tp > 1
                                     else f"cp={mesh.cp}")
    for layer in graph:
        if not layer.attention_calls and not _holds_manual(graph, layer):
            continue
        if not layer.kv_heads or 0 in layer.kv_heads:
            return (f"Ulysses needs each attention call's key/value head count, which capture did not record "
                    f"for {layer.name} (key and value not [batch, heads, sequence, dim], or an older capture)")
        wrong = [h for h in layer.kv_heads if h % split]
        if wrong:
            return (f"Ulysses at {by} needs {split} to divide the key/value heads, but {layer.name} has "
                    f"{wrong[0]} key/value heads")
    return None


def _holds_manual(graph: LayerGraph, layer: Layer) -> bool:
    """Whether ``layer``'s module holds attention written by hand (``graph.cp_manual``)."""
    mp = layer.module_path
    return bool(mp) and any(p == mp or p.startswith(mp + ".") for p in graph.cp_manual)


def ring_refusal(graph: LayerGraph, mesh: Mesh) -> str | None:
    """Why ring attention (:attr:`CpAttention.RING`: K/V passed round the cp ring by torch's
    ``_templated_ring_attention``, ``passes/context_ring.py``) cannot run ``graph``'s attention on ``mesh``
    (None when it can). It replaces causal SDPA calls of 4-D [batch, heads, sequence, dim] tensors (torch's
    ring passes dim 2; capture records their key/value heads only for such calls), so not attention
    written by hand, whose masked softmax returns no log-sum-exp to merge partial outputs by. Beside tp each
    tp rank passes its heads' K/V (h_kv/tp) round its cp group; inside pipeline stages each stage's
    attention modules run the ring over their cp group. Run against one device beside dp (cp=2 and cp=4,
    cp=2 × dp=2), beside tp (cp=2 × tp=2, the GPT's Megatron blocks and vocab-parallel embeddings, and a
    Llama's with sequence parallelism), inside pp stages (cp=2 × pp=2, the GPT under 1F1B and a Llama
    under GPipe with full recompute) and both (cp=2 × pp=2 × tp=2, the GPT), the project's GPT and a Hugging
    Face Llama: ``tests/runtime/test_context_ring.py``; and beside ep (cp=2 × ep=2 on W=2, dp=2 × cp=2 × ep=2,
    and cp=2 × ep=2 beside tp=2 or inside pp=2 stages on W=4, a Hugging Face Mixtral:
    ``tests/runtime/test_context_experts.py``), its K/V passed round the cp group while the MoE blocks
    dispatch over the ep group."""
    if mesh.cp <= 1:
        return "ring attention passes K/V round the cp ranks, and cp is 1"
    if graph.cp_manual:
        return (f"ring attention does not run on attention written by hand ({next(iter(graph.cp_manual))}: its "
                "masked softmax gives no log-sum-exp to merge the ring's partial outputs by); cp there gathers K/V")
    for layer in graph:
        if layer.attention_calls and (not layer.kv_heads or 0 in layer.kv_heads):
            return (f"ring attention needs each attention call's query, key and value [batch, heads, sequence, dim], "
                    f"which capture did not record for {layer.name}")
    return None


def ring_device_refusal(backend: str, dtype: str) -> str | None:
    """Why ring attention cannot run on a cluster of ``backend`` at the plan's ``dtype`` (None when it can).
    On CUDA (an NCCL cluster) the ring drives SDPA's flash kernel (``passes/context_ring.py``), which
    takes fp16 and bf16 tensors only; a plan trained in fp32 would hand it fp32 ones. On CPU (gloo) the
    flash kernel takes fp32 too."""
    if backend != "gloo" and dtype == "fp32":
        return ("ring attention on CUDA runs SDPA's flash kernel, which takes fp16 and bf16 tensors, not this "
                "plan's fp32; cp there gathers K/V or uses Ulysses")
    return None


def cp_methods(graph: LayerGraph, mesh: Mesh) -> tuple[CpAttention, ...]:
    """The attention methods a cp mesh offers on ``graph``: all-gather always, Ulysses and ring where they run."""
    if mesh.cp <= 1:
        return (CpAttention.ALL_GATHER,)
    return ((CpAttention.ALL_GATHER,) + (() if ulysses_refusal(graph, mesh) else (CpAttention.ULYSSES,))
            + (() if ring_refusal(graph, mesh) else (CpAttention.RING,)))


def method_refusal(method: CpAttention, graph: LayerGraph, mesh: Mesh) -> str | None:
    """Why ``method`` cannot run ``graph``'s attention on ``mesh`` (None when it can; all-gather always can)."""
    if method is CpAttention.ULYSSES:
        return ulysses_refusal(graph, mesh)
    if method is CpAttention.RING:
        return ring_refusal(graph, mesh)
    return None


__all__ = ["cp_admits_sequence", "cp_admits_style", "cp_methods", "cp_refusal", "data_ranks", "method_refusal",
           "ring_device_refusal", "ring_refusal", "ulysses_refusal"]
