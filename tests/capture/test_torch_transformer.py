"""PyTorch's own ``nn.TransformerEncoder`` captured as a training step runs it, each of its layers a layer.

A language model on ``nn.TransformerEncoder`` (tests/zoo.py ``TorchEncoderLM``, written as PyTorch's
tutorials write one) is captured on the meta device in train and eval mode, with the causal mask
given alone (the encoder detects it from its values) or with ``is_causal=True``: its blocks are layers
of their own, attention is traced as training runs it (SDPA with ``is_causal`` and no mask), the
captured graph computes what the model computes, and torch's switches are as they were afterwards.
A mask of the user's own given without ``is_causal`` is refused in one line saying what to pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zoo import SEQ, VOCAB, TorchEncoderLM

import autopar
from autopar.capturing import trace_layers
from autopar.errors import CaptureError

IDS = torch.zeros(2, SEQ, dtype=torch.long)
GENERATE = nn.Transformer.__dict__["generate_square_subsequent_mask"]


@pytest.mark.parametrize("say_causal", [False, True])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.slow
def test_encoder_layers_are_layers_on_meta_in_either_mode(say_causal: bool, train: bool) -> None:
    with torch.device("meta"):
        model = TorchEncoderLM(say_causal=say_causal)
    model.train(train)
    graph = autopar.capture(model, (IDS.to("meta"),))
    names = [layer.name for layer in graph]
    assert {"encoder.layers.0", "encoder.layers.1", "head"} <= set(names), names
    blocks = [layer for layer in graph if layer.name.startswith("encoder.layers.")]
    assert all(b.param_count == blocks[0].param_count and b.flops_per_sample > 0 for b in blocks)
    assert torch.backends.mha.get_fastpath_enabled()  # put back
    assert nn.Transformer.__dict__["generate_square_subsequent_mask"] is GENERATE


@pytest.mark.parametrize("say_causal", [False, True])
@pytest.mark.slow
def test_attention_is_traced_as_training_runs_it_and_computes_the_same(say_causal: bool) -> None:
    torch.manual_seed(0)
    model = TorchEncoderLM(say_causal=say_causal)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    gm, _, tracer = trace_layers(model, (ids,))
    assert tracer == "export"  # the causal mask the layers are called with is dropped: stages keep ATen ops
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(sdpa) == 2
    assert all(n.args[3] is None and n.args[5] is True for n in sdpa)  # no S × S mask, is_causal
    out = gm(ids)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(ids))


class OwnMask(nn.Module):
    """An encoder given a causal mask built by hand, without ``is_causal``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                             enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), diagonal=1)
        return self.encoder(x, mask=mask)


def test_a_hand_made_mask_without_is_causal_is_refused_with_what_to_pass() -> None:
    with pytest.raises(CaptureError, match="pass is_causal=True"):
        autopar.capture(OwnMask(), (torch.zeros(2, 8, 16),))
    assert torch.backends.mha.get_fastpath_enabled()


def test_decoder_layers_are_one_layer_each_and_other_stacks_keep_their_layering() -> None:
    """``nn.TransformerDecoderLayer`` holds two ``nn.MultiheadAttention`` (self and cross): it is still one
    layer (both attentions and its MLP), which admits Megatron; blocks whose other repeated children open
    them keep their layering (MLP-Mixer's token- and channel-mixing MLPs, Swin's stages)."""
    import transformers
    from outside_matrix_cases import torch_seq2seq
    from zoo import build

    from autopar.capturing.layers import expanded_paths

    torch.manual_seed(0)
    model, ids = torch_seq2seq()
    assert expanded_paths(model) == {"", "encoder", "encoder.layers", "decoder", "decoder.layers"}
    graph = autopar.capture(model, ids)
    for name in ("decoder.layers.0", "decoder.layers.1"):
        style = next(s for s in graph.layer(name).tp_styles if s.name == "megatron")
        assert style.column == (f"{name}.linear1",) and style.row == (f"{name}.linear2",)
    assert not any(layer.name.startswith("decoder.layers.0.") for layer in graph)
    # their attentions compute through F.multi_head_attention_forward: left whole under tp, and the plan says so
    plan = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4,
                         pins=["pp=1", "dp=1", "tp=2", "encoder.layers.*:tp=megatron", "decoder.layers.*:tp=megatron"])
    whole = [n for n in plan.notes if "runs whole on every tp rank" in n]
    assert [n.split(":", 1)[0] for n in whole] == ["encoder.layers.0 … encoder.layers.1 (2)",
                                                   "decoder.layers.0 … decoder.layers.1 (2)"], plan.notes
    assert "(self_attn, multihead_attn: nn.MultiheadAttention)" in whole[1]
    assert style.sharded_params == sum(p.numel() for n, p in model.named_parameters()
                                       if n.startswith("decoder.layers.1.linear") and not n.endswith("2.bias"))
    assert expanded_paths(build("mlp_mixer")[0]) == {"", "blocks", "blocks.0", "blocks.1"}
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                  window_size=2)
    assert expanded_paths(transformers.SwinModel(cfg)) == {
        "", "encoder", "encoder.layers", "encoder.layers.0", "encoder.layers.0.blocks", "encoder.layers.1",
        "encoder.layers.1.blocks"}
