"""Sharding rules for code people write (issue 41 item 3): complex rotary embeddings, a replicated
per-head tensor joined to sharded scores, and a size with two roles; each proved (or refused naming the
op) in one process. Their tp=2 parity against one device is :mod:`test_tp_rules`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from meta_models import ModelArgs, Transformer, meta_llama

import autopar

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import plain_gpt  # noqa: E402


def _megatron(graph: autopar.LayerGraph, name: str):
    return next((s for s in graph.layer(name).tp_styles if s.name == "megatron"), None)


@pytest.mark.slow
def test_meta_llama_rotary_through_view_as_complex_is_proved_and_its_model_left_as_it_was() -> None:
    model, x = meta_llama(n_kv_heads=2)
    graph = autopar.capture(model, x)
    for name in ("layers.0", "layers.1"):
        style = _megatron(graph, name)
        assert style is not None, graph.layer(name).tp_refusal
        assert set(style.row) == {f"{name}.attention.wo", f"{name}.feed_forward.w2"}
    # its forward stores ``self.freqs_cis``: the tracer that failed on it left the tensor, not a Proxy
    assert isinstance(model.freqs_cis, torch.Tensor) and model.freqs_cis.is_complex()


class _PairsAcrossRanks(nn.Module):
    """Complex numbers paired across the sharded features: no rank holds whole pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.up(x).view(b, t, 2, 8).transpose(-1, -2).contiguous()
        h = torch.view_as_real(torch.view_as_complex(h) * 1j).transpose(-1, -2).reshape(b, t, 16)
        return self.down(h)


class _Sink(nn.Module):
    """Attention with a replicated tensor joined to the scores: a learned per-head sink (gpt-oss), or
    one joined along the heads (no share of it belongs to a rank)."""

    def __init__(self, along_heads: bool) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.sinks = nn.Parameter(torch.randn(4))
        self.along_heads = along_heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.qkv(x).split(c, dim=-1))
        scores = q @ k.transpose(-1, -2)
        if self.along_heads:
            scores = torch.cat([scores, scores.new_zeros(b, 1, t, t)], dim=1)[:, :4]
            return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))
        sink = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1)[..., :-1]
        return self.out((probs @ v).transpose(1, 2).reshape(b, t, c))


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize(("blocks", "refused"), [
    ([_Sink(False), _Sink(False)], ""),
    ([_Sink(True), _Sink(True)], "cat: joins sharded and replicated activations along the sharded dimension"),
    ([_PairsAcrossRanks(), _PairsAcrossRanks()], "view_as_complex: pairs the sharded dimension"),
])
@pytest.mark.slow
def test_a_replicated_join_or_a_complex_view_is_proved_where_each_rank_holds_whole_pieces(blocks, refused) -> None:
    torch.manual_seed(0)
    width = 8 if isinstance(blocks[0], _PairsAcrossRanks) else 16
    graph = autopar.capture(_Stack(blocks), (torch.randn(2, 8, width),))
    style = _megatron(graph, "blocks.0")
    if not refused:
        assert style is not None, graph.layer("blocks.0").tp_refusal
    else:
        assert style is None and refused in graph.layer("blocks.0").tp_refusal, graph.layer("blocks.0").tp_refusal


@pytest.mark.parametrize("build", ["gpt", "meta_llama"])
@pytest.mark.slow
def test_a_sequence_as_long_as_the_width_is_told_apart_by_a_second_length(build: str) -> None:
    """Llama-2-7B's shape (4,096 wide, trained at 4,096 positions): the size has two roles in the
    example, one in the inputs recorded at a shorter length, so the narrower copy is built from those."""
    with torch.device("meta"):
        if build == "gpt":
            model = plain_gpt.GPT(vocab=512, width=4096, heads=32, layers=2, seq=4096)
        else:
            model = Transformer(ModelArgs(dim=4096, n_layers=2, n_heads=32, vocab_size=512, multiple_of=256,
                                          max_seq_len=4096))
        idx = torch.zeros(2, 4096, dtype=torch.long)
    graph = autopar.capture(model, (idx,))
    name = "blocks.0" if build == "gpt" else "layers.0"
    style = _megatron(graph, name)
    assert style is not None, graph.layer(name).tp_refusal
    assert style.checked == (2, 4, 8, 16, 32)


@pytest.mark.slow
def test_mamba_mixers_split_on_their_channels_and_a_convolution_across_channels_is_refused() -> None:
    """Hugging Face's Mamba (slow path, as on CPU): in_proj column, out_proj row, the per-channel conv1d,
    dt_proj, A_log and D split with them (priced as sharded), x_proj's partial sums all-reduced inside the
    group (priced: its dt, B, C per token, forward; their gradient sums backward). A grouped convolution
    whose groups hold several channels reads other ranks' channels: refused, naming conv1d."""
    import zoo

    from autopar.sharding.channel_ops import channel_params

    torch.manual_seed(0)
    model, ids = zoo.build("hf_mamba")
    graph = autopar.capture(model, ids)
    mixer = model.backbone.layers[0].mixer
    width = mixer.time_step_rank + 2 * mixer.ssm_state_size
    for name in ("backbone.layers.0", "backbone.layers.1"):
        style = _megatron(graph, name)
        assert style is not None, graph.layer(name).tp_refusal
        assert style.column == (f"{name}.mixer.in_proj",) and style.row == (f"{name}.mixer.out_proj",)
        assert style.fwd_allreduce_count == 2 and style.fwd_allreduce_elems == ids[0].shape[1] * (32 + width)
        assert style.bwd_allreduce_count > 2 and style.bwd_allreduce_elems > style.fwd_allreduce_elems
    shared = channel_params(model.backbone.layers[0], ("mixer.in_proj",), ("mixer.out_proj",))["mixer.in_proj"]
    assert set(shared) == {f"mixer.{p}" for p in ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias",
                                                  "A_log", "D")}
    split = sum(p.numel() for n, p in mixer.named_parameters() if not n.startswith("x_proj"))
    assert _megatron(graph, "backbone.layers.0").sharded_params == split

    class Grouped(nn.Module):  # a conv of two channels per group between a column and a row
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
            self.conv = nn.Conv1d(16, 16, 3, padding=1, groups=8)

        def forward(self, x):
            return self.down(self.conv(self.up(x).transpose(1, 2)).transpose(1, 2))

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Grouped(), Grouped()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    graph = autopar.capture(Wrap(), (torch.randn(2, 6, 8),))
    assert "conv1d: not depthwise" in graph.layer("blocks.0").tp_refusal
