"""Pipeline cases at the cuts other models need (:mod:`distributed`, same protocol as :mod:`pipeline_cases`).

Models the project did not write, built here from small configs: Hugging
Face Qwen2 cut where its rotary ``(cos, sin)`` tuple crosses, Llama and Gemma 3
with tied input/output embeddings cut right after the embedding, and an LSTM language
model cut after the embedding and after the LSTM (whose ``(h, (h_n, c_n))``
output is unpacked in the next layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from equivalence_cases import Spec, equivalence

import autopar

PP2 = ("pp=2", "dp=1", "tp=1", "zero=0", "recompute=none", "microbatches=2", "schedule=1f1b")


def _hf(config: str, model: str, **kw: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = getattr(transformers, config)(vocab_size=128, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, use_cache=False, **kw)
        return getattr(transformers, model)(cfg), (torch.zeros(4, 16, dtype=torch.long),)

    return build


qwen2 = _hf("Qwen2Config", "Qwen2ForCausalLM", tie_word_embeddings=False)
llama_tied = _hf("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True)
# Gemma 3 exports only as inlined ATen ops, which read the tied weight under its last name (lm_head.weight)
gemma3_tied = _hf("Gemma3TextConfig", "Gemma3ForCausalLM", tie_word_embeddings=True, head_dim=16)


class LSTMLM(nn.Module):
    """An LSTM language model as tutorials write it: embedding, a 2-layer LSTM, a linear head."""

    def __init__(self, vocab: int = 128, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(ids))
        return self.head(h)


def lstm() -> tuple[nn.Module, tuple]:
    return LSTMLM(), (torch.zeros(4, 16, dtype=torch.long),)


def stage_pins(names: list[str], last_of_stage_0: str) -> tuple[str, ...]:
    """Stage pins putting ``names`` up to ``last_of_stage_0`` on stage 0, the rest on stage 1."""
    k = names.index(last_of_stage_0)
    return tuple(f"{n}:stage={0 if i <= k else 1}" for i, n in enumerate(names))


class LatePositions(nn.Module):
    """Token embeddings, two blocks, then position embeddings added just before the head: its integer
    ``position_ids`` are read only past the cut."""

    def __init__(self, vocab: int = 128, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.pos = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h + self.pos(position_ids))


def late_positions() -> tuple[nn.Module, dict]:
    ids = torch.zeros(4, 16, dtype=torch.long)
    return LatePositions(), {"input_ids": ids, "position_ids": ids}


def qwen3_labels() -> tuple[nn.Module, dict]:
    """Hugging Face Qwen3 fed ids, a padding mask and its labels (tests/zoo.py): its own loss."""
    from zoo import build

    return build("hf_qwen3_padded")


def t5_labels() -> tuple[nn.Module, dict]:
    """Hugging Face T5 (tests/zoo.py) fed input_ids, decoder_input_ids and labels: one embedding, shared by
    the encoder, the decoder and the head, and the model's own loss."""
    from zoo import build

    model, inputs = build("hf_t5")
    return model, {**inputs, "labels": inputs["input_ids"].clone()}


HF_LAYERS = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
LSTM_LAYERS = ["emb", "lstm", "head"]
LATE_LAYERS = ["emb", "blocks.0", "blocks.1", "pos", "head"]

SPECS: dict[str, Spec] = {
    "qwen2_rotary_cut": Spec(qwen2, PP2 + stage_pins(HF_LAYERS, "model.rotary_emb"), 8),
    "llama_tied_embedding_cut": Spec(llama_tied, PP2 + stage_pins(HF_LAYERS, "model.embed_tokens"), 8),
    "gemma3_tied_embedding_cut": Spec(gemma3_tied, PP2 + stage_pins(HF_LAYERS, "model.embed_tokens"), 8),
    "lstm_cut_after_emb": Spec(lstm, PP2 + stage_pins(LSTM_LAYERS, "emb"), 8),
    "lstm_cut_after_lstm": Spec(lstm, PP2 + stage_pins(LSTM_LAYERS, "lstm"), 8),
    # model inputs read only past the cut cross with their real values: labels (the model's own loss)
    # and integer position ids
    "qwen3_labels_cut": Spec(qwen3_labels, PP2 + stage_pins(HF_LAYERS, "model.layers.0"), 8, synthetic=True),
    # T5: the cut the planner picks, its shared embedding's readers on the first and last stage
    "t5_shared_embedding_pp2": Spec(t5_labels, PP2, 8, synthetic=True),
    "late_positions_cut": Spec(late_positions, PP2 + stage_pins(LATE_LAYERS, "blocks.1"), 8, synthetic=True),
}


def qwen2_compile_trains(rank: int, world_size: int) -> dict[str, Any]:
    """The public API: ``autopar.compile`` of a HF Qwen2 with pp=2 pinned, then three train steps."""
    torch.manual_seed(0)
    model, inputs = qwen2()
    pm = autopar.compile(model, world_size=world_size, example_inputs=inputs, pins=["pp=2"], global_batch=8,
                         cluster="cpu", dtype="fp32")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (8, 16), generator=g)
    losses = [float(pm.train_step(pm.local_batch(x), pm.local_batch(x))) for _ in range(3)]
    return {"losses": losses, "pp": pm.plan.mesh.pp, "stages": pm.plan.stages, "schedule": pm.plan.schedule.value,
            "cut_after": [l.name for l, n in zip(pm.plan.layers, pm.plan.layers[1:]) if l.stage != n.stage]}


class LateBuffer(nn.Module):
    """Block 1 scales by a buffer set only in ``__init__`` from a Python computation (no config,
    no ``reset_parameters``): built on meta, nothing can give it its value."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 128)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 16), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.emb(ids))
        return self.head(self.blocks[1](h) * self.gain)


def _meta(build: Callable[[], tuple[nn.Module, tuple]]) -> tuple[nn.Module, tuple]:
    with torch.device("meta"):
        model, _ = build()
    return model, (torch.zeros(4, 16, dtype=torch.long, device="meta"),)


def meta_qwen2_pipeline(rank: int, world_size: int) -> dict[str, Any]:
    """A meta-built Qwen2 under pp=2: each rank materialises its stage, rotary tables included."""
    model, inputs = _meta(qwen2)
    pm = autopar.compile(model, world_size=world_size, example_inputs=inputs, global_batch=8, cluster="cpu",
                         dtype="fp32", pins=list(PP2) + list(stage_pins(HF_LAYERS, "model.rotary_emb")))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (8, 16), generator=g)
    losses = [float(pm.train_step(pm.local_batch(x), pm.local_batch(x))) for _ in range(3)]
    torch.manual_seed(0)
    real, _ = qwen2()
    want = real.model.rotary_emb.inv_freq
    held = [b for mod in pm.lowered.pipeline.modules for n, b in mod.named_buffers() if n.endswith("inv_freq")]
    return {"losses": losses, "inv_freq_held": len(held),
            "inv_freq_equal": all(torch.equal(b.cpu(), want) for b in held)}


def meta_buffer_refused(rank: int, world_size: int) -> dict[str, Any]:
    """A meta-built model whose stage-1 buffer nothing can set: every rank gets the same error."""
    model, inputs = _meta(lambda: (LateBuffer(), None))
    names = ["emb", "blocks.0", "blocks.1", "head"]
    try:
        autopar.compile(model, world_size=world_size, example_inputs=inputs, global_batch=8, cluster="cpu",
                        dtype="fp32", pins=list(PP2) + list(stage_pins(names, "blocks.0")))
    except autopar.AutoparError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "meta_qwen2_pipeline": meta_qwen2_pipeline,
    "meta_buffer_refused": meta_buffer_refused,
    **{k: equivalence(v) for k, v in SPECS.items()},
    "qwen2_compile_trains": qwen2_compile_trains,
}
