"""capture(): layers, costs and tensor-parallel styles of example and Hugging Face models."""

from __future__ import annotations

import importlib.util
import resource
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autopar.capturing import capture
from autopar.errors import CaptureError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    """Import examples/<name>.py (examples are scripts, not a package)."""
    key = f"autopar_examples_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _model_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _costs(layer) -> tuple:
    """A layer's numbers without module paths (``cost_signature`` includes the paths in styles)."""
    styles = tuple(
        (st.name, st.divisors, st.sharded_params, st.sharded_flops_per_sample,
         st.sharded_activation_elems_per_sample, st.fwd_allreduce_elems, st.bwd_allreduce_elems)
        for st in layer.tp_styles
    )
    return (layer.flops_per_sample, layer.param_count, layer.activation_bytes_per_sample,
            layer.input_bytes_per_sample, layer.boundary_bytes_per_sample, styles)


def _dense_fwd_flops(s: int, l: int, h: int, v: int) -> float:
    """Forward third of 72·B·s·l·h²·(1 + s/6h + V/12lh), per sample."""
    return 24 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


# ----------------------------------------------------------------------------- GPT example


@pytest.fixture(scope="module")
def gpt_small_graph():
    model, inputs = _example("gpt").gpt2_small()
    return model, capture(model, inputs)


def test_gpt_tiny_layers_and_costs():
    gpt = _example("gpt")
    model, inputs = gpt.gpt_tiny()
    g = capture(model, inputs)
    assert g.tracer == "fx"
    assert [l.name for l in g] == ["tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1", "ln_f", "lm_head"]
    assert g.seq_len == 32 and g.example_batch == 1 and g.dtype_bytes == 4
    blocks = [l for l in g if l.name.startswith("blocks.")]
    assert _costs(blocks[0]) == _costs(blocks[1])
    assert g.total_params == _model_params(model)
    cfg = gpt.CONFIGS["gpt-tiny"]
    expected = _dense_fwd_flops(cfg.seq_len, cfg.n_layer, cfg.d_model, cfg.vocab_size)
    assert g.total_flops_per_sample == pytest.approx(expected, rel=1e-6)
    assert g.layer("blocks.0").can_cut_after and g.layer("drop").can_cut_after
    # the position arange and embedding carry no batch dim: a pipeline cannot send them
    assert not g.layer("tok_emb").can_cut_after and not g.layer("pos_emb").can_cut_after
    assert not g[-1].can_cut_after and g[-1].boundary_bytes_per_sample == 0
    # one hidden state (T·h fp32) crosses between blocks
    assert g.layer("blocks.0").boundary_bytes_per_sample == cfg.seq_len * cfg.d_model * 4
    assert g.graph.has_edge("blocks.0", "blocks.1")


@pytest.mark.slow
def test_gpt_small_flops_params_and_styles(gpt_small_graph):
    model, g = gpt_small_graph
    cfg = model.config
    names = [l.name for l in g]
    assert names[:3] == ["tok_emb", "pos_emb", "drop"] and names[-2:] == ["ln_f", "lm_head"]
    assert names[3:-2] == [f"blocks.{i}" for i in range(12)]
    expected = _dense_fwd_flops(cfg.seq_len, cfg.n_layer, cfg.d_model, cfg.vocab_size)
    assert g.total_flops_per_sample == pytest.approx(expected, rel=1e-6)
    assert g.total_params == _model_params(model)
    assert len({_costs(l) for l in g if l.name.startswith("blocks.")}) == 1
    assert all(g.layer(f"blocks.{i}").can_cut_after for i in range(12))

    mega = g.layer("blocks.3").tp_style("megatron")
    assert cfg.n_head in mega.divisors and 4 * cfg.d_model in mega.divisors
    assert mega.column == ("blocks.3.attn.c_attn", "blocks.3.mlp.c_fc")
    assert mega.row == ("blocks.3.attn.c_proj", "blocks.3.mlp.c_proj")
    assert mega.segments == {"blocks.3.attn.c_attn": (cfg.d_model,) * 3}  # [q; k; v], read from the split
    assert mega.checked == (2, 3, 4, 6, 12)  # simulated at 2..8, and 12 (beyond a node) by shapes at full size
    h, s = cfg.d_model, cfg.seq_len
    assert mega.fwd_allreduce_count == 2 and mega.fwd_allreduce_elems == 2 * s * h
    assert mega.bwd_allreduce_count == 2 and mega.bwd_allreduce_elems == 2 * s * h
    # everything but the two LayerNorms and the row biases is sharded
    assert mega.sharded_params == g.layer("blocks.3").param_count - 4 * h - 2 * h
    assert mega.admits(6) and not mega.admits(8) and mega.admits(12) and not mega.admits(24)  # 12 heads

    emb = g.layer("tok_emb").tp_style("vocab")
    assert emb.divisors == (cfg.vocab_size,) and emb.fwd_allreduce_elems == s * h
    head = g.layer("lm_head").tp_style("vocab")
    assert head.fwd_allgather_elems == s * cfg.vocab_size and head.bwd_allreduce_elems == s * h
    assert head.sharded_flops_per_sample == pytest.approx(2 * s * h * cfg.vocab_size)


@pytest.mark.slow
def test_gpt3_175b_on_meta_allocates_nothing():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    model, inputs = _example("gpt").gpt3_175b()
    g = capture(model, inputs)
    elapsed = time.perf_counter() - start
    rss_growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert elapsed < 30
    assert abs(g.total_params - 175e9) / 175e9 < 0.02
    assert all(p.is_meta for p in model.parameters())
    assert rss_growth_kib < 1024 * 1024
    assert len(g) == 96 + 5
    assert g.layer("blocks.0").tp_style("megatron").admits(8)


# ----------------------------------------------------------------------------- activations


def test_activation_bytes_match_hand_count_on_cpu():
    """Linear saves its input, GELU its input; Linear weights are parameters (excluded)."""
    torch.manual_seed(0)
    width, batch = 8, 4
    model, (x,) = _example("mlp").mlp(width=width, depth=2, batch=batch, device="cpu")
    g = capture(model, (x,))
    assert [l.name for l in g] == ["0", "1"] and g.tracer == "fx"
    # each block saves its input (fc1), fc1's output (GELU) and GELU's output (fc2), fp32;
    # block 0's output is a fresh storage, first saved by block 1's fc1
    first = (width + 4 * width + 4 * width) * 4
    assert g.layer("0").activation_bytes_per_sample == first
    assert g.layer("1").activation_bytes_per_sample == first
    assert g.layer("0").input_bytes_per_sample == width * 4
    assert g.layer("0").boundary_bytes_per_sample == width * 4
    assert g.total_params == _model_params(model)
    style = g.layer("1").tp_style("megatron")
    assert style.column == ("1.fc1",) and style.row == ("1.fc2",)
    assert style.divisors == (4 * width,)
    # fc1 output and GELU output are sharded; the block input is not
    assert style.sharded_activation_elems_per_sample == 8 * width


def test_storage_saved_twice_is_counted_once():
    """x feeds two linears; it is one storage, counted once."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)

        def forward(self, x):
            return self.a(x) + self.b(x)

    model = nn.Sequential(Two(), Two())
    g = capture(model, torch.randn(3, 6))
    assert g.layer("0").activation_bytes_per_sample == 6 * 4  # only x
    assert g.layer("1").activation_bytes_per_sample == 6 * 4  # only layer 0's output


# ----------------------------------------------------------------------------- other examples


def test_llama_example():
    model, inputs = _example("llama").llama_tiny()
    g = capture(model, inputs)
    assert [l.name for l in g] == ["embed_tokens", "layers.0", "layers.1", "norm", "lm_head"]
    assert g.total_params == _model_params(model)
    mega = g.layer("layers.0").tp_style("megatron")
    assert mega.segments == {} and mega.checked == (2,)  # separate q/k/v; 2 key/value heads
    assert {2, 4, 128} <= set(mega.divisors)
    assert mega.column == ("layers.0.attn.q_proj", "layers.0.attn.k_proj", "layers.0.attn.v_proj",
                           "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj")


def test_convnet_example():
    model, inputs = _example("convnet").resnet18ish(image_size=64, num_classes=10)
    g = capture(model, inputs)
    names = [l.name for l in g]
    for stage in range(1, 5):
        assert f"layer{stage}.0" in names and f"layer{stage}.1" in names
    assert names[-1] == "fc" and g.total_params == _model_params(model)
    blocks = [l for l in g if l.name.startswith("layer")]
    assert all(l.flops_per_sample > 0 and l.activation_bytes_per_sample > 0 for l in blocks)
    assert all(l.can_cut_after for l in blocks)
    assert all(not l.tp_styles for l in g)  # conv layers and a narrow FC head admit nothing


@pytest.mark.slow
def test_mlp_example_meta():
    model, inputs = _example("mlp").mlp()
    g = capture(model, inputs)
    assert len(g) == 8 and all(l.flops_per_sample == 2 * 2 * 1024 * 4096 for l in g)
    assert all(l.tp_style("megatron").fwd_allreduce_count == 1 for l in g)


# ----------------------------------------------------------------------------- Hugging Face


def _hf(kind: str, device: str):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with torch.device(device):
        if kind == "gpt2":
            cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                          use_cache=False)
            model = transformers.GPT2LMHeadModel(cfg)
        elif kind == "llama":
            cfg = transformers.LlamaConfig(
                num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, use_cache=False,
            )
            model = transformers.LlamaForCausalLM(cfg)
        else:
            cfg = transformers.BertConfig(
                num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                vocab_size=128, max_position_embeddings=64,
            )
            model = transformers.BertForMaskedLM(cfg)
        ids = torch.zeros(2, 16, dtype=torch.long)
    return model, ids


HF_BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer"}


@pytest.mark.parametrize(
    "kind,device", [("gpt2", "cpu"), ("llama", "cpu"), ("bert", "cpu"), ("gpt2", "meta"), ("llama", "meta")]
)
@pytest.mark.slow
def test_hugging_face_models(kind, device):
    model, ids = _hf(kind, device)
    g = capture(model, {"input_ids": ids})
    assert g.tracer == "export-layers"  # the layers stay module calls (pipeline stages call them)
    assert g.example_batch == 2 and g.seq_len == 16
    prefix = HF_BLOCKS[kind]
    b0, b1 = g.layer(f"{prefix}.0"), g.layer(f"{prefix}.1")
    assert g.total_params == _model_params(model)
    assert g.total_flops_per_sample > 0 and b0.flops_per_sample == b1.flops_per_sample > 0
    # GPT-2 and BERT tie the output head to the embedding: a pipeline's first and last stage both hold it
    tied = kind in ("gpt2", "bert") and model.config.tie_word_embeddings
    assert b0.can_cut_after
    if tied:
        assert g[len(g) - 1].tied_borrowed and g[len(g) - 1].tied_params
    mega = b0.tp_style("megatron")  # GPT-2's Conv1D (weight stored in × out) is split too
    assert 4 in mega.divisors and mega.fwd_allreduce_count == 2
    if kind == "llama":
        assert 2 in mega.divisors and mega.checked == (2,)  # 2 key/value heads: tp=2 only
    if kind == "gpt2":
        assert mega.segments == {f"{prefix}.0.attn.c_attn": (64, 64, 64)}
    if kind == "gpt2":
        assert g.layer("transformer.wte").tp_style("vocab").divisors == (128,)
        assert g.layer("lm_head").param_count == 0  # tied to transformer.wte.weight
    if device == "meta":
        assert all(p.is_meta for p in model.parameters())


# ----------------------------------------------------------------------------- twin replay


def _hf_gpt2_3_layers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64, use_cache=False)
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.zeros(2, 16, dtype=torch.long)
    return model, {"input_ids": ids}


class _SavesItsOutput(nn.Module):
    """Ends in a ReLU (saves its output, the next block's input); an in-place ReLU on its input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(torch.relu_(x * 1.0)))


def _relu_chain():
    with torch.device("meta"):
        return nn.Sequential(*[_SavesItsOutput() for _ in range(5)]), (torch.zeros(3, 8),)


TWIN_CASES = {
    "relu-chain": (_relu_chain, 3),
    "gpt-6": (lambda: _example("gpt").gpt(n_layer=6, d_model=64, n_head=4, vocab_size=128, seq_len=32), 5),
    "gpt-6-cpu": (lambda: _example("gpt").gpt(n_layer=6, d_model=64, n_head=4, vocab_size=128, seq_len=32,
                                              device="cpu"), 0),
    "llama-6": (lambda: _example("llama").build(_example("llama").LlamaConfig(128, 32, 6, 64, 128, 4, 2)), 5),
    "mlp": (lambda: _example("mlp").mlp(width=256), 6),  # twins do not depend on width: 1024's simulation is slow
    "hf-gpt2-3": (_hf_gpt2_3_layers, 2),
}


@pytest.mark.parametrize("case", sorted(TWIN_CASES))
@pytest.mark.slow
def test_twin_replay_matches_full_execution(case, monkeypatch):
    """Replaying twin layers gives exactly what executing every layer gives, and does replay."""
    from autopar.capturing import twins

    build, expected_replays = TWIN_CASES[case]
    model, inputs = build()
    full = capture(model, inputs, replay_twins=False)
    replays = []
    real_replay = twins.replay

    def counting_replay(*args):
        values = real_replay(*args)
        replays.append(args[1])
        return values

    monkeypatch.setattr(twins, "replay", counting_replay)
    fast = capture(model, inputs)
    assert len(replays) == expected_replays
    assert fast.fingerprint() == full.fingerprint()
    assert fast.to_dict() == full.to_dict()
    for a, b in zip(fast, full):
        assert a == b  # every Layer field, styles included


# ----------------------------------------------------------------------------- failures


class Untraceable(nn.Module):
    """Python control flow on a tensor's value: FX cannot trace it, export cannot guard it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        n = int(torch.nonzero(x > 0).shape[0])
        if n % 3 == 1:
            return self.lin(x)
        return self.lin(x) * 2


def test_untraceable_model_raises_capture_error():
    with pytest.raises(CaptureError, match="Untraceable") as info:
        capture(Untraceable(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "symbolic_trace" in message and "export" in message and "\n" not in message
