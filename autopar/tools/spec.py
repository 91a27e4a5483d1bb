"""Model SPECs for the CLI: ``path/to/file.py:function`` or ``package.module:function``
(a Hugging Face ``config.json`` or model directory: :mod:`autopar.tools.hf_spec`).

A spec function returns ``(model, example_inputs)``: the inputs one tensor, a
tuple of positional inputs or a dict of keyword inputs (``input_ids``,
``attention_mask``, ``decoder_input_ids``, ``labels``, ``pixel_values``…),
checked against ``forward``'s signature (:func:`autopar.inputs.check_signature`). It may take ``device``
and ``seq_len``; ``seq_len`` is passed only when given. Where it is built:

- a function that takes ``device`` (or ``**kwargs``) is called with it, and
  decides for itself what that means (the examples build under
  ``torch.device(device)``);
- a function written plainly, without ``device``, is called inside
  ``with torch.device(device):``, so every tensor its factories and module
  constructors make — weights and example inputs alike — lands there. For
  ``device="meta"`` (planning: ``plan``, ``compare``, ``show``…) that
  allocates nothing, so GPT-3 175B from a plain spec plans in a few hundred
  MiB; ``verify`` asks for ``"cpu"`` and gets the real model.

A plain spec built on meta whose example inputs still came out real (made
outside the function, or with an explicit device) has them replaced by meta
tensors of the same shape and dtype, so capture sees one device. What cannot
be built on meta (copying a meta tensor out with ``.to("cpu")``, ``.item()``)
fails as a :class:`SpecError` that says so and how to opt out (take a
``device`` argument).

Every way a spec can be wrong is a :class:`SpecError` naming the spec, so the
CLI can print one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from autopar.errors import SpecError

if TYPE_CHECKING:
    import torch.nn as nn


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _split(spec: str) -> tuple[str, str]:
    target, sep, func = spec.rpartition(":")
    if not sep or not target or not func:
        raise SpecError(f"model spec {spec!r} must be FILE.py:FUNCTION or MODULE:FUNCTION "
                        "(e.g. examples/gpt.py:gpt3_175b)")
    return target, func


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import_file(spec: str, path: Path) -> ModuleType:
    """Import a file by path with its directory on sys.path (so its sibling imports work)."""
    if not path.is_file():
        raise SpecError(f"model spec {spec!r}: file {str(path)!r} does not exist")
    name = f"autopar_spec_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise SpecError(f"model spec {spec!r}: cannot import {str(path)!r} as Python")
    module = importlib.util.module_from_spec(loader_spec)
    directory = str(path.resolve().parent)
    sys.path.insert(0, directory)
    sys.modules[name] = module  # dataclasses and pickling look the module up here
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is a bad spec
        sys.modules.pop(name, None)
        raise SpecError(f"model spec {spec!r}: importing {str(path)!r} failed: {_one_line(exc)}") from exc
    finally:
        if directory in sys.path:
            sys.path.remove(directory)
    return module


def _import_module(spec: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - ModuleNotFoundError or the module's own error
        raise SpecError(f"model spec {spec!r}: cannot import module {name!r}: {_one_line(exc)}") from exc


def _function(spec: str, module: ModuleType, func: str) -> Callable[..., Any]:
    fn = getattr(module, func, None)
    if callable(fn):
        return fn
    names = sorted(n for n, v in vars(module).items()
                   if callable(v) and not n.startswith("_") and not isinstance(v, type)
                   and getattr(v, "__module__", None) == module.__name__)
    shown = ", ".join(names[:10]) + (", …" if len(names) > 10 else "")
    raise SpecError(f"model spec {spec!r}: no function {func!r} in the module"
                    + (f" (it has: {shown})" if names else " (it defines no functions)"))


def takes_device(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts a ``device`` keyword (by name or through ``**kwargs``).

    A spec function that does not is "plain": :func:`load_spec` builds it
    under ``torch.device(device)`` instead of passing the device.
    """
    params = _parameters(fn)
    return "device" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: assume it takes nothing
        return {}


def _call(spec: str, fn: Callable[..., Any], seq_len: int | None, device: str) -> Any:
    """Call ``fn`` with the keywords it accepts among seq_len (only if given) and device;
    a plain ``fn`` (no ``device``) runs inside ``torch.device(device)`` instead."""
    import torch

    params = _parameters(fn)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    if seq_len is not None:
        if "seq_len" not in params and not var_kw:
            raise SpecError(f"model spec {spec!r}: --seq-len given but {fn.__name__}() "
                            "takes no seq_len argument")
        kwargs["seq_len"] = seq_len
    plain = not takes_device(fn)
    try:
        if not plain:
            return fn(device=device, **kwargs)
        with torch.device(device):  # factories and module constructors make their tensors here
            return fn(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the spec function's own failure
        hint = (f" ({fn.__name__}() takes no `device`, so it was built under torch.device({device!r}); "
                "build nothing that needs real values there, or give it a `device` parameter "
                "to decide for itself)") if plain and device == "meta" else ""
        raise SpecError(f"model spec {spec!r}: {fn.__name__}() raised {_one_line(exc)}{hint}") from exc


def _to_meta(inputs: Any) -> Any:
    """Real tensors among the example inputs as meta tensors of the same shape and dtype."""
    import torch

    def meta(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return torch.empty_like(t, device="meta")
        return t

    if isinstance(inputs, dict):
        return {k: meta(v) for k, v in inputs.items()}
    return tuple(meta(t) for t in inputs)


def _on_meta(model: nn.Module) -> bool:
    return all(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def _check_result(spec: str, result: Any) -> tuple[nn.Module, Any]:
    import torch
    import torch.nn as nn

    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        what = (f"a {len(result)}-tuple" if isinstance(result, tuple) else type(result).__name__)
        if isinstance(result, tuple) and len(result) == 2:
            what = f"({type(result[0]).__name__}, {type(result[1]).__name__})"
        raise SpecError(f"model spec {spec!r} returned {what}; expected (nn.Module, example_inputs)")
    model, inputs = result
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,)
    if isinstance(inputs, dict):
        return model, dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return model, tuple(inputs)
    raise SpecError(f"model spec {spec!r} returned inputs of type {type(inputs).__name__}; "
                    "expected a tensor, a tuple/list of inputs or a dict of keyword inputs")


def load_function(spec: str) -> Callable[..., Any]:
    """The function ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION`` names (``verify --loss``)."""
    target, func = _split(spec)
    module = _import_file(spec, Path(target)) if _is_path(target) else _import_module(spec, target)
    return _function(spec, module, func)


def load_spec(spec: str, *, seq_len: int | None = None, device: str = "meta",
              batch: int | None = None) -> tuple[nn.Module, Any]:
    """The ``(model, example_inputs)`` a SPEC names, inputs normalised for :func:`autopar.capture`.

    ``device`` is where to build: passed to a spec function that takes it, the
    default device around one that does not (see the module docstring). A
    Hugging Face ``config.json`` or model directory is built by
    :mod:`autopar.tools.hf_spec` (``batch`` sets its example inputs' batch).
    """
    from autopar.tools import hf_spec

    if hf_spec.is_config_spec(spec):
        return hf_spec.load_config_spec(spec, seq_len=seq_len, device=device, batch=batch)
    target, func = _split(spec)
    if _is_path(target):
        module = _import_file(spec, Path(target))
    else:
        module = _import_module(spec, target)
    fn = _function(spec, module, func)
    model, inputs = _check_result(spec, _call(spec, fn, seq_len, device))
    from autopar.inputs import check_signature

    check_signature(model, inputs)  # an input forward cannot take: one line naming it
    if device == "meta" and not takes_device(fn) and _on_meta(model):
        inputs = _to_meta(inputs)
    return model, inputs
