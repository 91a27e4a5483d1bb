"""PyTorch's own transformer modules traced as training runs them, their blocks layers of their own.

``nn.TransformerEncoder``, ``nn.TransformerDecoder``, their layers and
``nn.Transformer`` live in ``torch.nn``, so ``symbolic_trace`` keeps each
whole (one ``call_module``): the stack would be one layer, with no block to
cut a pipeline at, shard or wrap. Tracing into them takes ``torch.export``:
their forwards branch on tensor properties (``src.is_nested``, ``src.dim()``),
which FX cannot follow. :func:`skip_fx` says so for a model holding one.

Two of their choices read data, and :func:`as_training_runs` makes each as a
training step makes it, so that what is traced and priced is what runs:

- **The fast path** (``torch._transformer_encoder_layer_fwd``, nested tensors
  from ``src_key_padding_mask``, ``torch._native_multi_head_attention``) runs
  only in eval mode without gradients; a training step never takes it. Within,
  it is off (``torch.backends.mha.set_fastpath_enabled(False)``, restored after),
  so a model captured in eval mode is traced on the same path as one in train mode.
- **A causal mask given without ``is_causal``**: the encoder compares the
  mask's values with a causal mask (``_detect_is_causal_mask``) and, when
  they match, has attention run ``is_causal=True`` and drop the mask. No
  tracer reads values. A mask made by ``nn.Transformer.generate_square_subsequent_mask``
  is causal by construction, so it is decided as eager decides it: causal
  when it is square at the sequence's length. Any other mask given without
  ``is_causal`` is a :class:`~autopar.errors.CaptureError` asking for it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.modules.transformer as transformer

from autopar.errors import CaptureError

KINDS = (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer,
         nn.TransformerDecoderLayer)


def holds(model: nn.Module) -> bool:
    """Whether ``model`` holds one of PyTorch's transformer modules (:data:`KINDS`)."""
    return any(isinstance(m, KINDS) for m in model.modules())


def skip_fx(model: nn.Module) -> str | None:
    """Why ``symbolic_trace`` is not tried on ``model`` (None: it is)."""
    if holds(model):
        return "torch.nn's transformer modules would be kept whole (traced by torch.export instead)"
    return None


def _causal_masks() -> tuple[Any, dict[int, weakref.ref]]:
    """``generate_square_subsequent_mask`` that remembers the masks it made (weakly, by identity: a
    tensor's ``==`` is elementwise, so no set of tensors can be asked)."""
    made: dict[int, weakref.ref] = {}
    original = transformer._generate_square_subsequent_mask

    def generate(sz: int, device: Any = None, dtype: Any = None) -> torch.Tensor:
        mask = original(sz, device=device, dtype=dtype)
        made[id(mask)] = weakref.ref(mask)
        return mask

    return staticmethod(generate), made


def _detect(original: Any, made: dict[int, weakref.ref]) -> Any:
    def detect(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
        if is_causal is not None or mask is None:
            return original(mask, is_causal, size)
        if (ref := made.get(id(mask))) is not None and ref() is mask:
            # causal by construction: eager's comparison with a causal mask holds when it is square at ``size``
            sz = size if size is not None else mask.size(-2)
            return tuple(mask.shape) == (sz, sz)
        raise CaptureError("nn.TransformerEncoder/Decoder decides is_causal from the values of the mask it is "
                           "given, which capture cannot read: pass is_causal=True (or False) with the mask, or "
                           "make it with nn.Transformer.generate_square_subsequent_mask")

    return detect


@contextlib.contextmanager
def as_training_runs(model: nn.Module) -> Iterator[None]:
    """Within: the fast path off and causal masks decided as eager does (see the module docstring);
    for a model holding none of :data:`KINDS`, nothing changes."""
    if not holds(model):
        yield
        return
    fast = torch.backends.mha.get_fastpath_enabled()
    generate, made = _causal_masks()
    original_generate = transformer.Transformer.__dict__["generate_square_subsequent_mask"]
    original_detect = transformer._detect_is_causal_mask
    torch.backends.mha.set_fastpath_enabled(False)
    transformer.Transformer.generate_square_subsequent_mask = generate
    transformer._detect_is_causal_mask = _detect(original_detect, made)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
        transformer.Transformer.generate_square_subsequent_mask = original_generate
        transformer._detect_is_causal_mask = original_detect


__all__ = ["KINDS", "as_training_runs", "holds", "skip_fx"]
