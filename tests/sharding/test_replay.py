"""Links between blocks found with twins replayed are those a whole meta forward finds (plan speed)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from autopar.sharding import check


def _links(model: nn.Module, paths: list[str], inputs: tuple, replayed: bool,
           monkeypatch: pytest.MonkeyPatch) -> set[str]:
    with monkeypatch.context() as m:
        if not replayed:
            m.setattr(check, "replayed_twins", lambda model, paths: contextlib.nullcontext())
        return check.record_links(model, inputs, {}, paths)


def _counting(cls: type, monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    ran: list[nn.Module] = []
    original = cls.forward

    def forward(self, *a, **k):
        ran.append(self)
        return original(self, *a, **k)
    monkeypatch.setattr(cls, "forward", forward)
    return ran


@pytest.mark.parametrize("cls_name,config_name", [("LlamaForCausalLM", "LlamaConfig"),
                                                  ("Qwen2ForCausalLM", "Qwen2Config")])
def test_replayed_twins_find_the_same_links_running_one_block(cls_name, config_name, monkeypatch):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = getattr(transformers, config_name)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(config)
    paths = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm", "lm_head"]
    inputs = (torch.zeros(2, 8, dtype=torch.long, device="meta"),)
    ran = _counting(type(model.model.layers[0]), monkeypatch)
    whole = _links(model, paths, inputs, False, monkeypatch)
    assert len(ran) == 4 and {f"model.layers.{i}" for i in range(1, 4)} <= whole
    ran.clear()
    assert _links(model, paths, inputs, True, monkeypatch) == whole
    assert ran == [model.model.layers[0]]  # its three twins returned its shapes without running


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(x)


class _Stack(nn.Module):
    """Four twin blocks, with model code that touches the hidden state after block 1."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = x * 2.0
        return x


def test_code_between_replayed_twins_still_breaks_its_link(monkeypatch):
    with torch.device("meta"):
        model = _Stack()
    paths = [f"blocks.{i}" for i in range(4)]
    inputs = (torch.zeros(2, 8, device="meta"),)
    ran = _counting(_Block, monkeypatch)
    assert _links(model, paths, inputs, True, monkeypatch) == {"blocks.1", "blocks.3"}
    assert ran == [model.blocks[0]]
    assert _links(model, paths, inputs, False, monkeypatch) == {"blocks.1", "blocks.3"}


def test_a_watched_module_inside_a_block_keeps_every_block_running(monkeypatch):
    with torch.device("meta"):
        model = _Stack()
    paths = [p for i in range(4) for p in (f"blocks.{i}", f"blocks.{i}.fc")]
    inputs = (torch.zeros(2, 8, device="meta"),)
    ran = _counting(_Block, monkeypatch)
    assert _links(model, paths, inputs, True, monkeypatch) == _links(model, paths, inputs, False, monkeypatch)
    assert len(ran) == 8
