"""Tensor parallelism proved at any size: a narrower copy of a config-less layer, a shape proof at the real size.

A layer too big to simulate and without a config is proved numerically on a
narrower copy of its own class, which must run the very same program with its
widths renamed, and by shapes at its real size at every degree offered. These
tests try to break that: layers whose code is right only at small widths or
short sequences must be refused, naming the op, never offered.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import PinError
from autopar.sharding import check as shard_check
from autopar.sharding import narrow, shapes
from autopar.sharding.layout import NoShardRule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import plain_gpt  # noqa: E402


class _Attention(nn.Module):
    """Plain attention whose head width, when ``capped``, is ``min(c // heads, 64)``: a literal
    width in the code, which a narrower copy cannot rename."""

    def __init__(self, width: int, heads: int, capped: bool = False):
        super().__init__()
        self.heads, self.capped = heads, capped
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        hd = min(c // self.heads, 64) if self.capped else c // self.heads
        q, k, v = (z.reshape(b, t, -1, hd).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class _LongSequenceShortcut(nn.Module):
    """Attention that, past 64 positions, averages its heads (a reduction over the sharded head
    dimension): exact on the short sequence a copy is simulated at, wrong only at the real length."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if t > 64:
            y = y.mean(dim=1, keepdim=True).expand_as(y)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class _TokenModel(nn.Module):
    """Token ids in (so capture knows the sequence), blocks with residuals, a head."""

    def __init__(self, blocks: list[nn.Module], width: int):
        super().__init__()
        self.tok = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class _Model(nn.Module):
    def __init__(self, blocks: list[nn.Module], width: int):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _capture_meta(make, seq: int, width: int, limit: int | None = None,
                  monkeypatch: pytest.MonkeyPatch | None = None) -> autopar.LayerGraph:
    if limit is not None and monkeypatch is not None:
        monkeypatch.setattr(shard_check, "MAX_CHECK_PARAMS", limit)
    with torch.device("meta"):
        model, x = make(), torch.randn(2, seq, width)
    return autopar.capture(model, (x,))


def _megatron(graph, name):
    return next((s for s in graph.layer(name).tp_styles if s.name == "megatron"), None)


def test_a_head_width_that_does_not_scale_with_the_layer_is_refused_naming_the_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``min(c // heads, 64)``: at 3072 wide, 24 heads become 48 of 64 because of the literal 64, which
    a narrower copy keeps: the copy would run another program than the layer, so nothing is offered.
    (Read from an attribute, the cap is renamed with the widths and the copy is the same program.)"""
    graph = _capture_meta(lambda: _Model([_Attention(3072, 24, capped=True) for _ in range(2)], 3072), 32, 3072,
                          limit=1_000_000, monkeypatch=monkeypatch)
    refusal = graph.layer("blocks.0").tp_refusal
    assert _megatron(graph, "blocks.0") is None
    assert "no narrower copy of it runs the same program" in refusal and "reshape" in refusal, refusal


@pytest.mark.slow
def test_code_that_changes_at_the_real_sequence_is_refused_at_the_real_size() -> None:
    """Simulated on a short sequence the layer is exact; at its real 128 positions it averages
    over the sharded heads: the shape proof at the real size withdraws the style, naming the op."""
    with torch.device("meta"):
        model = _TokenModel([_LongSequenceShortcut(64, 4) for _ in range(2)], 64)
        idx = torch.zeros(2, 128, dtype=torch.long)
    graph = autopar.capture(model, (idx,))
    refusal = graph.layer("blocks.0").tp_refusal
    assert _megatron(graph, "blocks.0") is None
    # the mean over the sharded heads is all-reduced (a statistic); spreading it back over every
    # head (expand_as a sharded share) has no exact rule: that op is named
    assert "expand_as" in refusal and "at the layer's real size" in refusal and "tp=2" in refusal, refusal


@pytest.mark.slow
def test_a_plain_gpt_block_of_100m_parameters_is_proved_at_degrees_beyond_a_node() -> None:
    """No config, 113M parameters a block, on meta: proved on a narrower copy of its own class
    and by shapes at full size, at every degree its 32 heads admit, in seconds."""
    start = time.perf_counter()
    with torch.device("meta"):
        model = plain_gpt.GPT(vocab=512, width=3072, heads=32, layers=2, seq=128)
        idx = torch.zeros(1, 128, dtype=torch.long)
    assert sum(p.numel() for p in model.blocks[0].parameters()) > 100_000_000
    graph = autopar.capture(model, (idx,))
    elapsed = time.perf_counter() - start
    style = _megatron(graph, "blocks.0")
    assert style is not None, graph.layer("blocks.0").tp_refusal
    assert style.checked == (2, 4, 8, 16, 32)
    assert style.segments["blocks.0.attn.qkv"] == (3072, 3072, 3072)  # the real size's segments
    assert style.admits(32) and not style.admits(64)
    assert style.sequence == (2, 4, 8, 16, 32)  # sequence parallel too: simulated to 8, by shapes beyond
    assert elapsed < 60, elapsed  # seconds on a busy 2-core machine (float64 simulation of 113M: minutes)


@pytest.mark.slow
def test_heads_that_only_some_degrees_divide_are_offered_at_those() -> None:
    """25 heads of 64 (GPT-2 XL's shape): the copy keeps 25 heads, so tp=2, 4, 8 are never offered;
    5 and 25 are, the latter beyond a node."""
    with torch.device("meta"):
        block = plain_gpt.Block(1600, 25)
    rec = ((torch.empty(1, 32, 1600, device="meta"),), {})
    copy = narrow.narrow_copy(block, rec, 1, 32)
    assert copy.heads == (25,) and copy.sizes[64] == 64 // copy.factor and copy.sizes[1600] == 25 * (64 // copy.factor)
    graph = _capture_meta(lambda: _Model([plain_gpt.Block(1600, 25) for _ in range(2)], 1600), 32, 1600)
    style = _megatron(graph, "blocks.0")
    assert style is not None and style.checked == (5, 25)


def test_the_shape_proof_names_the_op_a_degree_does_not_divide_at_the_real_size() -> None:
    with torch.device("meta"):
        block = plain_gpt.Block(1600, 25)
    inputs = shapes.meta_inputs(((torch.empty(1, 32, 1600, device="meta"),), {}))
    segs = {"attn.qkv": (1600, 1600, 1600)}
    assert 25 in shapes.prove_shapes(narrow.meta_module(block), inputs, ("attn.qkv", "fc"), ("attn.out", "proj"),
                                     segs, 5)
    with pytest.raises(NoShardRule, match="reshape: .*tp=2 cannot share exactly"):
        shapes.prove_shapes(narrow.meta_module(block), inputs, ("attn.qkv", "fc"), ("attn.out", "proj"), segs, 2)


def test_a_narrowed_size_that_reads_as_another_size_is_never_used() -> None:
    """4 heads of 16 at a 16-position sequence: narrowing 16 would read as the sequence; the copy is
    traced at another probe length so every size keeps one role."""
    with torch.device("meta"):
        block = plain_gpt.Block(64, 4)
    copy = narrow.narrow_copy(block, ((torch.empty(2, 16, 64, device="meta"),), {}), 2, 16)
    assert copy.inputs[0][0].shape[1] != 16 and copy.factor > 1


def test_a_tp_pin_on_a_refused_layer_is_one_line_naming_the_layer_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = _capture_meta(lambda: _Model([_Attention(3072, 24, capped=True) for _ in range(2)], 3072), 32, 3072,
                          limit=1_000_000, monkeypatch=monkeypatch)
    with pytest.raises(PinError) as err:
        autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=2,
                      pins=["tp=2", "pp=1", "blocks.*:tp=megatron"])
    message = str(err.value)
    assert "\n" not in message and "'blocks.0'" in message and "reshape" in message, message


def test_an_lm_head_onto_the_vocabulary_is_vocab_parallel_however_narrow() -> None:
    """GPT-3's head maps 12,288 features onto 51,200 tokens (under 8x): still an LM head, since its
    width is the embedding's vocabulary."""
    with torch.device("meta"):
        model = plain_gpt.GPT(vocab=512, width=128, heads=4, layers=1, seq=16)
        idx = torch.zeros(1, 16, dtype=torch.long)
    graph = autopar.capture(model, (idx,))
    head = next(l for l in graph if l.module_path == "head" or l.name.endswith("head"))
    assert any(s.name == "vocab" for s in head.tp_styles)


@pytest.mark.slow
def test_a_head_count_equal_to_the_head_width_is_narrowed_with_it() -> None:
    """Megatron's 310B row: 128 heads of 128 (16,384 wide), no config. The size 128 has two roles,
    so both are narrowed alike (128 heads of 128 → 8 of 8, one map for every integer): the copy is
    the same program renamed, simulated at 2, 4, 8 and proved by shapes at the real size beyond."""
    with torch.device("meta"):
        model = plain_gpt.GPT(vocab=512, width=16384, heads=128, layers=1, seq=64)
        idx = torch.zeros(1, 64, dtype=torch.long)
    graph = autopar.capture(model, (idx,))
    style = _megatron(graph, "blocks.0")
    assert style is not None, graph.layer("blocks.0").tp_refusal
    assert style.checked == (2, 4, 8, 16, 32, 64, 128)
    assert style.segments["blocks.0.attn.qkv"] == (16384, 16384, 16384)


@pytest.mark.slow
def test_heads_narrowed_with_their_width_keep_the_degrees_they_admit(monkeypatch: pytest.MonkeyPatch) -> None:
    """24 heads of 24 (576 wide): narrowing 24 to 12 or 6 would drop tp=3 or 8 from the degrees it
    admits, and 4 heads of 4 are too thin, so the only map is the identity: refused, saying why."""
    with torch.device("meta"):
        block = plain_gpt.Block(576, 24)
    with pytest.raises(narrow.NarrowRefused, match="both a width and a head count"):
        narrow.narrow_copy(block, ((torch.empty(1, 32, 576, device="meta"),), {}), 1, 32)
    graph = _capture_meta(lambda: _Model([plain_gpt.Block(1024, 32) for _ in range(2)], 1024), 32, 1024,
                          limit=1_000_000, monkeypatch=monkeypatch)
    style = _megatron(graph, "blocks.0")  # 32 heads of 32: narrowed to 8 of 8, proved up to 32
    assert style is not None, graph.layer("blocks.0").tp_refusal
    assert style.checked == (2, 4, 8, 16, 32)
