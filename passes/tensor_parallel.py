"""Tensor parallelism: a plan's per-layer ``tp`` styles as DTensor parallel styles.

Takes the model (real or meta tensors, unsharded), the captured
:class:`~autopar.graph.LayerGraph`, the Plan and the ``tp`` axis of the device
mesh. Returns a :class:`TensorParallelResult`. What stays true: parameter
FQNs are unchanged; every rank of the tp axis computes the same layer outputs
as the unsharded model (Megatron column → row pairs end in an all-reduce,
vocab-split embeddings in an all-reduce, an LM head in an all-gather).

Two things DTensor styles cannot do alone, done here:

* a fused q/k/v projection (GPT's ``c_attn``: h → (n_heads + 2·n_kv)·head_dim)
  split contiguously would give rank 0 all of q and half of k; its rows are
  permuted first so each rank's contiguous shard holds its own heads' q, k
  and v. The permutation is returned so full state dicts and gradients can be
  put back in the original order.
* an eager attention forward reshapes with its head count: the module's
  head-count attributes (``n_head``, ``num_heads`` …) and width attributes
  equal to n_heads·head_dim (``d_model``, ``embed_dim``, ``split_size`` …)
  become this rank's share. Forwards that reshape with ``-1`` (Hugging Face
  Llama) need nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar.errors import LoweringError
from autopar.graph import Layer, LayerGraph, TPStyle
from autopar.plan import Plan

HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "n_heads")
KV_ATTRS = ("num_key_value_heads", "n_kv_head", "n_kv_heads")
WIDTH_ATTRS = ("d_model", "embed_dim", "split_size", "all_head_size", "inner_dim")


@dataclass(frozen=True)
class Attention:
    """An attention module inside a tensor-parallel layer, with its head geometry."""

    path: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    fused_qkv: str | None  # the fused q/k/v projection's path, if any


@dataclass
class TensorParallelResult:
    """What the pass did: ``row_permutations`` maps a parameter FQN to the index
    ``new_rows = old_rows[perm]`` applied on dim 0 (fused q/k/v only)."""

    layers: list[str] = field(default_factory=list)
    row_permutations: dict[str, torch.Tensor] = field(default_factory=dict)


def _tp_layers(graph: LayerGraph, plan: Plan) -> list[tuple[Layer, TPStyle]]:
    by_name = {l.name: l for l in graph}
    out = []
    for lp in plan.layers:
        if lp.tp is None:
            continue
        layer = by_name.get(lp.name)
        if layer is None:
            raise LoweringError(f"the plan names layer {lp.name!r}, which the model does not have")
        try:
            out.append((layer, layer.tp_style(lp.tp)))
        except KeyError as exc:
            raise LoweringError(str(exc.args[0])) from None
    return out


def _linear(model: nn.Module, path: str, role: str) -> nn.Module:
    mod = model.get_submodule(path)
    if not isinstance(mod, (nn.Linear, nn.Embedding)):
        raise LoweringError(f"tensor parallelism splits nn.Linear and nn.Embedding; {role} module "
                            f"{path!r} is {type(mod).__name__}: plan it with tp=none")
    return mod


def find_attention(model: nn.Module, style: TPStyle) -> list[Attention]:
    """The attention modules of a style, from its recorded head counts."""
    found = []
    for path, n_heads in style.heads.items():
        if path.endswith(".kv"):
            continue
        n_kv = style.heads.get(path + ".kv", n_heads)
        rows = [p for p in style.row if p.startswith(path + ".")]
        cols = [p for p in style.column if p.startswith(path + ".")]
        if rows:
            head_dim = _linear(model, rows[0], "row").in_features // n_heads
        else:
            head_dim = int(getattr(model.get_submodule(path), "head_dim", 0))
        fused = next((c for c in cols if head_dim and
                      _linear(model, c, "column").out_features == (n_heads + 2 * n_kv) * head_dim), None)
        found.append(Attention(path, n_heads, n_kv, head_dim, fused))
    return found


def check_tensor_parallel(model: nn.Module, graph: LayerGraph, plan: Plan, tp: int) -> None:
    """Raise :class:`LoweringError` unless ``tp`` divides every head count and split width.

    Pure and deterministic, so every rank raises the same error before any collective.
    """
    for layer, style in _tp_layers(graph, plan):
        if not style.admits(tp):
            raise LoweringError(f"layer {layer.name!r}: tp={tp} does not divide the sizes its "
                                f"{style.name!r} style splits {list(style.divisors)}; pick tp "
                                "dividing all of them or plan the layer with tp=none")
        for path, dim, role in ([(p, "out_features", "column") for p in style.column]
                                + [(p, "in_features", "row") for p in style.row]):
            mod = _linear(model, path, role)
            size = mod.num_embeddings if isinstance(mod, nn.Embedding) else getattr(mod, dim)
            if size % tp:
                raise LoweringError(f"{role} module {path!r}: tp={tp} does not divide its width {size}")
        for path in style.vocab:
            mod = _linear(model, path, "vocab")
            size = mod.num_embeddings if isinstance(mod, nn.Embedding) else mod.out_features
            if size % tp:
                raise LoweringError(f"vocab module {path!r}: tp={tp} does not divide its size {size}")
        for att in find_attention(model, style):
            if att.n_heads % tp or att.n_kv_heads % tp:
                raise LoweringError(f"attention {att.path!r}: tp={tp} does not divide its "
                                    f"{att.n_heads} heads / {att.n_kv_heads} key-value heads")


def qkv_permutation(att: Attention, tp: int) -> torch.Tensor:
    """Row order putting rank r's q, k and v heads in its contiguous 1/tp of the rows."""
    hd, nq, nkv = att.head_dim, att.n_heads, att.n_kv_heads
    q = torch.arange(nq * hd)
    k = torch.arange(nkv * hd) + nq * hd
    v = torch.arange(nkv * hd) + (nq + nkv) * hd
    parts = [torch.cat([t.chunk(tp)[r] for t in (q, k, v)]) for r in range(tp)]
    return torch.cat(parts)


@torch.no_grad()
def _localise_attention(model: nn.Module, att: Attention, tp: int, result: TensorParallelResult) -> None:
    """Permute a fused q/k/v projection and divide the module's head and width attributes."""
    if att.fused_qkv is not None:
        perm = qkv_permutation(att, tp)
        proj = model.get_submodule(att.fused_qkv)
        for name, param in proj.named_parameters(recurse=False):
            if not param.is_meta:  # a meta model is initialised after sharding: nothing to move
                param.copy_(param[perm])
            result.row_permutations[f"{att.fused_qkv}.{name}"] = perm
    mod = model.get_submodule(att.path)
    width = att.n_heads * att.head_dim
    for names, full in ((HEAD_ATTRS, att.n_heads), (KV_ATTRS, att.n_kv_heads), (WIDTH_ATTRS, width)):
        for name in names:
            value = mod.__dict__.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value == full:
                setattr(mod, name, full // tp)


def _styles(model: nn.Module, style: TPStyle) -> dict[str, object]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    for path in style.column:
        # an LM head is both column and vocab: gather its logits on every rank
        plan[path] = (ColwiseParallel(output_layouts=Replicate()) if path in style.vocab
                      else ColwiseParallel())
    for path in style.row:
        plan[path] = RowwiseParallel()
    for path in style.vocab:
        if path in plan:
            continue
        if isinstance(model.get_submodule(path), nn.Embedding):
            plan[path] = RowwiseParallel(input_layouts=Replicate())  # vocab-split embedding
        else:
            plan[path] = ColwiseParallel(output_layouts=Replicate())
    return plan


def apply_tensor_parallel(model: nn.Module, graph: LayerGraph, plan: Plan, tp_mesh) -> TensorParallelResult:
    """Shard every layer whose plan ``tp`` names a style over ``tp_mesh`` (a 1-D DeviceMesh).

    Requires: the model unsharded (no FSDP yet), ``plan`` made for ``graph``.
    Returns the layers split and the fused q/k/v row permutations. Raises
    :class:`LoweringError` (before touching the model) if tp does not divide a size.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    result = TensorParallelResult()
    if tp == 1:
        return result
    check_tensor_parallel(model, graph, plan, tp)
    styles: dict[str, object] = {}
    for layer, style in _tp_layers(graph, plan):
        for att in find_attention(model, style):
            _localise_attention(model, att, tp, result)
        styles.update(_styles(model, style))
        result.layers.append(layer.name)
    if styles:
        parallelize_module(model, tp_mesh, styles)
    return result
