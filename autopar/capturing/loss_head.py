"""Find the model's head for the chunked loss: a plain ``nn.Linear`` whose output is the prediction.

The model runs once on fake copies of the example inputs (no memory, meta weights welcome) with
a forward hook on every module whose type is exactly ``nn.Linear``. The head is the linear whose
output tensor *is* the prediction the default loss reads (:func:`autopar.runtime.loss.prediction`):
nothing computed after it, called once, its weight in the graph's last layer. Otherwise there is no
head, and the one line saying why is kept on the graph (``LayerGraph.loss_refusal``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from autopar.capturing.moe import batched_hf_experts
from autopar.graph import Layer
from autopar.loss_head import LossHead


def find_loss_head(model: nn.Module, args: tuple, kwargs: dict, last: Layer) -> tuple[LossHead | None, str]:
    """The head (and "") or None and why there is none; ``last``: the graph's last layer."""
    calls: dict[int, list[torch.Tensor]] = {}
    linears = {id(m): (path, m) for path, m in model.named_modules() if type(m) is nn.Linear}

    def hook(module: nn.Module, _inputs: Any, output: Any) -> None:
        calls.setdefault(id(module), []).append(output)

    handles = [m.register_forward_hook(hook) for _, m in linears.values()]
    try:
        with batched_hf_experts(model):  # grouped_mm's meta kernel takes bf16 inputs only
            out = _run(model, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - the model's own failure: no chunked loss, said why
        why = f"{type(exc).__name__}: {_first_line(exc)}"
        return None, f"running the model on fake inputs to find its head failed ({why})"
    finally:
        for h in handles:
            h.remove()
    return _head_of(model, out, calls, linears, last)


def _run(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The model's output on meta inputs (a model on meta: 2.5 s faster than fake tensors at 70B) or fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad():
        if all(t.is_meta for t in (*model.parameters(), *model.buffers())):
            return model(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()})
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            def fake(t: Any) -> Any:
                return mode.from_tensor(t) if isinstance(t, torch.Tensor) else t

            return model(*[fake(a) for a in args], **{k: fake(v) for k, v in kwargs.items()})


def _first_line(exc: Exception, width: int = 100) -> str:
    line = (str(exc).strip().splitlines() or [""])[0]
    return line if len(line) <= width else line[: width - 1] + "…"


def _meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _head_of(model: nn.Module, out: Any, calls: dict[int, list[torch.Tensor]],
             linears: dict[int, tuple[str, nn.Module]], last: Layer) -> tuple[LossHead | None, str]:
    from autopar.inputs import prediction

    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return None, "the model computes its own loss (.loss)"
    aux = getattr(out, "aux_loss", None)
    if isinstance(aux, torch.Tensor) and aux.dim() == 0:
        return None, "the model's output carries an auxiliary loss (.aux_loss)"
    pred = prediction(out)
    if pred is None or pred.dim() < 3:  # (batch, classes): small logits, and maybe a regression's output
        return None, "the model's prediction is not per position (batch, positions, classes)"
    found = [key for key, outs in calls.items() if any(o is pred for o in outs)]
    if not found:
        return None, "the prediction is not the output of a plain nn.Linear (something runs after the head)"
    path, module = linears[found[0]]
    if len(calls[found[0]]) != 1:
        return None, f"the head {path} is called {len(calls[found[0]])} times a forward"
    names = {id(p): n for n, p in model.named_parameters()}  # the first name of each (a tied weight's owner's)
    weight = names[id(module.weight)]
    bias = names[id(module.bias)] if module.bias is not None else None
    held = set(last.param_names) | set(last.tied_params)
    if weight not in held and f"{path}.weight" not in held:
        return None, f"the head {path} is not in the last layer ({last.name})"
    tied = weight != f"{path}.weight"
    return LossHead(path, weight, bias, tied, module.in_features, module.out_features), ""


__all__ = ["find_loss_head"]
