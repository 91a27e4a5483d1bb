"""Hugging Face causal masks traced as eager runs them: SDPA's ``is_causal`` flag, not an S × S tensor.

In eager mode, Hugging Face's ``sdpa`` attention skips building the causal mask
when nothing is padded (``transformers.masking_utils._ignore_causal_mask_sdpa``):
``scaled_dot_product_attention`` gets ``is_causal=True``, which lets a GPU run
the flash kernel (and skip the masked half of the work). Under ``torch.export``
the same function refuses to skip (so that an export traced at one length
stays right at another, pytorch#108108), and the traced graph builds a boolean
S × S mask that every layer reads and that a pipeline cut would send: 16 GiB per
sample at 131,072 tokens, and a fused kernel then saves it as an S × S bias in
every layer.

autopar's exports specialise on the example's shapes anyway (a plan is for one
sequence length), so inside :func:`eager_causal_masks`, for a model called
without ``position_ids`` and ``attention_mask``, the skip is decided as eager
decides it: no padding mask, no tensor offsets, no sliding window reached, and
the query as long as the keys (or one token). A padding mask, given positions
(packed sequences), or anything else keeps Hugging Face's own answer. Capture and
the pipeline's stage trace both run inside it, so what is priced is what the
stages run.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch


def _eager_skip(original: Any) -> Any:
    signature = inspect.signature(original)

    def skip(*args: Any, **kwargs: Any) -> bool:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        offsets = [a.get("q_offset", 0), a.get("kv_offset", 0)]
        q_length, kv_length, local = a.get("q_length"), a.get("kv_length"), a.get("local_attention_size")
        if (a.get("padding_mask") is not None or any(isinstance(o, torch.Tensor) for o in offsets)
                or not isinstance(q_length, int) or not isinstance(kv_length, int)):
            return original(*args, **kwargs)
        if local is not None and kv_length >= local:
            return False
        return q_length == 1 or q_length == kv_length

    return skip


def _no_positions_or_padding(model: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``model`` is called without ``position_ids`` and ``attention_mask`` (then its positions
    are an ``arange`` built inside, and nothing is padded or packed)."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return all(bound.arguments.get(k) is None for k in ("position_ids", "attention_mask"))


@contextlib.contextmanager
def eager_causal_masks(model: Any, args: tuple, kwargs: dict) -> Iterator[None]:
    """Within: Hugging Face's SDPA causal masks are skipped under export as in eager mode, when
    ``model`` is called on ``args``/``kwargs`` with neither ``position_ids`` nor ``attention_mask``
    (otherwise, without ``transformers``, or with a masking module lacking these functions: a no-op).

    Two answers eager reads from data are given from that fact: the positions are one ``arange``,
    so no packed sequences (``find_packed_sequence_indices`` is None), and the causal mask is
    skipped (``_ignore_causal_mask_sdpa``, as :func:`_eager_skip` decides it).
    """
    # a Hugging Face model has imported transformers already; any other model must not pay for it
    if "transformers" not in sys.modules:
        yield
        return
    try:
        from transformers import masking_utils
    except Exception:  # noqa: BLE001 - a broken transformers: nothing to change
        yield
        return
    names = ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices")
    originals = {n: getattr(masking_utils, n, None) for n in names}
    if None in originals.values() or not _no_positions_or_padding(model, args, kwargs):
        yield
        return
    masking_utils._ignore_causal_mask_sdpa = _eager_skip(originals["_ignore_causal_mask_sdpa"])
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(masking_utils, n, f)


__all__ = ["eager_causal_masks"]
