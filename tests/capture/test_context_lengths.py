"""cp's probe (autopar/capturing/context.py) when the sequence length equals another dimension: what the
sequence really is decides, checked again at a second length; a real token mixer is refused at both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.capturing import context
from autopar.capturing.context import context_facts
from autopar.capturing.hf_masks import eager_causal_masks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                   attn_implementation="sdpa")
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


@pytest.mark.slow
def test_a_llama_whose_hidden_size_is_the_sequence_length_is_split() -> None:
    """hidden 64 at 64 tokens (Llama 3 8B's 4096 at 4096): RMSNorm's mean over the hidden dim is no
    mean over tokens; the facts are those at a length no dimension shares, scaled."""
    model = _llama()
    ids = {n: {"input_ids": torch.zeros(2, n, dtype=torch.long, device="meta")} for n in (64, 48)}
    with eager_causal_masks(model, (), ids[64]):  # one run at 64 alone takes the hidden dim for tokens
        assert context._probe_once(model, (), ids[64], 64, 2, {}).facts.refusal == (
            "mean over the sequence dimension in model.layers.0.input_layernorm")
        at_64 = context_facts(model, (), ids[64], 64, 2)
    with eager_causal_masks(model, (), ids[48]):
        at_48 = context_facts(model, (), ids[48], 48, 2)
    assert at_64.refusal == at_48.refusal == ""
    assert at_64.positions == at_48.positions and at_64.calls == at_48.calls and at_64.kv_heads == at_48.kv_heads
    # K and V of one sample: 2 × 2 kv heads × 64 tokens × 16 dims × 4 bytes; 48/64 of it at 48
    assert at_64.kv_bytes == {f"model.layers.{i}.self_attn": 16384.0 for i in (0, 1)}
    assert {p: b * 48 / 64 for p, b in at_64.kv_bytes.items()} == at_48.kv_bytes
    assert {p: b * 48 / 64 for p, b in at_64.qo_bytes.items()} == at_48.qo_bytes
    graph = autopar.capture(model, ids[64])  # through capture: the graph offers cp
    assert graph.cp_refusal == "" and graph.cp_attention == tuple(at_64.kv_bytes)


def test_nanogpt_with_n_embd_equal_to_block_size_and_the_sequence_is_split() -> None:
    """nanoGPT as written (its ``t <= block_size`` assertion holds at the second, shorter length)."""
    import zoo

    model = zoo.NanoGPT(zoo.NanoConfig(block_size=32, n_embd=32))
    at_32 = context_facts(model, (torch.zeros(2, 32, dtype=torch.long),), {}, 32, 2)
    at_24 = context_facts(model, (torch.zeros(2, 24, dtype=torch.long),), {}, 24, 2)
    assert at_32.refusal == at_24.refusal == "" and at_32.positions == ("transformer.wpe",)
    assert at_32.kv_heads == at_24.kv_heads == {f"transformer.h.{i}.attn": (4,) for i in (0, 1)}
    # kᵀ and v of one sample: 2 × 4 heads × 32 tokens × 8 dims × 4 bytes
    assert at_32.kv_bytes == {p: b * 32 / 24 for p, b in at_24.kv_bytes.items()} == {
        f"transformer.h.{i}.attn": 8192.0 for i in (0, 1)}
    assert at_32.manual["transformer.h.0.attn"] == (((2, 32, 32), "torch.float32"),)


class _Attend(nn.Module):
    """A norm over H (H == S here), causal SDPA over x (b, S, H), then ``mix``."""

    def __init__(self, mix: str) -> None:
        super().__init__()
        self.mix = mix
        self.memory = nn.Parameter(torch.zeros(1, 1, 16, 16))  # a learned memory, 16 slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], 1, x.shape[1], -1)
        if self.mix == "cross":  # keys and values from the memory: 16 long, as long as the sequence at 16
            mem = self.memory.expand(x.shape[0], 1, 16, x.shape[-1])
            return F.scaled_dot_product_attention(q, mem, mem, is_causal=True)[:, 0]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # over H: no token mixing
        q = x.view(x.shape[0], 1, x.shape[1], -1)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)[:, 0]
        if self.mix == "mean":
            return y + y.mean(dim=1, keepdim=True)
        if self.mix == "cumsum":
            return y.cumsum(1)
        if self.mix == "at 16" and x.shape[1] == 16:  # a branch taken at this one length
            return y.cumsum(1)
        return y


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_real_token_mixer_is_refused_when_the_sequence_length_equals_the_hidden_size() -> None:
    x = torch.zeros(2, 16, 16)  # S == H == 16
    assert context_facts(_Wrapped(_Attend("none")), (x,), {}, 16, 2).refusal == ""  # the norm over H alone
    mean = _Wrapped(_Attend("mean"))
    assert context_facts(mean, (x,), {}, 16, 2).refusal == "mean over the sequence dimension in inner"
    # at the second length it is the mean over tokens that is refused (the norm's is over 16, not 8)
    assert context._probe_once(mean, (x[:, :8],), {}, 8, 2, {}).facts.refusal == (
        "mean over the sequence dimension in inner")
    assert context._probe_once(_Wrapped(_Attend("none")), (x[:, :8],), {}, 8, 2, {}).facts.refusal == ""
    # the norm's mean is refused first at 16; at 8, where no size misleads, the cumsum is named
    assert context_facts(_Wrapped(_Attend("cumsum")), (x,), {}, 16, 2).refusal == (
        "cumsum (it mixes tokens along the sequence) in inner (checked again at sequence length 8, a size no "
        "other dimension has)")
    # refused at 16 only, by a branch on the length: not a size coincidence, so it stands
    assert context_facts(_Wrapped(_Attend("at 16")), (x,), {}, 16, 2).refusal == (
        "mean over the sequence dimension in inner")


def test_what_a_size_coincidence_let_through_is_withdrawn() -> None:
    """Attention to a 16-slot memory looks like self-attention at 16 tokens; at 8 it is not."""
    refusal = context_facts(_Wrapped(_Attend("cross")), (torch.zeros(2, 16, 16),), {}, 16, 2).refusal
    assert refusal == (
        "scaled_dot_product_attention over lengths [8, 16], not the sequence 8 (cross-attention) in inner "
        "(checked again at sequence length 8, a size no other dimension has; at 16 a dimension of that size "
        "passed for the sequence)")


def test_the_second_length_is_none_the_first_run_saw_and_keeps_the_power_of_two() -> None:
    assert context._other_length(4096, frozenset({1, 2, 8, 128, 4096, 14336, 32000})) == 2048
    assert context._other_length(64, frozenset({16, 32, 64, 128})) == 48
    assert context._other_length(2, frozenset({2})) is None  # no length below 2: the verdict at S stands
