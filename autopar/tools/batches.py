"""Synthetic global batches for ``verify``: shaped like the example inputs, targets that fit the output.

Each input is made from its example, by what it is (named by ``forward``'s
argument it fills, :func:`autopar.inputs.named`):

- a mask (a name holding "mask": ``attention_mask``, ``decoder_attention_mask``)
  repeats the example's rows, so its padding pattern is kept;
- ``labels`` (integers): random class or token ids below the output's last dim;
- other integer inputs: random token ids below the first ``nn.Embedding``'s size;
- float inputs (``pixel_values``, features): standard normal;
- anything without a batch dim (``None``, flags): as given.

The targets follow the output of one forward of the example inputs (eval
mode, no gradient, so no running statistic moves): none when the output
carries its own ``.loss``; float targets shaped like the output when it is
shaped like the (float) input, as a regression's would be; one class index per
sample for a ``(batch, classes)`` output; a token id per position for a
``(batch, ..., vocab)`` output of integer inputs; else float targets shaped
like the output. :func:`loss_line` says which default loss that makes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from autopar import inputs as model_inputs
from autopar.errors import AutoparError
from autopar.runtime.loss import pick_loss, prediction


def probe(model: nn.Module, example_inputs: Any, *, wrap: bool = True) -> Any:
    """One forward of the example inputs in eval mode without gradients (modes restored after).

    ``wrap``: the model's own failure becomes one line (bad input, in the CLI's process); a verify
    rank passes False so the failure keeps its frame (a finding, reported with its line)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return model_inputs.call(model, example_inputs)
    except Exception as exc:  # noqa: BLE001 - the model's own failure, on one process
        if not wrap:
            raise
        raise AutoparError(f"the model's forward failed on its example inputs "
                           f"({model_inputs.describe(example_inputs)}): {type(exc).__name__}: {exc}") from exc
    finally:
        for m, training in modes:
            m.training = training


def _vocab(model: nn.Module) -> int:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise AutoparError("verify makes token ids for integer inputs and needs an nn.Embedding "
                           "to know the vocabulary size")
    return emb.num_embeddings


def _tiled(ex: torch.Tensor, batch: int) -> torch.Tensor:
    reps = math.ceil(batch / ex.shape[0])
    return ex.repeat(reps, *([1] * (ex.dim() - 1)))[:batch].clone()


def _one(name: str, ex: Any, batch: int, g: torch.Generator, model: nn.Module, classes: int | None) -> Any:
    if not isinstance(ex, torch.Tensor) or ex.dim() == 0:
        return ex
    shape = (batch, *ex.shape[1:])
    if "mask" in name.lower() or ex.dtype == torch.bool:
        return _tiled(ex, batch)
    if ex.is_floating_point():
        return torch.randn(shape, generator=g, dtype=ex.dtype)
    high = classes if name == "labels" and classes is not None else _vocab(model)
    return torch.randint(0, high, shape, generator=g, dtype=ex.dtype)


def synthetic_batch(model: nn.Module, example_inputs: Any, batch: int, seed: int,
                    output: Any = None) -> tuple[Any, torch.Tensor | None]:
    """A global batch of ``batch`` samples shaped like the example inputs, and targets that fit the
    model's output (None when it computes its own loss). ``output``: the example's :func:`probe`,
    when already at hand."""
    output = probe(model, example_inputs) if output is None else output
    pred = prediction(output)
    classes = int(pred.shape[-1]) if pred is not None and pred.dim() > 0 else None
    g = torch.Generator().manual_seed(seed)
    named = model_inputs.named(model, example_inputs)
    made = {k: _one(k, v, batch, g, model, classes) for k, v in named.items()}
    x = model_inputs.rebuild(example_inputs, made, model)
    if isinstance(getattr(output, "loss", None), torch.Tensor) or pred is None:
        return x, None
    floats = [t for t in named.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    integers = [t for t in named.values() if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if floats and pred.shape == floats[0].shape or pred.dim() < 2:
        return x, torch.randn((batch, *pred.shape[1:]), generator=g)
    if pred.dim() == 2 or integers:
        return x, torch.randint(0, pred.shape[-1], (batch, *pred.shape[1:-1]), generator=g)
    return x, torch.randn((batch, *pred.shape[1:]), generator=g)


def loss_line(model: nn.Module, example_inputs: Any, loss_name: str | None = None) -> str:
    """``loss: …`` — the loss verify trains both sides with (a user's, or the default's choice)."""
    if loss_name is not None:
        return f"loss: {loss_name} (given with --loss)"
    output = probe(model, example_inputs)
    x, y = synthetic_batch(model, example_inputs, model_inputs.batch_size(example_inputs) or 1, 0, output)
    return f"loss: {pick_loss(output, y).name}"


__all__ = ["loss_line", "probe", "synthetic_batch"]
