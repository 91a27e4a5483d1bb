"""Tracing: a model into one FX graph, with torch.fx's ``symbolic_trace``, else ``torch.export``.

:func:`_trace` tries ``symbolic_trace`` first and falls back to
``torch.export.export(strict=False)`` (Hugging Face models need it), a repeated
block stack exported once per kind of block (:mod:`~autopar.capturing.stack_once`);
:func:`_leaf_trace` keeps given modules whole (MoE blocks whose routing loop no
tracer can follow). A model that neither traces is one :class:`CaptureError`
naming each tracer's failure and the module it rose in. Capture
(:mod:`~autopar.capturing.trace`) and the pipeline's stage trace
(:mod:`~autopar.capturing.layer_trace`) both trace through here.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import traceback
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from autopar.capturing import stack_once, torch_transformer
from autopar.capturing.export_layers import no_stack_traces
from autopar.errors import CaptureError


def _split_inputs(model: nn.Module, example_inputs: Any) -> tuple[tuple, dict]:
    """Positional and keyword inputs, checked against ``forward`` (an input it cannot take is one line)."""
    from autopar import inputs

    inputs.check_signature(model, example_inputs)
    return inputs.split(example_inputs)


def _where_failed(exc: BaseException, names: dict[int, str]) -> str | None:
    """The innermost module of ``model`` whose forward was on the stack when ``exc`` rose."""
    where = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            where = names[id(owner)]
    return where


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


class _LeafTracer(fx.Tracer):
    """FX with the given modules kept whole (MoE blocks whose routing loop no tracer can follow)."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


def _leaf_trace(model: nn.Module, args: tuple, kwargs: dict, leaves: set[str]) -> tuple[fx.GraphModule, list, str]:
    """FX with the MoE blocks ``leaves`` kept whole (their routing loop cannot run on meta)."""
    try:
        gm = fx.GraphModule(model, _LeafTracer(leaves).trace(model))
    except Exception as exc:  # noqa: BLE001
        raise CaptureError(f"cannot capture {type(model).__name__}: symbolic_trace with its MoE blocks "
                           f"kept whole: {_short(exc)}") from exc
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return gm, list(bound.arguments.values()), "fx"


def _attributes(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Each module's plain attributes, before a tracer runs its forward."""
    return [(m, {k: v for k, v in vars(m).items() if not k.startswith("_")}) for m in model.modules()]


def _drop_proxies(before: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Undo what a failed ``symbolic_trace`` left on the model: a forward that stores a value on its
    module (Meta's Llama: ``self.freqs_cis = self.freqs_cis.to(h.device)``) stored a Proxy there, and
    the next tracer would read it back as the tensor; each gets its value from ``before``."""
    for m, attrs in before:
        for k in [k for k, v in vars(m).items() if isinstance(v, fx.Proxy)]:
            delattr(m, k)
            if k in attrs:
                object.__setattr__(m, k, attrs[k])


def _fx(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, list, str]:
    gm = torch.fx.symbolic_trace(model)
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    flat = list(bound.arguments.values())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        raise TypeError("forward uses *args/**kwargs; FX placeholders do not match inputs")
    return gm, flat, "fx"


def _trace(model: nn.Module, args: tuple, kwargs: dict, once_per_kind: bool = False,
           ) -> tuple[fx.GraphModule, list, str]:
    """Trace with FX, else export (``once_per_kind``: :mod:`~autopar.capturing.stack_once`); return
    the graph module, its flat inputs and the tracer. FX is not tried on a model holding PyTorch's
    transformer modules (:func:`~autopar.capturing.torch_transformer.skip_fx`)."""
    names = {id(m): (p or "<root>") for p, m in model.named_modules()}
    errors: list[str] = []
    skip = torch_transformer.skip_fx(model)
    if skip:
        errors.append(f"symbolic_trace not tried: {skip}")
    else:
        before = _attributes(model)
        try:
            return _fx(model, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - any tracer failure means: try export
            _drop_proxies(before)
            where = _where_failed(exc, names)
            errors.append(f"symbolic_trace{' in ' + where if where else ''}: {_short(exc)}")
    fast = stack_once.export_once_per_kind(model, args, kwargs) if once_per_kind else None
    if fast is not None:
        return fast, pytree.tree_leaves((args, kwargs)), "export"
    try:
        # A failed export prints its partial graph to stderr (torch/export/_trace.py);
        # CaptureError says what failed, so that dump is dropped.
        with contextlib.redirect_stderr(io.StringIO()), no_stack_traces():
            ep = torch.export.export(model, args, kwargs=kwargs, strict=False)
        gm = ep.module()
        return gm, pytree.tree_leaves((args, kwargs)), "export"
    except Exception as exc:  # noqa: BLE001
        where = _where_failed(exc, names)
        errors.append(f"torch.export{' in ' + where if where else ''}: {_short(exc)}")
    raise CaptureError(f"cannot capture {type(model).__name__}: " + "; ".join(errors))


__all__ = ["_leaf_trace", "_short", "_split_inputs", "_trace", "_where_failed"]
