"""A model's inputs: one tensor, a tuple of positional inputs, or a dict of keyword inputs.

Everything that feeds a model — capture, pricing, ``verify``, ``compile``'s
``train_step`` and ``local_batch`` — takes the same three forms and treats
them alike here: normalised to a tuple (positional) or a dict (keyword),
matched to ``forward``'s signature once (an input that fits no argument is
one line naming it, :class:`~autopar.errors.InputsError`), split into
data-parallel shards and microbatches along dim 0.

Which values are *batched*: tensors with a dim 0 as long as the batch (the
first tensor's). Anything else (``None``, flags, a tensor of another length)
goes whole to every shard and microbatch.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import torch
import torch.nn as nn

from autopar.errors import InputsError

Inputs = tuple[Any, ...] | dict[str, Any]


def normalise(inputs: Any) -> Inputs:
    """A tensor as a 1-tuple, a list as a tuple, a dict as a dict (a copy)."""
    if isinstance(inputs, dict):
        return dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    return (inputs,)


def split(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``forward``."""
    inputs = normalise(inputs)
    return ((), inputs) if isinstance(inputs, dict) else (inputs, {})


def call(module: nn.Module, inputs: Any) -> Any:
    """``module`` applied to the inputs, positional or keyword."""
    args, kwargs = split(inputs)
    return module(*args, **kwargs)


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a C forward: nothing to check against
        return None


def _open_keywords(params: Any) -> bool:
    """Whether ``**kwargs`` takes any name: not when annotated ``Unpack[SomeTypedDict]`` (Hugging Face's
    ``**kwargs: Unpack[TransformersKwargs]``), whose keys are then the only extra names it takes."""
    var = next((p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var is None:
        return False
    args = typing.get_args(var.annotation)
    typed = args[0] if typing.get_origin(var.annotation) is typing.Unpack and args else None
    return not (isinstance(typed, type) and hasattr(typed, "__optional_keys__"))


def _typed_keywords(params: Any) -> frozenset[str]:
    var = next((p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    args = typing.get_args(var.annotation) if var is not None else ()
    typed = args[0] if args else None
    return frozenset(getattr(typed, "__required_keys__", ())) | frozenset(getattr(typed, "__optional_keys__", ()))


def check_signature(model: nn.Module, inputs: Any) -> None:
    """Raise :class:`InputsError` naming the first input ``forward`` cannot take (or the argument it
    needs and was not given)."""
    sig = _signature(model)
    if sig is None:
        return
    args, kwargs = split(inputs)
    params = sig.parameters
    takes_any = _open_keywords(params)
    shown = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    where = f"{type(model).__name__}.forward({', '.join(shown[:8])}{', …' if len(shown) > 8 else ''})"
    for key in kwargs:
        p = params.get(key)
        if p is None and key in _typed_keywords(params):
            continue
        if (p is None and not takes_any) or (p is not None and p.kind is inspect.Parameter.POSITIONAL_ONLY):
            raise InputsError(f"input {key!r} matches no argument of {where} (misspelt, or meant for another model?)")
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise InputsError(f"the example inputs ({describe(inputs)}) do not fit {where}: {exc}") from None


def named(model: nn.Module, inputs: Any) -> dict[str, Any]:
    """The inputs keyed by the argument each one fills (positional ones by ``forward``'s names)."""
    args, kwargs = split(inputs)
    sig = _signature(model)
    names = [n for n, p in (sig.parameters.items() if sig is not None else ())
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    out = {(names[i] if i < len(names) else f"input {i}"): a for i, a in enumerate(args)}
    return out | kwargs


def rebuild(inputs: Any, values: dict[str, Any], model: nn.Module) -> Inputs:
    """``values`` (keyed as :func:`named` keys them) back in the form of ``inputs``."""
    if isinstance(normalise(inputs), dict):
        return dict(values)
    return tuple(values[k] for k in named(model, inputs))


def describe(inputs: Any) -> str:
    """``input_ids (2, 16) int64, attention_mask (2, 16) int64`` — for messages."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        return type(v).__name__
    inputs = normalise(inputs)
    if isinstance(inputs, dict):
        return ", ".join(f"{k} {one(v)}" for k, v in inputs.items())
    return ", ".join(one(v) for v in inputs)


def tensors(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor input with a name for messages (``inputs[0]``, ``attention_mask``)."""
    inputs = normalise(inputs)
    items = inputs.items() if isinstance(inputs, dict) else ((f"inputs[{i}]", v) for i, v in enumerate(inputs))
    return [(k, v) for k, v in items if isinstance(v, torch.Tensor)]


def batch_size(inputs: Any) -> int | None:
    """Dim 0 of the first tensor with a dim (the batch), None when there is none."""
    first = next((t for _, t in tensors(inputs) if t.dim() > 0), None)
    return None if first is None else int(first.shape[0])


def _map_batched(inputs: Any, fn: Any) -> Inputs:
    n = batch_size(inputs)
    inputs = normalise(inputs)

    def one(v: Any) -> Any:
        return fn(v) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v
    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return tuple(one(v) for v in inputs)


def chunks(inputs: Any, m: int) -> list[Inputs]:
    """The inputs as ``m`` microbatches along dim 0 (unbatched values go whole to each)."""
    parts = [_map_batched(inputs, lambda t, i=i: t.chunk(m)[i]) for i in range(m)]
    return parts


def shard(inputs: Any, parts: int, index: int) -> Inputs:
    """Data-parallel shard ``index`` of ``parts`` along dim 0."""
    return _map_batched(inputs, lambda t: t.chunk(parts)[index])


def to(inputs: Any, device: torch.device) -> Inputs:
    """Every tensor input on ``device``."""
    inputs = normalise(inputs)

    def one(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v
    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return tuple(one(v) for v in inputs)


def prediction(output: Any) -> torch.Tensor | None:
    """The tensor a loss compares with the targets: ``.logits``, else the first tensor of a
    tuple, list or mapping (``ModelOutput``), else the output itself if it is a tensor."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)


__all__ = ["Inputs", "batch_size", "call", "check_signature", "chunks", "describe", "named", "normalise",
           "prediction", "rebuild", "shard", "split", "tensors", "to"]
