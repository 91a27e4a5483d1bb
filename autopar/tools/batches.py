"""Synthetic global batches for ``verify``: made from the example inputs as given, targets that fit the output.

The example inputs are the truth about what the model takes: their number,
positional or keyword, shapes, dtypes and value ranges. A batch of any size
is made from them input by input (each named by ``forward``'s argument it
fills, :func:`autopar.inputs.named`):

- batched inputs are the tensors whose dim 0 is the example's batch (the
  first tensor's dim 0, as capture and ``local_batch`` read it); they get
  the global batch along dim 0, the other dims as in the example. Anything
  else (``None``, flags, 0-d tensors, a tensor of another length) goes as
  given, as ``local_batch`` hands it whole to every shard;
- a mask (a name holding "mask": ``attention_mask``, ``decoder_attention_mask``)
  repeats the example's rows, so its padding pattern is kept;
- ``labels`` (integers): random class or token ids below the output's last dim;
- other integer and bool inputs: random values in the example's own range
  [min, max] (a timestep of 0…999 stays there, token ids stay below the
  example's largest + 1). An example of one value only (``torch.zeros``) is a
  placeholder that says nothing of the range: when an ``nn.Embedding`` reads
  it in the probe's forward, values are drawn below that embedding's size,
  else it stays that value;
- float inputs: uniform in the example's range [min, max], in its dtype; an
  example of one value (a placeholder): standard normal.

The targets follow the output of one forward of the example inputs (eval
mode, no gradient, so no running statistic moves): none when the output
carries its own ``.loss``; float targets shaped like the output when it is
shaped like a float input, as a denoiser's or a regression's would be; one
class index per sample for a ``(batch, classes)`` output; a token id per
position for a ``(batch, ..., vocab)`` output whose leading dims are an
integer input's shape (token ids in, a distribution over them out); else
float targets shaped like the output. :func:`loss_line` says which default
loss that makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autopar import inputs as model_inputs
from autopar.errors import AutoparError
from autopar.runtime.loss import pick_loss, prediction


@dataclass(frozen=True)
class Probe:
    """One forward of the example inputs: its ``output``, and for each input an ``nn.Embedding`` read
    (by the name :func:`autopar.inputs.named` gives it), that embedding's size (the smallest, if several)."""

    output: Any
    vocab: dict[str, int]


def probe(model: nn.Module, example_inputs: Any, *, wrap: bool = True) -> Probe:
    """One forward of the example inputs in eval mode without gradients (modes restored after).

    ``wrap``: the model's own failure becomes one line (bad input, in the CLI's process); a verify
    rank passes False so the failure keeps its frame (a finding, reported with its line)."""
    modes = [(m, m.training) for m in model.modules()]
    reads: dict[int, int] = {}  # storage address of a tensor an embedding read → the embedding's size
    hooks = [m.register_forward_pre_hook(_reader(reads)) for m in model.modules() if isinstance(m, nn.Embedding)]
    model.eval()
    try:
        with torch.no_grad():
            output = model_inputs.call(model, example_inputs)
    except Exception as exc:  # noqa: BLE001 - the model's own failure, on one process
        if not wrap:
            raise
        raise AutoparError(f"the model's forward failed on its example inputs "
                           f"({model_inputs.describe(example_inputs)}): {type(exc).__name__}: {exc}") from exc
    finally:
        for hook in hooks:
            hook.remove()
        for m, training in modes:
            m.training = training
    named = model_inputs.named(model, example_inputs)
    vocab = {k: reads[_address(t)] for k, t in named.items() if _address(t) in reads}
    return Probe(output, vocab)


def _address(t: Any) -> int | None:
    """Where a tensor's storage lives (a view of an input shares it), None for no storage to match."""
    if not isinstance(t, torch.Tensor) or t.is_meta or t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


def _reader(reads: dict[int, int]) -> Any:
    def hook(module: nn.Embedding, args: tuple[Any, ...]) -> None:
        where = _address(args[0]) if args else None
        if where is not None:
            reads[where] = min(reads.get(where, module.num_embeddings), module.num_embeddings)
    return hook


def _tiled(ex: torch.Tensor, batch: int) -> torch.Tensor:
    reps = math.ceil(batch / ex.shape[0])
    return ex.repeat(reps, *([1] * (ex.dim() - 1)))[:batch].clone()


def _floats(ex: torch.Tensor, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    lo, hi = float(ex.min()), float(ex.max())
    if lo == hi or not (math.isfinite(lo) and math.isfinite(hi)):  # a placeholder: no range to keep
        return torch.randn(shape, generator=g, dtype=ex.dtype)
    wide = torch.float64 if ex.dtype == torch.float64 else torch.float32
    return (lo + (hi - lo) * torch.rand(shape, generator=g, dtype=wide)).clamp_(lo, hi).to(ex.dtype)


def _integers(ex: torch.Tensor, shape: tuple[int, ...], g: torch.Generator, vocab: int | None) -> torch.Tensor:
    lo, hi = int(ex.min()), int(ex.max())
    if lo == hi and vocab is not None:  # a placeholder an embedding reads: any of its rows
        lo, hi = 0, vocab - 1
    if vocab is not None:
        hi = min(hi, vocab - 1)
    drawn = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64 if ex.dtype == torch.bool else ex.dtype)
    return drawn.to(ex.dtype)


def _one(name: str, ex: Any, batch: int, g: torch.Generator, vocab: int | None, classes: int | None) -> torch.Tensor:
    """The global batch of a batched input ``name`` from its example ``ex``."""
    if "mask" in name.lower() or ex.is_complex() or ex.numel() == 0:
        return _tiled(ex, batch)
    shape = (batch, *ex.shape[1:])
    if ex.is_floating_point():
        return _floats(ex, shape, g)
    if name == "labels" and classes is not None:
        return torch.randint(0, classes, shape, generator=g, dtype=ex.dtype)
    return _integers(ex, shape, g, vocab)


def batch_inputs(model: nn.Module, example_inputs: Any, batch: int, g: torch.Generator,
                 probed: Probe) -> model_inputs.Inputs:
    """Inputs of ``batch`` samples in the form of the example inputs, made from them (module docstring)."""
    n = model_inputs.batch_size(example_inputs)
    pred = prediction(probed.output)
    classes = int(pred.shape[-1]) if pred is not None and pred.dim() > 0 else None
    made = {k: _one(k, v, batch, g, probed.vocab.get(k), classes) if _batched(v, n) else v
            for k, v in model_inputs.named(model, example_inputs).items()}
    return model_inputs.rebuild(example_inputs, made, model)


def _batched(v: Any, n: int | None) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n


def _targets(named: dict[str, Any], output: Any, batch: int, g: torch.Generator) -> torch.Tensor | None:
    """Targets that fit the example's output (module docstring), for ``batch`` samples."""
    pred = prediction(output)
    if isinstance(getattr(output, "loss", None), torch.Tensor) or pred is None:
        return None
    tensors = [t for t in named.values() if isinstance(t, torch.Tensor)]
    like_input = any(t.is_floating_point() and t.shape == pred.shape for t in tensors)
    tokens = any(not t.is_floating_point() and t.shape == pred.shape[:-1] for t in tensors)
    if pred.dim() < 2 or like_input or not (pred.dim() == 2 or tokens):
        return torch.randn((batch, *pred.shape[1:]), generator=g)
    return torch.randint(0, pred.shape[-1], (batch, *pred.shape[1:-1]), generator=g)


def synthetic_batch(model: nn.Module, example_inputs: Any, batch: int, seed: int,
                    probed: Probe | None = None) -> tuple[Any, torch.Tensor | None]:
    """A global batch of ``batch`` samples made from the example inputs, and targets that fit the
    model's output (None when it computes its own loss). ``probed``: the example's :func:`probe`,
    when already at hand."""
    probed = probe(model, example_inputs) if probed is None else probed
    g = torch.Generator().manual_seed(seed)
    x = batch_inputs(model, example_inputs, batch, g, probed)
    return x, _targets(model_inputs.named(model, example_inputs), probed.output, batch, g)


def loss_line(model: nn.Module, example_inputs: Any, loss_name: str | None = None) -> str:
    """``loss: …`` — the loss verify trains both sides with (a user's, or the default's choice)."""
    if loss_name is not None:
        return f"loss: {loss_name} (given with --loss)"
    probed = probe(model, example_inputs)
    _, y = synthetic_batch(model, example_inputs, model_inputs.batch_size(example_inputs) or 1, 0, probed)
    return f"loss: {pick_loss(probed.output, y).name}"


__all__ = ["Probe", "batch_inputs", "loss_line", "probe", "synthetic_batch"]
