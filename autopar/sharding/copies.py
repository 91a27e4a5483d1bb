"""The real, small copies a tensor-parallel style is simulated on.

A layer small enough is copied whole (:func:`layer_copy`: float64, weights
redrawn); a larger one is built again from the model's config with every
width divided by one factor (:func:`small_copy`), and the inputs recorded
at the real size are shrunk to match (:func:`shrink_inputs`). A layer with
no config is narrowed from its own module instead (:mod:`autopar.sharding.narrow`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree


def real_value(t: Any, gen: torch.Generator) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if not t.is_meta:
        return t.detach().clone().double() if t.is_floating_point() else t.detach().clone()
    if t.is_floating_point():
        return torch.randn(t.shape, generator=gen, dtype=torch.float64)
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=torch.bool)
    return torch.zeros(t.shape, dtype=t.dtype)


@torch.no_grad()
def _redraw(module: nn.Module, gen: torch.Generator) -> None:
    """Fresh weights of a moderate scale (biases too, so a misplaced bias shows)."""
    for p in module.parameters():
        if p.is_floating_point():
            fan = p.shape[-1] if p.dim() >= 2 else 4
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(fan))
    for name, b in module.named_buffers():
        if b.is_meta:
            raise ValueError(f"buffer {name} has no value")


def layer_copy(module: nn.Module, gen: torch.Generator) -> nn.Module:
    """A float64 CPU copy of ``module`` with redrawn weights (meta buffers filled neutrally)."""
    if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
        clone = copy.deepcopy(module).to_empty(device="cpu")
        with torch.no_grad():
            for b in clone.buffers():
                if b.is_floating_point():
                    b.fill_(1.0)
                elif b.dtype == torch.bool:
                    b.fill_(True)
                else:
                    b.zero_()
    else:
        clone = copy.deepcopy(module)
    clone = clone.double()
    _redraw(clone, gen)
    return clone


_WIDTH_WORDS = ("d_model", "n_embd", "hidden", "intermediate", "ffn", "inner", "embed_dim", "dim_ff", "d_ff",
                "head_dim", "kv_channels", "width", "n_inner", "d_kv")


def _is_count(key: str) -> bool:
    """A count, not a width, though its name holds a width word: ``num_hidden_layers`` (Llama's 80
    layers are no multiple of its narrowing factor, 32, and must not be narrowed either)."""
    k = key.lower()
    return k.startswith("num_") or "layers" in k


def _layer_index(module: nn.Module, name: str) -> int:
    """The index ``module`` was built at (its own or its attention's ``layer_idx``, as Hugging Face's
    decoder layers keep it), else 0. A copy built at index 0 can be another kind of layer: DeepSeek-V3's
    first layers are dense and the rest are mixtures of experts."""
    for sub in (module, *module.children()):
        value = getattr(sub, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


def _fewer_experts(fields: dict[str, Any]) -> dict[str, int]:
    """Config changes that leave a mixture of experts the fewest routed experts its routing still
    runs with: a divisor of the count, at least twice top-k, and for group-limited routing
    (DeepSeek-V3's ``n_group``/``topk_group``) at least two experts a group and top-k within the
    chosen groups. Why the proof carries to the real count: every style the rules admit leaves the
    router and the routed experts whole on every rank (the grouped GEMM's rule runs replicated
    inputs only), so the number of experts sizes no sharded dimension; the shape proof still runs
    at the real count. 256 experts, one matmul each, made DeepSeek-V3's proof take minutes."""
    counts = {k: v for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1
              and k.lower().endswith("experts") and "shared" not in k.lower() and "per_tok" not in k.lower()}
    if len(set(counts.values())) != 1:
        return {}
    total = next(iter(counts.values()))
    top_k = fields.get("num_experts_per_tok") or fields.get("moe_topk") or 1
    groups, top_groups = fields.get("n_group") or 1, fields.get("topk_group") or 1
    for fewer in range(1, total):
        if (total % fewer == 0 and fewer >= max(2 * top_k, 4) and fewer % groups == 0
                and fewer // groups >= 2 and (fewer // groups) * top_groups >= top_k):
            return dict.fromkeys(counts, fewer)
    return {}


def small_copy(module: nn.Module, config: Any, gen: torch.Generator,
               lengths: dict[int, int] | None = None) -> tuple[nn.Module, dict[int, int]] | None:
    """``module``'s class built again from ``config`` with every width divided by one factor.

    Head counts, vocabulary, lengths and layer counts stay; widths (``d_model``,
    ``hidden_size``, ``intermediate_size``…) shrink so each head is 4 wide, and a mixture of
    experts keeps fewer routed experts (:func:`_fewer_experts`). The copy is built at the
    layer's own index (:func:`_layer_index`).
    Returns the copy and the map old width → new width (for the inputs), or
    None when the class cannot be built that way.
    """
    if config is None:
        return None
    fields = _config_fields(config)
    widths = {k: v for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0
              and any(w in k.lower() for w in _WIDTH_WORDS) and not _is_count(k)}
    heads = [v for k, v in fields.items() if isinstance(v, int) and "head" in k.lower() and "dim" not in k.lower()
             and v > 0]
    if not widths or not heads:
        return None
    base = max(widths.values())
    hd = next((v for k, v in widths.items() if "head_dim" in k.lower()), None)
    if hd is None:
        model_w = next((v for k, v in widths.items() if k.lower() in ("d_model", "n_embd", "hidden_size",
                                                                       "embed_dim")), base)
        hd = model_w // max(heads)
    factor = max(1, hd // 4)
    if factor == 1 or any(v % factor for v in widths.values()):
        return None
    changes = {k: v // factor for k, v in widths.items()}
    new_of = {v: v // factor for v in widths.values()}  # the inputs' dims map by value: one new size each
    for old_len, new_len in (lengths or {}).items():
        new_of.setdefault(old_len, new_len)
    # a length the inputs are shortened to (the example's sequence) is shortened in the config too,
    # so buffers sized by it (a rotary table of ``seq_len`` rows) match the shorter inputs
    changes.update({k: new_of[v] for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool)
                    and lengths and v in lengths and k not in changes})
    changes.update(_fewer_experts(fields))
    small = _with_fields(config, changes)
    sig = inspect.signature(type(module).__init__)
    params = [p for p in list(sig.parameters.values())[1:] if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    call: list[Any] = []
    for p in params:
        if p.name in ("layer_idx", "layer_id", "layer_number", "idx", "i"):
            call.append(_layer_index(module, p.name))
        elif not call:
            call.append(small)
        else:
            return None
    try:
        built = type(module)(*call)
    except Exception:  # noqa: BLE001 - a constructor we cannot satisfy: no small copy
        return None
    mapping = dict(new_of)
    mapping.setdefault(hd, hd // factor)
    return layer_copy(built, gen), mapping


def _config_fields(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


# what a Hugging Face config keeps outside its fields: the kernels its attention and experts run
_IMPLEMENTATIONS = ("_attn_implementation", "_experts_implementation")


def _with_fields(config: Any, changes: dict[str, int]) -> Any:
    if dataclasses.is_dataclass(config):
        clone = dataclasses.replace(config, **changes)
        # a dataclass config is rebuilt by its constructor, which resets the implementations: the copy
        # would run another program (HF's eager expert loop where the model runs grouped_mm)
        for name in _IMPLEMENTATIONS:
            if (value := getattr(config, name, None)) is not None:
                setattr(clone, name, value)
        return clone
    clone = copy.deepcopy(config)
    for k, v in changes.items():
        setattr(clone, k, v)
    return clone


def shrink_inputs(recorded: tuple, mapping: dict[int, int]) -> tuple:
    """Recorded inputs as meta tensors whose every dimension equal to an old size (a width, the
    batch, the sequence) has the new size."""
    def shrink(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return torch.empty([mapping.get(int(s), int(s)) for s in t.shape], dtype=t.dtype, device="meta")
        return t
    return pytree.tree_map(shrink, recorded)


__all__ = ["layer_copy", "real_value", "shrink_inputs", "small_copy"]
