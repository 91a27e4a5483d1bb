"""Hugging Face causal masks captured as eager runs them (autopar/capturing/hf_masks.py).

Under torch.export, Hugging Face builds a boolean S × S causal mask that every
decoder layer reads and a pipeline cut would send; in eager mode it passes SDPA
``is_causal=True`` instead. Capture and the stage trace take eager's answer
when the model is called without positions or a padding mask, so a layer's
inputs and saved activations grow linearly in the sequence.
"""

from __future__ import annotations

import pytest
import torch

from autopar.capturing import trace_layers
from autopar.capturing.trace import capture
from autopar.graph import OpKind

transformers = pytest.importorskip("transformers")


def _llama(seq: int, device: str = "meta"):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=False, use_cache=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model, torch.zeros(1, seq, dtype=torch.long, device=device)


def _blocks(graph):
    return [l for l in graph.layers if l.name.startswith("model.layers.")]


@pytest.mark.slow
def test_hf_llama_capture_is_linear_in_the_sequence_and_causal():
    small, large = (capture(*_llama(s)) for s in (512, 1024))
    for a, b in zip(_blocks(small), _blocks(large)):
        assert b.input_bytes_per_sample == pytest.approx(2 * a.input_bytes_per_sample)
        assert b.boundary_bytes_per_sample == pytest.approx(2 * a.boundary_bytes_per_sample)
        assert b.activation_bytes_per_sample == pytest.approx(2 * a.activation_bytes_per_sample, rel=0.02)
        attention = [o for o in b.ops if o.kind is OpKind.ATTENTION]
        assert attention and all(o.causal and not o.masked for o in attention)


@pytest.mark.slow
def test_a_padding_mask_keeps_hugging_face_s_mask():
    """Given ``attention_mask``, eager could not skip the mask either: the S × S mask stays."""
    def masked(seq):
        model, ids = _llama(seq)
        return capture(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    small, large = masked(256), masked(512)
    a, b = _blocks(small)[0], _blocks(large)[0]
    assert b.input_bytes_per_sample > 2.5 * a.input_bytes_per_sample  # linear would be 2×: the S × S mask
    attention = [o for o in b.ops if o.kind is OpKind.ATTENTION]
    assert attention and not any(o.causal for o in attention) and all(o.masked for o in attention)


@pytest.mark.slow
def test_a_call_with_its_own_mask_is_priced_at_the_masked_rate():
    """CUDA's flash kernel takes no mask: an SDPA call given one runs the memory-efficient kernel there, and
    is priced at that rate (OpModel.masked_attention_fwd/bwd); a CPU's kernels take masks (rate 1)."""
    from dataclasses import replace

    from autopar.cost_models.presets import PRESETS
    from autopar.planning.layer_compute import attention_op_time_s

    model, ids = _llama(256)
    graph = capture(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    op = next(o for o in _blocks(graph)[0].ops if o.kind is OpKind.ATTENTION)
    gpu, cpu = PRESETS["h100-80g"].device, PRESETS["cpu"].device
    fwd, bwd = attention_op_time_s(op, 4, None, 1, gpu, "bf16")
    plain_fwd, plain_bwd = attention_op_time_s(replace(op, masked=False), 4, None, 1, gpu, "bf16")
    overhead = op.count * gpu.op_model.kernel_overhead_s
    assert gpu.op_model.masked_attention_fwd < 1 and gpu.op_model.masked_attention_bwd < 1
    assert fwd - overhead == pytest.approx((plain_fwd - overhead) / gpu.op_model.masked_attention_fwd)
    assert bwd - overhead == pytest.approx((plain_bwd - overhead) / gpu.op_model.masked_attention_bwd)
    assert attention_op_time_s(op, 4, None, 1, cpu, "fp32") == \
        attention_op_time_s(replace(op, masked=False), 4, None, 1, cpu, "fp32")


@pytest.mark.slow
def test_stage_trace_runs_sdpa_causal_and_matches_eager():
    model, ids = _llama(32, device="cpu")
    gm, _, tracer = trace_layers(model, (ids,))
    ids = torch.randint(0, 128, (1, 32))
    out = gm(ids)
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(logits, model(ids).logits)
    masks = [n for n in gm.graph.nodes for v in [n.meta.get("val")]
             if isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() == 4]
    assert not masks, f"{tracer} graph still builds a mask: {[n.name for n in masks]}"


class _MaskedAttention(torch.nn.Module):
    """Hand-written SDPA with an explicit boolean causal mask."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(width, 3 * width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, w)


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_MaskedAttention(), _MaskedAttention()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _saved_on_cpu(module, x) -> int:
    """Bytes autograd saves for ``module(x)`` on CPU, each storage once (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    del out
    return sum(seen.values())


def test_a_boolean_mask_is_saved_as_a_bias_per_call_as_cpu_runs_it():
    torch.manual_seed(0)
    model, x = _Twice(), torch.randn(1, 128, 64, requires_grad=True)
    graph = capture(model, (x,))
    priced = sum(l.activation_bytes_per_sample for l in graph.layers)
    measured = _saved_on_cpu(model, x)
    assert priced == pytest.approx(measured, rel=0.01)
    block = [l for l in graph.layers if l.name == "blocks.1"][0]
    assert block.activation_bytes_per_sample >= 128 * 128 * 4  # the fp32 bias of the 128 × 128 mask


def test_a_mask_passed_by_position_or_keyword_is_recorded():
    """SDPA's ``attn_mask`` is its fourth argument or a keyword; ``is_causal`` alone is no mask."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Attend(nn.Module):
        def __init__(self, how: str) -> None:
            super().__init__()
            self.how, self.proj = how, nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
            if self.how == "position":
                out = F.scaled_dot_product_attention(q, k, v, mask)
            elif self.how == "keyword":
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(1, 2).reshape(x.shape)

    class Net(nn.Module):
        def __init__(self, how: str) -> None:
            super().__init__()
            self.attend = Attend(how)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attend(x).sum()

    x = torch.randn(2, 8, 16)
    for how, masked in (("position", True), ("keyword", True), ("causal", False)):
        ops = [o for layer in capture(Net(how), (x,)).layers for o in layer.ops if o.kind is OpKind.ATTENTION]
        assert ops and all(o.masked is masked for o in ops), how
