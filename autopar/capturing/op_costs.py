"""What selective recompute keeps and re-runs, measured op by op while capture executes the graph.

Selective activation checkpointing (``passes/recompute.py``) keeps the outputs
of the matmul-class ATen ops (:data:`autopar.cost_models.compute.MATMUL_OPS`)
and re-runs every other op of the module in backward. :class:`OpRecorder`, a
``TorchDispatchMode`` inside capture's FLOP counter, sees the same ATen ops
that policy sees and charges each to the FX node running
(:class:`NodeOpCosts`): a matmul-class op's output storages (what is kept),
any other op's counted FLOPs and the bytes it reads and writes (what is
re-run; ops that only alias their inputs, views, move nothing). Fused
attention is recorded by capture itself (:meth:`NodeOpCosts.keep`): the
meta device runs its math decomposition, but GPUs run a fused kernel whose
outputs (the attention output and its log-sum-exp) are what SAC keeps.
:func:`selective_costs` sums a layer's nodes inside its module.

The same pass records what the per-op compute model prices
(:class:`autopar.graph.OpRecord`, :func:`layer_ops`): each GEMM's shape
(m, n, k, batch), each fused attention kernel's FLOPs, and the memory-bound
ops' bytes and kernel count, with which of them a tensor-parallel style
divides (column projections n, row projections k, what lies between them
its heads or its whole work).

FLOP rules torch's counter lacks are added here (:data:`EXTRA_FLOP_RULES`):
``aten::_grouped_mm``, the grouped GEMM of mixture-of-experts layers
(Hugging Face's ``grouped_mm`` experts, torchtitan's MoE). Its shapes are
static — every routed (token, expert) row is one row of the grouped operand —
so the count is exact whatever the routing. An op that looks like compute
(a matmul, convolution or attention by name, or any op outside ATen and
prims) that no rule counts is recorded in :attr:`NodeOpCosts.unpriced`:
the plan's notes name it, rather than pricing it silently as nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.cost_models.compute import FUSED_ATTENTION_OPS, MATMUL_OPS
from autopar.graph import OpKind, OpRecord, SampleDim, ShardDim
from autopar.tp_style import TPStyle

# gathers: they move the rows they pick (twice the output: read, write) and the indices
_GATHER_OPS = frozenset({"aten::embedding", "aten::index_select", "aten::gather", "aten::index"})
# matmul-class ops priced by GEMM shape: schema name → where (m, k) and (k, n) sit in the arguments
_GEMM_ARGS = {"aten::mm": (0, 1), "aten::_scaled_mm": (0, 1), "aten::addmm": (1, 2),
              "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
# ATen ops whose name says they multiply matrices, convolve or attend: with no FLOP rule, unpriced
_COMPUTE_NAME = re.compile(r"(mm|matmul|conv|attention|linear|einsum|gemm)", re.IGNORECASE)
_NO_COMPUTE_NAMESPACES = frozenset({"aten", "prims", "profiler"})


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten::_grouped_mm(mat_a, mat_b, offs)``, every group together.

    Its four forms (torch/nn/functional.py ``grouped_mm``): 2-D × 3-D, the
    groups jagged along the rows of ``mat_a`` ([M, K] × [G, K, N] → [M, N]);
    3-D × 2-D, jagged along N; 3-D × 3-D, a plain batch; 2-D × 2-D, jagged
    along the contraction (the weight gradient, → [G, M, N]). Each row, column
    or contraction index belongs to exactly one group, so the work is 2 · M · K · N
    over the whole operands, however the offsets split them.
    """
    out = tuple(out_shape)
    if len(a_shape) == 2 and len(b_shape) == 2:  # jagged K: [M, K] × [K, N] split along K
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
    return 2 * math.prod(out) * a_shape[-1]


# Hugging Face's stand-in for aten::_grouped_mm (transformers/integrations/moe.py): the same
# (input [S, K], weight [E, K, N], offs) signature, run while exporting with weights not in bf16
_HF_GROUPED_MM = "grouped_mm_fallback"
GROUPED_MM_OPS = frozenset({"aten::_grouped_mm", f"transformers::{_HF_GROUPED_MM}"})


def extra_flop_rules() -> dict[Any, Callable[..., int]]:
    """FLOP rules for torch's ``FlopCounterMode(custom_mapping=...)``: the grouped GEMMs (HF's
    stand-in only once transformers has registered it)."""
    rules: dict[Any, Callable[..., int]] = {torch.ops.aten._grouped_mm: grouped_mm_flops}
    if hasattr(torch.ops.transformers, _HF_GROUPED_MM):
        rules[getattr(torch.ops.transformers, _HF_GROUPED_MM)] = grouped_mm_flops
    return rules


@dataclass
class NodeOpCosts:
    """One FX node's ATen ops as selective recompute sees them (totals for the example batch)."""

    kept: dict[Any, float] = field(default_factory=dict)  # storage key → bytes, matmul-class outputs
    rerun_flops: float = 0.0
    rerun_bytes: float = 0.0  # also the memory-bound bytes the per-op model prices
    kernels: int = 0  # memory-bound kernels
    gemms: list[tuple[float, float, float, float]] = field(default_factory=list)  # (m, n, k, batch), totals
    attention: list[tuple[float, bool, bool]] = field(default_factory=list)  # (forward FLOPs, causal, masked)
    fused: dict[Any, float] = field(default_factory=dict)  # fused attention's outputs (kept by both policies)
    # each matmul-class op in order: (is aten::mm, {storage key: output bytes}, FLOPs, bytes read and written)
    matmuls: list[tuple[bool, dict[Any, float], float, float]] = field(default_factory=list)
    unpriced: set[str] = field(default_factory=set)  # compute-like ops no FLOP rule counts (schema names)
    op_names: set[str] = field(default_factory=set)  # every ATen op the node ran (schema names)

    def keep(self, key: Any, nbytes: float) -> None:
        self.kept[key] = float(nbytes)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class OpRecorder(TorchDispatchMode):
    """Charges every ATen op to the node ``current()`` names (None: not charged, e.g. fused attention).

    ``storage_key`` identifies a tensor's storage (meta tensors too); ``flops()``
    reads the enclosing FLOP counter, which counts the op once this mode hands it on.
    """

    def __init__(self, current: Callable[[], fx.Node | None], flops: Callable[[], float],
                 storage_key: Callable[[torch.Tensor], tuple[Any, int]]):
        super().__init__()
        self.current, self.flops, self.storage_key = current, flops, storage_key
        self.costs: dict[fx.Node, NodeOpCosts] = {}

    def adopt(self, nodes: list[fx.Node], costs: Iterable[NodeOpCosts | None]) -> None:
        """Give a replayed twin layer's nodes the costs its measured twin's nodes had."""
        for n, c in zip(nodes, costs):
            if c is not None:
                self.costs[n] = c

    def record_attention(self, node: fx.Node, flops: float) -> None:
        """A fused attention kernel at ``node`` (an SDPA call) doing ``flops`` (the full T×T work)."""
        self.costs.setdefault(node, NodeOpCosts()).attention.append((float(flops), is_causal(node),
                                                                      has_mask(node)))

    def keep_fused(self, node: fx.Node, out: torch.Tensor, lse_bytes: float) -> None:
        """Fused attention at ``node``: SAC keeps its output and its log-sum-exp."""
        costs = self.costs.setdefault(node, NodeOpCosts())
        key, nbytes = self.storage_key(out)
        costs.keep(key, nbytes)
        costs.keep(("logsumexp", node), lse_bytes)
        costs.fused.update({key: float(nbytes), ("logsumexp", node): float(lse_bytes)})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self.flops()
        out = func(*args, **kwargs)
        node = self.current()
        if node is not None:
            self._charge(self.costs.setdefault(node, NodeOpCosts()), func, (args, kwargs), out,
                         self.flops() - before)
        return out

    def _charge(self, costs: NodeOpCosts, func: Any, inputs: Any, out: Any, flops: float) -> None:
        outs = _tensors(out)
        ins = _tensors(inputs)
        name = func._schema.name
        costs.op_names.add(name)
        if flops <= 0 and _looks_like_compute(func, outs):
            costs.unpriced.add(name)
        if name in MATMUL_OPS:
            for t in outs:
                costs.keep(*self.storage_key(t))
            kept = dict(self.storage_key(t) for t in outs)
            if name in FUSED_ATTENTION_OPS:
                costs.fused.update(kept)
            else:
                moved = float(sum(t.numel() * t.element_size() for t in ins + outs))
                costs.matmuls.append((name == "aten::mm", kept, float(flops), moved))
            shape = _gemm_shape(name, inputs[0], outs)
            if shape is not None:
                costs.gemms.append(shape)
            elif flops > 0:  # an attention kernel reached at the ATen level
                costs.attention.append((float(flops), False, False))
            return
        in_keys = {self.storage_key(t)[0] for t in ins}
        if not outs or (not func._schema.is_mutable and all(self.storage_key(t)[0] in in_keys for t in outs)):
            return  # a view or alias: nothing read or written
        costs.rerun_flops += float(flops)
        if func._schema.name in _GATHER_OPS:  # reads the rows it gathers, not the whole table
            ins = [t for t in ins if not t.is_floating_point()] + outs
        costs.rerun_bytes += float(sum(t.numel() * t.element_size() for t in ins + outs))
        costs.kernels += 1


def _looks_like_compute(func: Any, outs: list[torch.Tensor]) -> bool:
    """Whether an op with no counted FLOPs should have had some: a floating-point result of an op
    outside ATen and prims (a custom kernel: nothing says what it costs), or of an ATen op named like
    a matmul, convolution or attention (torch's counter has rules for those it knows)."""
    if not any(t.is_floating_point() for t in outs):
        return False
    namespace, _, op = func._schema.name.partition("::")
    if namespace not in _NO_COMPUTE_NAMESPACES:
        return True
    return namespace == "aten" and bool(_COMPUTE_NAME.search(op)) and not op.endswith("_backward")


def _gemm_shape(name: str, args: tuple, outs: list[torch.Tensor]) -> tuple[float, float, float, float] | None:
    """(m, n, k, batch) of a GEMM-class ATen op; a convolution as its implicit GEMM; a grouped GEMM
    as one GEMM of all its rows (its groups are experts holding thousands of rows each at training
    sizes, so tile quantisation per group is not modelled)."""
    if name in GROUPED_MM_OPS and outs:
        a, b, out = args[0], args[1], outs[0]
        if a.dim() == 2 and b.dim() == 2:  # jagged K: G products [M, K_g] × [K_g, N]
            return float(a.shape[0]), float(b.shape[-1]), float(a.shape[1]), 1.0
        return float(math.prod(out.shape[:-1])), float(out.shape[-1]), float(a.shape[-1]), 1.0
    if name in _GEMM_ARGS:
        a, b = (args[i] for i in _GEMM_ARGS[name])
        batch = float(a.shape[0]) if a.dim() == 3 else 1.0
        return float(a.shape[-2]), float(b.shape[-1]), float(a.shape[-1]), batch
    if name == "aten::convolution" and outs and len(args) > 1:
        weight, out, groups = args[1], outs[0], int(args[8]) if len(args) > 8 else 1
        spatial = math.prod(out.shape[2:])
        return (float(out.shape[0] * spatial), float(weight.shape[0] // groups),
                float(math.prod(weight.shape[1:])), float(groups))
    return None


@dataclass(frozen=True)
class SelectiveCosts:
    """A layer's selective-recompute figures per sample (see :class:`autopar.graph.Layer`)."""

    saved_bytes: float = 0.0
    sharded_bytes: float = 0.0
    recompute_flops: float = 0.0
    recompute_bytes: float = 0.0
    recompute_sharded_bytes: float = 0.0
    alternate: SelectiveCosts | None = None  # the same under torchtitan's op-level policy

    def layer_fields(self) -> dict[str, float]:
        """As :class:`autopar.graph.Layer`'s ``selective_*_per_sample`` and ``alternate_*`` keywords."""
        alt = self.alternate or SelectiveCosts()
        return {"selective_saved_bytes_per_sample": self.saved_bytes,
                "selective_sharded_bytes_per_sample": self.sharded_bytes,
                "selective_recompute_flops_per_sample": self.recompute_flops,
                "selective_recompute_bytes_per_sample": self.recompute_bytes,
                "selective_recompute_sharded_bytes_per_sample": self.recompute_sharded_bytes,
                "alternate_saved_bytes_per_sample": alt.saved_bytes,
                "alternate_sharded_bytes_per_sample": alt.sharded_bytes,
                "alternate_recompute_flops_per_sample": alt.recompute_flops,
                "alternate_recompute_bytes_per_sample": alt.recompute_bytes,
                "alternate_recompute_sharded_bytes_per_sample": alt.recompute_sharded_bytes}


def between_projections(nodes: list[fx.Node], paths: Callable[[fx.Node], tuple[str, ...]],
                        style: TPStyle | None) -> set[fx.Node]:
    """The nodes a Megatron style runs on shards: inside a column projection, or fed by such a
    node, up to (not into) a row projection, whose output is the full-size partial sum."""
    if style is None or not style.row:
        return set()
    cols, rows = set(style.column), set(style.row)
    sharded: set[fx.Node] = set()
    for n in nodes:  # graph order: producers first
        mine = paths(n)
        if any(p in rows for p in mine):
            continue
        if any(p in cols for p in mine) or any(a in sharded for a in n.all_input_nodes):
            sharded.add(n)
    return sharded


def selective_costs(key: str | None, nodes: Iterable[fx.Node], costs: dict[fx.Node, NodeOpCosts],
                    paths: Callable[[fx.Node], tuple[str, ...]], styles: tuple[TPStyle, ...],
                    batch: int) -> SelectiveCosts:
    """Sum layer ``key``'s nodes inside its module (only those are checkpointed), per sample."""
    if key is None:
        return SelectiveCosts()
    inside = [n for n in nodes if key in paths(n)]
    megatron = next((s for s in styles if s.row), None)
    sharded = between_projections(inside, paths, megatron)
    kept: dict[Any, float] = {}
    kept_sharded: dict[Any, float] = {}
    flops = rerun = rerun_sharded = 0.0
    # torchtitan's op-level policy: fused attention and the odd-numbered aten::mm calls kept
    alt_kept: dict[Any, float] = {}
    alt_sharded: dict[Any, float] = {}
    alt_flops = alt_rerun = alt_rerun_sharded = 0.0
    mm_count = 0
    for n in inside:
        c = costs.get(n)
        if c is None:
            continue
        kept.update(c.kept)
        alt_kept.update(c.fused)
        if n in sharded:
            kept_sharded.update(c.kept)
            alt_sharded.update(c.fused)
            rerun_sharded += c.rerun_bytes
        flops += c.rerun_flops
        rerun += c.rerun_bytes
        for is_mm, outs, mm_flops, moved in c.matmuls:
            mm_count += is_mm
            if is_mm and mm_count % 2 == 1:
                alt_kept.update(outs)
                if n in sharded:
                    alt_sharded.update(outs)
                continue
            alt_flops += mm_flops
            alt_rerun += moved
            alt_rerun_sharded += moved if n in sharded else 0.0
    alternate = SelectiveCosts(sum(alt_kept.values()) / batch, sum(alt_sharded.values()) / batch,
                               (flops + alt_flops) / batch, (rerun + alt_rerun) / batch,
                               (rerun_sharded + alt_rerun_sharded) / batch)
    return SelectiveCosts(sum(kept.values()) / batch, sum(kept_sharded.values()) / batch,
                          flops / batch, rerun / batch, rerun_sharded / batch, alternate)


def is_causal(n: fx.Node) -> bool:
    """Whether an SDPA node masks causally (``is_causal``, keyword or sixth argument)."""
    flag = n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)
    return flag if isinstance(flag, bool) else False


def has_mask(n: fx.Node) -> bool:
    """Whether an SDPA node passes an explicit ``attn_mask`` (keyword or fourth argument): CUDA's flash
    kernel takes none, so such a call runs another kernel there (``OpModel.masked_attention_fwd``)."""
    return n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) is not None


def _per_sample(m: float, batch: float, is_batched: bool, samples: int) -> tuple[float, float, SampleDim]:
    """(m, batch, the dimension that carries the samples) with that dimension divided by ``samples``."""
    if is_batched and batch % samples == 0:
        return m, batch / samples, SampleDim.BATCH
    if m % samples == 0:
        return m / samples, batch, SampleDim.M
    return m, batch, SampleDim.NONE


def _gemm_shard(paths: tuple[str, ...], node: fx.Node, style: TPStyle, between: set[fx.Node],
                batched: bool, k: float = 0.0) -> ShardDim | None:
    if any(p == e or p.startswith(e + ".") for e in style.experts for p in paths):
        # a routed expert split across its hidden dim I (sharding/experts.py): the down weight's reduction,
        # the gate-up's outputs
        return ShardDim.K if k == style.expert_width else ShardDim.N
    if any(p in style.column for p in paths):
        return ShardDim.N
    if any(p in style.row for p in paths):
        return ShardDim.K
    return ShardDim.BATCH if batched and node in between else None


def layer_ops(nodes: list[fx.Node], costs: dict[fx.Node, NodeOpCosts],
              paths: Callable[[fx.Node], tuple[str, ...]], styles: tuple[TPStyle, ...],
              batch: int) -> tuple[OpRecord, ...]:
    """The layer call's kernels per sample (every node, glue included), identical ones counted once."""
    between = {s.name: between_projections(nodes, paths, s) for s in styles}
    found: dict[tuple, int] = {}
    memory: dict[tuple, list[float]] = {}
    for n in nodes:
        c = costs.get(n)
        if c is None:
            continue
        mine = paths(n)
        for m, nn_, k, b in c.gemms:
            batched = b > 1  # a batched product (attention's math path, grouped convolutions)
            m_ps, b_ps, dim = _per_sample(m, b, batched, batch)
            shard = tuple(sorted((s.name, d) for s in styles
                                 if (d := _gemm_shard(mine, n, s, between[s.name], batched, k))))
            key = (OpKind.GEMM, m_ps, nn_, k, b_ps, dim, 0.0, 0.0, False, shard, False)
            found[key] = found.get(key, 0) + 1
        for flops, causal, masked in c.attention:
            shard = tuple(sorted((s.name, ShardDim.ALL) for s in styles if n in between[s.name]))
            key = (OpKind.ATTENTION, 0.0, 0.0, 0.0, 1.0, SampleDim.NONE, flops / batch, 0.0, causal, shard, masked)
            found[key] = found.get(key, 0) + 1
        if c.kernels:
            shard = tuple(sorted((s.name, ShardDim.ALL) for s in styles if n in between[s.name]))
            totals = memory.setdefault(shard, [0.0, 0.0])
            totals[0] += c.rerun_bytes / batch
            totals[1] += c.kernels
    records = [OpRecord(kind, count, m, n_, k, b, dim, flops, nbytes, causal, dict(shard), masked)
               for (kind, m, n_, k, b, dim, flops, nbytes, causal, shard, masked), count in found.items()]
    records += [OpRecord(OpKind.MEMORY, int(kernels), bytes_per_sample=nbytes, per_sample=SampleDim.NONE,
                         shard=dict(shard))
                for shard, (nbytes, kernels) in memory.items()]
    return tuple(records)
