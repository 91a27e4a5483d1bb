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


def test_hf_llama_capture_is_linear_in_the_sequence_and_causal():
    small, large = (capture(*_llama(s)) for s in (512, 1024))
    for a, b in zip(_blocks(small), _blocks(large)):
        assert b.input_bytes_per_sample == pytest.approx(2 * a.input_bytes_per_sample)
        assert b.boundary_bytes_per_sample == pytest.approx(2 * a.boundary_bytes_per_sample)
        assert b.activation_bytes_per_sample == pytest.approx(2 * a.activation_bytes_per_sample, rel=0.02)
        attention = [o for o in b.ops if o.kind is OpKind.ATTENTION]
        assert attention and all(o.causal for o in attention)


def test_a_padding_mask_keeps_hugging_face_s_mask():
    """Given ``attention_mask``, eager could not skip the mask either: the S × S mask stays."""
    def masked(seq):
        model, ids = _llama(seq)
        return capture(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    small, large = masked(256), masked(512)
    a, b = _blocks(small)[0], _blocks(large)[0]
    assert b.input_bytes_per_sample > 2.5 * a.input_bytes_per_sample  # linear would be 2×: the S × S mask
    attention = [o for o in b.ops if o.kind is OpKind.ATTENTION]
    assert attention and not any(o.causal for o in attention)


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
