"""cp's rewrite of attention written by hand (``passes/manual_attention.py``), in one process: the proof the
lowering runs before any process group starts accepts nanoGPT's attention as its author writes it at
cp = 2, 3, 4 and refuses what the rewrite would get wrong — a sliding-window mask (cut to T × T it is the
causal one when the window covers T, wrong over S), and a mask buffer on the meta device (no values)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.errors import LoweringError
from autopar.passes.manual_attention import prove_manual_attention, prove_one

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zoo  # noqa: E402

PATH = "transformer.h.0.attn"


@pytest.fixture(scope="module")
def nano() -> tuple[torch.nn.Module, autopar.LayerGraph]:
    model, inputs = zoo.NanoGPT(zoo.NanoConfig(block_size=24)), (torch.zeros(2, 24, dtype=torch.long),)
    return model, autopar.capture(model, inputs)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.slow
def test_nanogpt_attention_rewrite_is_proved_against_its_own_forward(nano, cp: int) -> None:
    model, graph = nano
    assert set(graph.cp_manual) == {PATH, "transformer.h.1.attn"}
    prove_manual_attention(model, graph, cp)  # raises where the rewrite differs


@pytest.mark.parametrize("window, what", [(4, "is not the causal mask of its 6 local tokens"),
                                          (8, "differs from the module's own by")])
@pytest.mark.slow
def test_a_sliding_window_mask_is_refused(nano, window: int, what: str) -> None:
    model, graph = nano
    attn = zoo.NanoCausalSelfAttention(zoo.NanoConfig(block_size=24))
    attn.load_state_dict(model.get_submodule(PATH).state_dict())
    ones = torch.ones(24, 24)
    attn.bias.copy_((torch.tril(ones) - torch.tril(ones, -window)).view(1, 1, 24, 24))
    with pytest.raises(LoweringError, match=what):
        prove_one(attn, PATH, graph.cp_manual[PATH], 24, 4)


@pytest.mark.slow
def test_a_mask_buffer_on_the_meta_device_cannot_be_proved(nano) -> None:
    _, graph = nano
    meta = zoo.NanoGPT(zoo.NanoConfig(block_size=24)).to("meta")
    with pytest.raises(LoweringError, match="its buffers \\(its mask\\) are on the meta device"):
        prove_manual_attention(meta, graph, 2)


def test_meta_weights_beside_a_real_mask_are_proved_on_random_weights(nano) -> None:
    _, graph = nano
    attn = zoo.NanoCausalSelfAttention(zoo.NanoConfig(block_size=24))
    for name, p in list(attn.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        setattr(attn.get_submodule(owner), leaf, torch.nn.Parameter(torch.empty_like(p, device="meta")))
    prove_one(attn, PATH, graph.cp_manual[PATH], 24, 2)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.slow
def test_ulysses_rewrite_of_nanogpt_attention_is_proved_against_its_own_forward(nano, cp: int) -> None:
    model, graph = nano  # 4 heads: 2 or 1 a rank, the scores S × S for them
    prove_manual_attention(model, graph, cp, ulysses=True)


def test_ulysses_refuses_a_sliding_window_mask_and_heads_cp_does_not_divide(nano) -> None:
    model, graph = nano
    attn = zoo.NanoCausalSelfAttention(zoo.NanoConfig(block_size=24))
    attn.load_state_dict(model.get_submodule(PATH).state_dict())
    ones = torch.ones(24, 24)
    attn.bias.copy_((torch.tril(ones) - torch.tril(ones, -12)).view(1, 1, 24, 24))  # causal over T = 12, not S
    with pytest.raises(LoweringError, match=r"^cp \(Ulysses\) cannot prove .* differs from .* at cp=2"):
        prove_one(attn, PATH, graph.cp_manual[PATH], 24, 2, ulysses=True)
    with pytest.raises(LoweringError, match="heads divisible by 3"):  # 4 heads over 3 ranks
        prove_one(model.get_submodule(PATH), PATH, graph.cp_manual[PATH], 24, 3, ulysses=True)
