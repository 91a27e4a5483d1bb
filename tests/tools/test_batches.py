"""Issue 41, item 6: verify's batches are made from the example inputs as given, not guessed.

A diffusion UNet's example is an image and an integer timestep of 0…999 and
has no ``nn.Embedding``: its batches keep the timestep in the example's range
(verify used to draw "token ids" and refuse a model without an embedding).
A GPT's ids stay in the example's range, below its vocabulary; a placeholder
example of zeros that an embedding reads spreads over the embedding's rows;
bool inputs stay bool.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from verify_specs import opt, unet, unet_keywords

from autopar.tools.batches import loss_line, probe, synthetic_batch
from autopar.tools.spec import load_spec

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


def _in_range(made: torch.Tensor, example: torch.Tensor) -> bool:
    return bool(made.min() >= example.min() and made.max() <= example.max())


def test_a_unets_timestep_stays_in_the_examples_range_positional_and_keyword() -> None:
    for build in (unet, unet_keywords):
        model, inputs = build()
        sample, timestep = inputs if isinstance(inputs, tuple) else (inputs["sample"], inputs["timestep"])
        x, y = synthetic_batch(model, inputs, 8, seed=1)
        made_sample, made_t = x if isinstance(x, tuple) else (x["sample"], x["timestep"])
        assert type(x) is type(inputs) and made_sample.shape == (8, 3, 16, 16) and made_t.shape == (8,)
        assert made_t.dtype == torch.long and _in_range(made_t, timestep) and timestep.max() <= 999
        assert len(made_t.unique()) > 4  # distinct values, not the example's four repeated
        assert made_sample.dtype == torch.float32 and _in_range(made_sample, sample)
        assert not torch.equal(made_sample[:4], sample)
        assert y is not None and y.shape == (8, 3, 16, 16) and y.is_floating_point()  # noise, as a denoiser's
        assert loss_line(model, inputs) == "loss: mean squared error (float targets shaped like the output)"


def test_late_timesteps_stay_late() -> None:
    model, (sample, _) = unet()
    late = torch.tensor([990, 999, 995, 993])
    (_, made_t), _ = synthetic_batch(model, (sample, late), 64, seed=2)
    assert made_t.min() >= 990 and made_t.max() <= 999


def test_a_unet_predicting_more_channels_than_it_takes_regresses_not_classifies() -> None:
    """An output of 6 channels for 3 in (a learned variance beside the noise): not shaped like the image,
    and the timestep (batch,) is no sequence of token ids: float targets, not class ids over its width."""
    model, inputs = unet()
    model.out = nn.Conv2d(8, 6, 3, padding=1)
    _, y = synthetic_batch(model, inputs, 4, seed=1)
    assert y is not None and y.is_floating_point() and y.shape == (4, 6, 16, 16)


def test_a_gpts_token_ids_stay_in_the_examples_range_below_its_vocabulary() -> None:
    model, (idx,) = load_spec(f"{GPT}:gpt_tiny_plain", device="cpu")
    vocab = model.tok_emb.num_embeddings
    few = idx % 10  # real ids from a vocabulary's first ten
    (made,), y = synthetic_batch(model, (few,), 16, seed=1)
    assert made.shape == (16, idx.shape[1]) and _in_range(made, few) and len(made.unique()) == 10
    (made,), _ = synthetic_batch(model, (idx,), 16, seed=1)
    assert made.max() < vocab and _in_range(made, idx)
    assert y is not None and y.dtype == torch.long and y.shape == made.shape and y.max() < vocab  # next tokens


def test_a_placeholder_an_embedding_reads_spreads_over_its_rows() -> None:
    """OPT's example is ``torch.zeros`` ids (a placeholder): the ids drawn cover its 128 rows, the
    attention mask it builds inside is not an input, and its learned positions are not read as ids."""
    model, (ids,) = opt()
    assert probe(model, (ids,)).vocab == {"input_ids": 128}
    (made,), _ = synthetic_batch(model, (ids,), 8, seed=1)
    assert made.min() >= 0 and made.max() < 128 and len(made.unique()) > 64


class Masked(nn.Module):
    """A linear map over positions a bool mask keeps, and an unbatched scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, attention_mask: torch.Tensor,
                scale: float = 1.0, table: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(x * scale) * (keep & attention_mask)[..., None]


def test_bool_inputs_stay_bool_and_unbatched_values_as_given() -> None:
    model = Masked()
    keep = torch.tensor([[True, False, True], [False, True, True]])
    padding = torch.tensor([[True, True, False], [True, False, False]])
    table = torch.arange(5)  # dim 0 is not the batch: handed whole to every shard, so as given
    inputs = {"x": torch.randn(2, 3, 4), "keep": keep, "attention_mask": padding, "scale": 0.5, "table": table}
    x, _ = synthetic_batch(model, inputs, 6, seed=1)
    assert x["keep"].dtype == torch.bool and x["keep"].shape == (6, 3)
    assert x["keep"].any() and not x["keep"].all()
    assert torch.equal(x["attention_mask"], padding.repeat(3, 1))  # a mask keeps the example's rows
    assert x["scale"] == 0.5 and x["table"] is table
