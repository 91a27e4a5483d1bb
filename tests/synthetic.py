"""Synthetic LayerGraphs with transformer-shaped costs, for solver tests without tracing."""

from __future__ import annotations

from autopar.graph import Layer, LayerGraph
from autopar.tp_style import TPStyle


def transformer_graph(n_blocks: int = 4, hidden: int = 1024, seq: int = 1024, vocab: int = 32768,
                      heads: int = 16, dtype_bytes: int = 2) -> LayerGraph:
    """Embedding, n identical transformer blocks and an LM head, priced by the usual formulas.

    Each layer is one module of its own (``module_path`` its name), as capture finds a GPT's.
    """
    h, s, v = hidden, seq, vocab
    emb = Layer(
        "embed", 0, "Embedding", flops_per_sample=0.0, param_count=v * h, param_bytes=v * h * dtype_bytes,
        activation_bytes_per_sample=0.0, input_bytes_per_sample=8 * s,
        boundary_bytes_per_sample=s * h * dtype_bytes, can_cut_after=True, module_path="embed",
        tp_styles=(TPStyle("vocab", vocab=("embed",), divisors=(v,), sharded_params=v * h,
                           fwd_allreduce_elems=s * h, fwd_allreduce_count=1),),
    )
    block_params = 12 * h * h
    block = dict(
        kind="Block", flops_per_sample=24.0 * s * h * h + 4.0 * s * s * h, param_count=block_params,
        param_bytes=block_params * dtype_bytes, activation_bytes_per_sample=34.0 * s * h + 5.0 * heads * s * s,
        input_bytes_per_sample=s * h * dtype_bytes, boundary_bytes_per_sample=s * h * dtype_bytes,
        can_cut_after=True,
        tp_styles=(TPStyle("megatron", column=("attn.qkv", "mlp.fc"), row=("attn.proj", "mlp.proj"),
                           divisors=(heads, 4 * h), sharded_params=block_params,
                           sharded_flops_per_sample=24.0 * s * h * h + 4.0 * s * s * h,
                           sharded_activation_elems_per_sample=(24.0 * s * h + 5.0 * heads * s * s) / dtype_bytes,
                           fwd_allreduce_elems=2 * s * h, fwd_allreduce_count=2,
                           bwd_allreduce_elems=2 * s * h, bwd_allreduce_count=2,
                           # Megatron-SP: the QKV and FC1 inputs gathered (kept whole), two LayerNorms'
                           # weights and biases and two row biases summed
                           sequence=tuple(d for d in (2, 4, 8) if s % d == 0 and heads % d == 0),
                           sequence_linked=True, sequence_gathers=2, sequence_gather_elems=2.0 * s * h,
                           sequence_grad_sums=6, sequence_grad_sum_elems=6 * h, sequence_stream_elems=1.0 * s * h),),
    )
    blocks = [Layer(f"blocks.{i}", i + 1, module_path=f"blocks.{i}", **block) for i in range(n_blocks)]
    head = Layer(
        "head", n_blocks + 1, "Linear", flops_per_sample=2.0 * s * h * v, param_count=h * v,
        param_bytes=h * v * dtype_bytes, activation_bytes_per_sample=s * h * dtype_bytes + s * v * 4,
        input_bytes_per_sample=s * h * dtype_bytes, boundary_bytes_per_sample=0.0, can_cut_after=False,
        module_path="head",
        tp_styles=(TPStyle("vocab", column=("head",), divisors=(v,), sharded_params=h * v,
                           sharded_flops_per_sample=2.0 * s * h * v, fwd_allgather_elems=s * v,
                           bwd_allreduce_elems=s * h, bwd_allreduce_count=1),),
    )
    return LayerGraph([emb, *blocks, head], model_name="synthetic-gpt", example_batch=1,
                      dtype_bytes=dtype_bytes, seq_len=s)
