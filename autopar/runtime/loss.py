"""The default loss: chosen from the model's output and the targets, named in one line.

``compile``/``run`` (and ``verify``) train with :func:`default_loss` unless
given a ``loss_fn``. It looks at what the model returned and what the
targets are, and picks the loss that fits (:func:`pick_loss`):

- the model's own loss — a ``ModelOutput`` (or any object) whose ``.loss``
  is a scalar: the model computed it (a Hugging Face model given ``labels``),
  so it is used as is and the targets may be ``None``;
- otherwise the prediction — ``.logits``, else the first tensor of a tuple,
  list or ``ModelOutput``, else the output itself — against the targets:
  integer targets shaped like the prediction less its last dim get
  cross-entropy over that dim (a classifier's ``(batch, classes)`` with one
  class index per sample; a language model's ``(batch, seq, vocab)`` with a
  token id per position, the targets already shifted by the caller); float
  targets shaped like the prediction get mean squared error.

An output carrying a router's auxiliary loss (``.aux_loss``: a Hugging Face
MoE model with ``output_router_logits``) and no ``.loss`` is refused: a loss
on the logits would drop the load-balancing term the model asks for.

Anything else is a :class:`~autopar.errors.LossError`: one line saying what
the output and the targets were and asking for a loss function. The choice
is logged once per process on the ``autopar`` logger (``autopar run`` shows it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from autopar.errors import LossError
from autopar.inputs import prediction  # the model's prediction: what a loss, and capture's head search, read
from autopar.runtime.precision import cast_floating

LOG = logging.getLogger("autopar")
_said: set[str] = set()


@dataclass(frozen=True)
class LossChoice:
    """The loss the default picked: ``name`` is the one line that says so."""

    name: str
    fn: Callable[[Any, torch.Tensor | None], torch.Tensor]


def _own_loss(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _shape(t: Any) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) else \
        type(t).__name__


def _no_fit(output: Any, targets: Any, why: str) -> LossError:
    pred = prediction(output)
    return LossError(f"no default loss fits {why} (output {_shape(output if pred is None else pred)}, targets "
                     f"{_shape(targets)}): pass a loss function (compile's loss_fn=, verify's --loss)")


def _cross_entropy(output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    pred = prediction(output)
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), targets.reshape(-1))


def _mse(output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    return F.mse_loss(prediction(output), targets)


def _model_loss(output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    loss = _own_loss(output)
    if loss is None:
        raise _no_fit(output, targets, "an output without .loss")
    return loss


def pick_loss(output: Any, targets: torch.Tensor | None) -> LossChoice:
    """The default loss for this output and these targets (see the module docstring)."""
    if _own_loss(output) is not None:
        return LossChoice("the model's own loss (output.loss: the model was given its labels)", _model_loss)
    aux = getattr(output, "aux_loss", None)
    if isinstance(aux, torch.Tensor) and aux.dim() == 0:  # its coefficient is the model's (a config field)
        raise LossError("the model's output carries an auxiliary loss (.aux_loss, a router's load-balancing "
                        "term) that a default loss on its logits would drop: give the model its labels so that it "
                        "adds the term itself, or pass a loss function (compile's loss_fn=, verify's --loss)")
    pred = prediction(output)
    if pred is None:
        raise _no_fit(output, targets, f"an output of type {type(output).__name__} with no tensor in it")
    if targets is None:
        raise _no_fit(output, targets, "an output without .loss and no targets")
    if not targets.is_floating_point():
        if pred.dim() >= 2 and tuple(targets.shape) == tuple(pred.shape[:-1]):
            if pred.dim() == 2:
                return LossChoice(f"cross-entropy over {pred.shape[-1]} classes (one class index per sample)",
                                  _cross_entropy)
            return LossChoice(f"cross-entropy over the last dim ({pred.shape[-1]}) at every position "
                              "(a token id per position, targets as given)", _cross_entropy)
        raise _no_fit(output, targets, "integer targets not shaped like the output less its last dim")
    if tuple(targets.shape) == tuple(pred.shape):
        return LossChoice("mean squared error (float targets shaped like the output)", _mse)
    raise _no_fit(output, targets, "float targets not shaped like the output")


def default_loss(output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    """The loss :func:`pick_loss` picks for this output and these targets (the microbatch mean)."""
    choice = pick_loss(output, targets)
    if choice.name not in _said:
        _said.add(choice.name)
        LOG.info("default loss: %s", choice.name)
    return choice.fn(output, targets)


def fp32_loss(loss_fn: Callable[[Any, torch.Tensor | None], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` on the output cast to fp32: a bf16 plan's loss (and its softmax) in full precision."""
    def loss(output: Any, targets: torch.Tensor | None) -> torch.Tensor:
        return loss_fn(cast_floating(output, torch.float32), targets)

    return loss


__all__ = ["LossChoice", "default_loss", "fp32_loss", "pick_loss", "prediction"]
