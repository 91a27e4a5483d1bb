"""Capture's check for context parallelism (autopar/capturing/context.py): what it proves on the models cp
runs (the project's GPT, a Hugging Face Llama) and the one line naming the op where it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.capturing.context import context_facts
from autopar.errors import PinError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def _gpt():
    import gpt

    return gpt.build(gpt.CONFIGS["gpt-tiny"], batch=2, device="meta")


def test_the_gpt_is_split_with_its_position_embedding_given_global_positions() -> None:
    graph = autopar.capture(*_gpt())
    assert graph.cp_refusal == "" and graph.cp_positions == ("pos_emb",)
    assert graph.cp_attention == ("blocks.0.attn", "blocks.1.attn")
    # K and V of one sample: 2 × 4 heads × 32 tokens × 16 dims × 4 bytes
    assert [l.kv_bytes_per_sample for l in graph if l.name.startswith("blocks.")] == [16384.0, 16384.0]
    # what the head all-to-all (Ulysses) moves and what cp must divide: Q and the output, as many bytes; 4 heads
    assert [(l.qo_bytes_per_sample, l.kv_heads) for l in graph if l.name.startswith("blocks.")] == [(16384.0, (4,))] * 2


@pytest.mark.slow
def test_a_hugging_face_llama_gets_its_rotary_positions_and_grouped_kv_bytes() -> None:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                   attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    graph = autopar.capture(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta")})
    assert graph.cp_refusal == "" and graph.cp_positions[0] == "model.rotary_emb"
    assert graph.cp_attention == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    # K and V of one sample, grouped-query: 2 × 2 kv heads × 16 tokens × 8 dims × 4 bytes
    assert [l.kv_bytes_per_sample for l in graph if l.name.startswith("model.layers.")] == [2048.0, 2048.0]
    # Q and the output of 4 query heads (2 × 4 × 16 × 8 × 4 bytes); 2 key/value heads (cp must divide them)
    assert [(l.qo_bytes_per_sample, l.kv_heads) for l in graph if l.name.startswith("model.layers.")] == [
        (4096.0, (2,))] * 2


class _Manual(nn.Module):
    """Attention written by hand: softmax over a masked q·kᵀ."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


class _Unmasked(nn.Module):
    """q·kᵀ by hand with its softmax before any mask: not causal attention, not rerouted."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (q @ k.transpose(-2, -1)).softmax(-1) @ v


class _Summed(_Unmasked):
    """The scores read otherwise than the pattern (a sum over them) before the product with v."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * 0.5
        return scores.masked_fill(torch.ones(12, 12).triu(1).bool(), float("-inf")).softmax(-1) @ v \
            + scores.sum(-1, keepdim=True)


class _Einsum(_Unmasked):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.einsum("bqd,bkd->bqk", q, k).softmax(-1) @ v


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], is_causal=True)[:, 0] \
            + self.rnn(x)[0]


class _Scan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(1)


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_what_mixes_tokens_otherwise_is_refused_naming_the_op_and_module() -> None:
    x = torch.zeros(2, 12, 8)
    assert context_facts(_Wrapped(_Unmasked()), (x,), {}, 12, 2).refusal == (
        "softmax on a hand-written attention's scores in inner (cp reroutes only q · kᵀ, a scale, masked_fill "
        "with -inf, softmax over the last dim, dropout and · v)")
    assert context_facts(_Wrapped(_Summed()), (x,), {}, 12, 2).refusal.startswith(
        "sum on a hand-written attention's scores in inner")
    assert context_facts(_Wrapped(_Einsum()), (x,), {}, 12, 2).refusal == (
        "einsum makes an S × S score matrix (attention written by hand) in inner")
    assert context_facts(_Wrapped(_Recurrent()), (x,), {}, 12, 2).refusal.startswith("lstm (it mixes tokens")
    assert context_facts(_Wrapped(_Scan()), (x,), {}, 12, 2).refusal == (
        "cumsum (it mixes tokens along the sequence) in inner")
    assert "no sequence dimension" in context_facts(_Scan(), (torch.zeros(2),), {}, None, 2).refusal


def test_the_probe_leaves_the_model_as_it_was() -> None:
    model, inputs = _gpt()
    before = {n: id(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    context_facts(model, inputs, {}, 32, 2)
    assert {n: id(t) for n, t in [*model.named_parameters(), *model.named_buffers()]} == before
    assert "forward" not in vars(model.blocks[1])


def test_attention_written_by_hand_is_followed_op_by_op_and_recorded_for_the_rewrite() -> None:
    """A masked softmax over q·kᵀ (here its mask built from ones, nanoGPT's from its buffer) is
    attention cp can reroute: its module, kᵀ and v bytes, and its inputs (for the lowering's proof)."""
    facts = context_facts(_Wrapped(_Manual()), (torch.zeros(2, 12, 8),), {}, 12, 2)
    assert facts.refusal == "" and facts.manual == {"inner": (((2, 12, 8), "torch.float32"),)}
    assert facts.kv_bytes == {"inner": 2 * 12 * 8 * 4} and facts.calls == {}  # no SDPA call: no prefix masks


@pytest.mark.slow
def test_nanogpt_as_its_author_writes_it_is_captured_for_cp_and_noted_to_hold_s_by_s() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zoo

    model, inputs = zoo.NanoGPT(zoo.NanoConfig()), zoo._ids()
    graph = autopar.capture(model, inputs)
    assert graph.cp_refusal == "" and graph.cp_positions == ("transformer.wpe",)
    assert graph.cp_attention == tuple(graph.cp_manual) == ("transformer.h.0.attn", "transformer.h.1.attn")
    assert [l.kv_bytes_per_sample for l in graph if l.name.startswith("transformer.h.")] == [4096.0, 4096.0]
    assert autopar.LayerGraph.from_dict(graph.to_dict()).cp_manual == graph.cp_manual
    plan = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=2, pins=["cp=2"])
    assert any("holds its S × S score matrix" in n and "8 × 16 a rank under cp=2" in n for n in plan.notes)
    # beside tp its rewrite runs on the tp rank's heads (run against one device: test_context_parallel.py)
    beside_tp = autopar.solve(graph, 4, cluster="cpu", dtype="fp32", global_batch=2,
                              pins=["cp=2", "tp=2", "transformer.h.*:tp=megatron"])
    assert (beside_tp.mesh.cp, beside_tp.mesh.tp) == (2, 2)
    # Ulysses moves q, kᵀ, v and the output by heads (run against one device: test_context_ulysses.py): their
    # heads and q/output bytes recorded; offered beside dp, tp (cp × tp dividing the heads) or pp
    blocks = [l for l in graph if l.name.startswith("transformer.h.")]
    assert [(l.kv_heads, l.qo_bytes_per_sample) for l in blocks] == [((4,), 4096.0)] * 2
    uly = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=2, pins=["cp=2", "cp_attention=ulysses"])
    assert str(uly.cp_attention) == "ulysses"
    assert any("S × S for heads/cp a rank under cp=2 by Ulysses" in n for n in uly.notes)
    uly_tp = autopar.solve(graph, 4, cluster="cpu", dtype="fp32", global_batch=2,
                           pins=["cp=2", "tp=2", "cp_attention=ulysses", "transformer.h.*:tp=megatron"])
    assert (uly_tp.mesh.cp, uly_tp.mesh.tp, str(uly_tp.cp_attention)) == (2, 2, "ulysses")
    with pytest.raises(PinError, match=r"Ulysses at cp × tp = 4 × 2 = 8 needs 8 to divide the key/value heads"):
        autopar.solve(graph, 8, cluster="cpu", dtype="fp32", global_batch=2,
                      pins=["cp=4", "tp=2", "cp_attention=ulysses", "transformer.h.*:tp=megatron"])
