"""The single-process shard simulation: what it proves, what it refuses, and that it catches a wrong rewrite.

Capture offers a Megatron style only when simulating the layer's tp shards in
one process (each rank's own forward under the sharding rules, partial sums
added across ranks) matches the unsharded layer in output and gradients.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo

import autopar
from autopar.errors import PinError
from autopar.sharding import check as shard_check
from autopar.sharding.layout import NoShardRule, Sharded, segment_permutation
from autopar.sharding.rules import Reducer, ShardMode, SimulatedRank


def _check(module: nn.Module, x: torch.Tensor, cols, rows, degrees=(4,)):
    gen = torch.Generator().manual_seed(0)
    copy = shard_check.layer_copy(module, gen)
    widths = {c: copy.get_submodule(c).out_features for c in cols}
    inputs = shard_check.real_inputs(((x,), {}))
    return shard_check.check_style(copy, inputs, tuple(cols), tuple(rows), widths,
                                   lambda divs: [t for t in degrees if all(d % t == 0 for d in divs)])


def _nano_attention(flash: bool) -> nn.Module:
    return zoo.NanoCausalSelfAttention(zoo.NanoConfig(n_embd=16, n_head=4, block_size=8, flash=flash))


@pytest.mark.parametrize("flash", [False, True])
def test_nanogpt_attention_is_proved_with_its_fused_qkv_read_from_the_split(flash: bool) -> None:
    result = _check(_nano_attention(flash), torch.randn(2, 8, 16), ["c_attn"], ["c_proj"])
    assert result.ok, result.reason
    assert result.segments == {"c_attn": (16, 16, 16)}  # split(n_embd): three blocks, each split
    assert result.degrees == (2, 4) and 4 in result.divisors  # 4 heads
    assert result.error < 1e-12


def test_a_deliberately_wrong_rewrite_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slicing the fused projection contiguously (ignoring its segments) keeps every shape right and
    every number wrong: only the numerical comparison can see it."""
    def contiguous(self, weight, dim, segments):
        return weight.chunk(self.tp, dim=dim)[self.rank]

    monkeypatch.setattr(SimulatedRank, "column_weight", contiguous)
    result = _check(_nano_attention(False), torch.randn(2, 8, 16), ["c_attn"], ["c_proj"])
    assert not result.ok
    assert "differs from one device" in result.reason and result.error > 1e-3


class _GQAFused(nn.Module):
    """Phi-3's layout: one projection of q (4 heads) then k and v (2 heads each), cut by slicing."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = 4, 2, 4
        self.qkv = nn.Linear(16, (4 + 2 * 2) * 4)
        self.o = nn.Linear(16, 16)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x)
        qp, kvp = self.heads * self.hd, self.kv * self.hd
        q = qkv[..., :qp].view(b, t, -1, self.hd).transpose(1, 2)
        k = qkv[..., qp:qp + kvp].view(b, t, -1, self.hd).transpose(1, 2)
        v = qkv[..., qp + kvp:].view(b, t, -1, self.hd).transpose(1, 2)
        k = k.repeat_interleave(self.heads // self.kv, dim=1)
        v = v.repeat_interleave(self.heads // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_gqa_shaped_fused_qkv_gets_its_unequal_segments_from_the_slices() -> None:
    result = _check(_GQAFused(), torch.randn(2, 6, 16), ["qkv"], ["o"])
    assert result.ok, result.reason
    assert result.segments == {"qkv": (16, 8, 8)}
    assert result.degrees == (2,)  # 2 key/value heads


class _NormOverHeads(nn.Module):
    """QK-norm over the whole query width: a reduction over the sharded dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.o = nn.Linear(16, 16)

    def forward(self, x):
        q = F.layer_norm(self.q(x), (16,))
        return self.o(F.gelu(q))


def test_an_op_that_cannot_run_on_shards_withdraws_the_style_and_names_the_op() -> None:
    result = _check(_NormOverHeads(), torch.randn(2, 6, 16), ["q"], ["o"])
    assert not result.ok
    assert result.reason.startswith("layer_norm: normalises over the sharded dimension")


def test_a_softmax_over_the_sharded_dimension_is_refused() -> None:
    mode = ShardMode(SimulatedRank(2, 0, Reducer(1)))
    with mode:
        x = mode.tag(torch.randn(2, 3, 4), Sharded(2, (8,)))
        with pytest.raises(NoShardRule, match="softmax: normalises over the sharded dimension"):
            x.softmax(dim=-1)
        assert x.shape == (2, 3, 8) and x.size(-1) == 8  # shape queries answer globally
        y = x.view(2, 3, 2, 4)  # global shape in, this rank's share out
        assert tuple(y.shape) == (2, 3, 2, 4) and mode.layout(y) == Sharded(2, (2,))


def test_segment_permutation_puts_each_ranks_pieces_first_in_rank_order() -> None:
    perm = segment_permutation((4, 2, 2), 2)
    assert perm.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


def test_a_tp_pin_on_a_refused_layer_names_the_layer_and_the_op() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_NormOverHeads(), _NormOverHeads()])

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    graph = autopar.capture(Model(), (torch.randn(2, 6, 16),))
    assert "layer_norm" in graph.layer("blocks.0").tp_refusal
    with pytest.raises(PinError, match=r"'blocks\.0'.*layer_norm: normalises over the sharded dimension"):
        autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=2,
                      pins=["tp=2", "pp=1", "blocks.*:tp=megatron"])
    plan = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=2, pins=["pp=1"])
    assert any("blocks.0 … blocks.1 (2): tensor parallelism withdrawn: layer_norm" in n for n in plan.notes)


def test_a_large_meta_layer_is_checked_on_a_narrower_copy_built_from_its_config() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import gpt

    with torch.device("meta"):
        block = gpt.Block(gpt.CONFIGS["gpt3-175b"])
    built = shard_check.small_copy(block, gpt.CONFIGS["gpt3-175b"], torch.Generator().manual_seed(0))
    assert built is not None
    copy, mapping = built
    assert mapping[12288] == 384 and sum(p.numel() for p in copy.parameters()) < 10_000_000  # heads 4 wide
    assert math.isclose(copy.attn.c_attn.weight.std().item(), 384 ** -0.5, rel_tol=0.1)


@pytest.mark.slow
def test_llama3_70b_decoder_layers_are_proved_on_a_copy_built_from_their_config() -> None:
    """Llama 3 70B on meta (856M parameters a decoder layer): its config narrows hidden 8192, MLP 28672
    and head_dim 128 by 32, but not ``num_hidden_layers`` (80, a count though it says "hidden"),
    which used to refuse the copy and withdraw tensor parallelism from every layer."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import hf_llama

    with torch.device("meta"):
        model, inputs = hf_llama.llama3_70b(seq_len=64)
    graph = autopar.capture(model, inputs)
    layer = graph.layer("model.layers.0")
    style = next((s for s in layer.tp_styles if s.name == "megatron"), None)
    assert style is not None, layer.tp_refusal
    assert style.checked == (2, 4, 8)  # 8 key/value heads
    assert "model.layers.0.self_attn.q_proj" in style.column and "model.layers.0.mlp.down_proj" in style.row


def test_a_head_count_that_2_does_not_divide_is_proved_at_the_degrees_that_do() -> None:
    """GPT-2 XL has 25 heads: tp=2 cannot share them, tp=5 can (and is the only degree ≤ 8 offered)."""
    attn = zoo.NanoCausalSelfAttention(zoo.NanoConfig(n_embd=20, n_head=5, block_size=8))
    result = _check(attn, torch.randn(2, 8, 20), ["c_attn"], ["c_proj"], degrees=tuple(range(2, 9)))
    assert result.ok, result.reason
    assert result.degrees == (5,) and result.segments == {"c_attn": (20, 20, 20)}
