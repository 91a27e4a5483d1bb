"""The LayerGraph: a captured model as a chain of layers with costs per sample.

A *layer* is the planning unit: one call of a module on the model's main chain
(a transformer block, the embedding, the final norm + head…) or a run of glue
operations between such calls. Layers are ordered by execution; a pipeline may
be cut only after a layer whose ``can_cut_after`` is true, where every value
that crosses the cut is a known tensor.

All sizes are *per sample* (per element of the example batch's dim 0) and in
the dtype the model was captured in (``LayerGraph.dtype_bytes`` bytes per
element), so the cost model can rescale them for any microbatch and precision.
Networkx holds the dataflow between layers; the chain order is ``layers``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import networkx as nx

from autopar.experts import MoEFacts
from autopar.loss_head import NOT_CHECKED, LossHead
from autopar.tp_style import TPStyle


class OpKind(StrEnum):
    """What an :class:`OpRecord` prices: a GEMM by its shape, fused attention by its FLOPs,
    memory-bound work (norms, softmax, rotary, elementwise, embedding) by the bytes it moves."""

    GEMM = "gemm"
    ATTENTION = "attention"
    MEMORY = "memory"


class SampleDim(StrEnum):
    """Which dimension of an :class:`OpRecord`'s GEMM grows with the microbatch."""

    M = "m"  # tokens: a linear layer's rows
    BATCH = "batch"  # batched products: attention's math path, grouped convolutions
    NONE = ""  # neither: the op's shape is fixed per call


class ShardDim(StrEnum):
    """What a tensor-parallel style divides by the tp degree in an :class:`OpRecord`."""

    N = "n"  # a column projection's outputs
    K = "k"  # a row projection's inputs
    BATCH = "batch"  # the heads of batched products between them
    ALL = "all"  # an attention kernel's or memory-bound op's whole work between them


NOT_CHECKED_FOR_CP = "the graph was not captured from a model whose attention autopar checked for cp"


@dataclass(frozen=True)
class OpRecord:
    """``count`` identical kernels of one layer call, as capture saw them (per sample).

    A GEMM multiplies ``batch`` (m × k) by (k × n) matrices; ``per_sample``
    (:class:`SampleDim`) names the dimension that grows with the microbatch, and
    that dimension is held per sample. Attention and memory-bound records carry
    ``flops_per_sample`` (attention's full T×T work; ``causal`` when masked so, ``masked`` when it
    takes an explicit mask tensor) and
    ``bytes_per_sample`` (read + written, captured dtype; a memory-bound record
    totals its ``count`` kernels, the others are per kernel). ``shard`` says, per
    tensor-parallel style, what the style divides by the tp degree
    (:class:`ShardDim`); a style not named leaves the op whole.
    """

    kind: OpKind
    count: int = 1
    m: float = 0.0
    n: float = 0.0
    k: float = 0.0
    batch: float = 1.0
    per_sample: SampleDim = SampleDim.M
    flops_per_sample: float = 0.0
    bytes_per_sample: float = 0.0
    causal: bool = False
    shard: dict[str, ShardDim] = field(default_factory=dict)
    masked: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))
        object.__setattr__(self, "per_sample", SampleDim(self.per_sample))
        object.__setattr__(self, "shard", {k: ShardDim(v) for k, v in self.shard.items()})

    def gemm_shape(self, microbatch: int, style: str | None, tp: int) -> tuple[float, float, float, float]:
        """(m, n, k, batch) of one kernel for a microbatch of ``microbatch`` under ``style`` on ``tp`` ranks."""
        m = self.m * microbatch if self.per_sample is SampleDim.M else self.m
        batch = self.batch * microbatch if self.per_sample is SampleDim.BATCH else self.batch
        n, k = self.n, self.k
        dim = self.shard.get(style) if style is not None and tp > 1 else None
        if dim is ShardDim.N:
            n = math.ceil(n / tp)
        elif dim is ShardDim.K:
            k = math.ceil(k / tp)
        elif dim is ShardDim.BATCH:
            batch = batch / tp
        return m, n, k, batch

    def split(self, style: str | None, tp: int) -> float:
        """The share of this op's work one tp rank does under ``style``."""
        return 1.0 / tp if style is not None and tp > 1 and self.shard.get(style) else 1.0

    def gemm_flops_per_sample(self) -> float:
        """Forward FLOPs per sample of all ``count`` kernels (unsharded)."""
        scale = {SampleDim.M: self.m, SampleDim.BATCH: self.batch}.get(self.per_sample, 0.0)
        rest = self.batch if self.per_sample is SampleDim.M else self.m
        return 2.0 * self.count * scale * rest * self.n * self.k

    def signature(self) -> tuple:
        return (self.kind.value, self.count, round(self.m, 3), round(self.n, 3), round(self.k, 3),
                round(self.batch, 3), self.per_sample.value, round(self.flops_per_sample, 3),
                round(self.bytes_per_sample, 3), self.causal,
                tuple(sorted((k, v.value) for k, v in self.shard.items())), self.masked)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"], d["per_sample"] = self.kind.value, self.per_sample.value
        d["shard"] = {k: v.value for k, v in self.shard.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpRecord:
        return cls(**d)


@dataclass(frozen=True)
class Layer:
    """One planning unit of the chain, with its costs per sample.

    ``activation_bytes_per_sample`` is what autograd keeps for backward;
    ``input_bytes_per_sample`` what recompute keeps instead (the values that
    enter the layer), and ``glue_saved_bytes_per_sample`` what the layer's ops
    outside its module save (glue that capture folds into the next module's
    layer: checkpointing the module does not recompute them, so recompute
    keeps these too); ``boundary_bytes_per_sample`` what crosses a pipeline cut
    placed right after this layer (zero and ``can_cut_after`` false when no cut
    is allowed there). ``param_names`` are the fully qualified parameter names
    owned by this layer (each parameter belongs to exactly one layer).

    Selective recompute (the module checkpointed with a policy that keeps the
    outputs of matmul-class ops, ``cost_models.compute.MATMUL_OPS``) keeps the
    layer's inputs, its glue's saved tensors and
    ``selective_saved_bytes_per_sample`` — those outputs inside the module, of
    which ``selective_sharded_bytes_per_sample`` lie between the column and row
    projections of its Megatron style, split over tp — and re-runs in backward
    the module's other ops: ``selective_recompute_flops_per_sample`` FLOPs
    (those the FLOP counter counts) and ``selective_recompute_bytes_per_sample``
    bytes read and written (``selective_recompute_sharded_bytes_per_sample`` of
    them split over tp). Graphs captured before these were recorded load with
    zeros: selective recompute is then not offered. The ``alternate_*`` fields
    are the same figures under torchtitan's op-level policy
    (:attr:`~autopar.plan.Recompute.ALTERNATE_MM`: fused attention's outputs and
    every other ``mm`` output kept; the other matmuls re-run, their FLOPs in
    ``alternate_recompute_flops_per_sample``).
    """

    name: str
    index: int
    kind: str
    flops_per_sample: float
    param_count: int
    param_bytes: int
    activation_bytes_per_sample: float
    input_bytes_per_sample: float
    boundary_bytes_per_sample: float
    can_cut_after: bool
    tp_styles: tuple[TPStyle, ...] = ()
    param_names: tuple[str, ...] = ()
    module_path: str | None = None
    glue_saved_bytes_per_sample: float = 0.0
    tp_refusal: str = ""  # why no Megatron style is offered, when the graph had a candidate
    cut_blocked_by: str = ""  # why no pipeline cut may follow this layer, when the dataflow allows one
    recompute_refusal: str = ""  # why recompute is not offered (a BatchNorm's running statistics would move twice)
    # channels of each BatchNorm in the layer: under dp each all-reduces its statistics (passes/batchnorm.py)
    sync_norm_channels: tuple[int, ...] = ()
    selective_saved_bytes_per_sample: float = 0.0
    selective_sharded_bytes_per_sample: float = 0.0
    selective_recompute_flops_per_sample: float = 0.0
    selective_recompute_bytes_per_sample: float = 0.0
    selective_recompute_sharded_bytes_per_sample: float = 0.0
    alternate_saved_bytes_per_sample: float = 0.0
    alternate_sharded_bytes_per_sample: float = 0.0
    alternate_recompute_flops_per_sample: float = 0.0
    alternate_recompute_bytes_per_sample: float = 0.0
    alternate_recompute_sharded_bytes_per_sample: float = 0.0
    # parameters shared with the model's other end (tied input/output embeddings): under a pipeline the
    # first and last stage each hold them and sum their gradients; ``tied_borrowed`` marks the end
    # that does not own them (its param_count leaves them out; :meth:`LayerGraph.pipeline_view` adds them)
    tied_params: tuple[str, ...] = ()
    tied_param_count: int = 0
    tied_param_bytes: int = 0
    tied_borrowed: bool = False
    # the layer call's kernels (GEMM shapes, attention, memory-bound bytes) for the per-op compute
    # model (cost_models.compute); graphs captured before these were recorded load with none and
    # price by their FLOPs
    ops: tuple[OpRecord, ...] = ()
    # the layer's mixture-of-experts blocks (autopar.experts), and the compute-like ops no FLOP rule counted
    # (their work is not in flops_per_sample: the plan's notes name them)
    moe: tuple[MoEFacts, ...] = ()
    unpriced_ops: tuple[str, ...] = ()
    # K and V bytes per sample (whole sequence, captured dtype) of the layer's attention calls: what cp
    # all-gathers (capturing.context)
    kv_bytes_per_sample: float = 0.0
    attention_calls: int = 0  # its SDPA calls: under cp each saves its prefix causal masks as biases
    # Q and output bytes per sample (whole sequence) of those calls and of attention written by hand, and
    # their key/value head counts (by hand: the heads of q, kᵀ and v): what cp's head all-to-all (Ulysses)
    # moves, and what its degree must divide (empty: not recorded)
    qo_bytes_per_sample: float = 0.0
    kv_heads: tuple[int, ...] = ()

    def tp_style(self, name: str) -> TPStyle:
        for style in self.tp_styles:
            if style.name == name:
                return style
        why = f" ({self.tp_refusal})" if self.tp_refusal else ""
        raise KeyError(f"layer {self.name!r} has no tensor-parallel style {name!r}{why}")

    def cost_signature(self) -> tuple:
        """What the cost model sees of this layer: equal signatures price the same."""
        return (
            round(self.flops_per_sample, 3),
            self.param_count,
            self.param_bytes,
            round(self.activation_bytes_per_sample, 3),
            round(self.input_bytes_per_sample, 3),
            round(self.glue_saved_bytes_per_sample, 3),
            round(self.selective_saved_bytes_per_sample, 3),
            round(self.selective_sharded_bytes_per_sample, 3),
            round(self.selective_recompute_flops_per_sample, 3),
            round(self.selective_recompute_bytes_per_sample, 3),
            round(self.selective_recompute_sharded_bytes_per_sample, 3),
            round(self.alternate_saved_bytes_per_sample, 3), round(self.alternate_sharded_bytes_per_sample, 3),
            round(self.alternate_recompute_flops_per_sample, 3), round(self.alternate_recompute_bytes_per_sample, 3),
            round(self.alternate_recompute_sharded_bytes_per_sample, 3),
            tuple(s.cost_signature() for s in self.tp_styles),
            len(self.param_names),
            tuple(o.signature() for o in self.ops),
            self.sync_norm_channels, bool(self.recompute_refusal),
            tuple(m.signature() for m in self.moe), self.unpriced_ops, round(self.kv_bytes_per_sample, 3),
            self.attention_calls, round(self.qo_bytes_per_sample, 3), self.kv_heads,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tp_styles"] = [s.to_dict() for s in self.tp_styles]
        d["param_names"] = list(self.param_names)
        d["tied_params"] = list(self.tied_params)
        d["ops"] = [o.to_dict() for o in self.ops]
        d["moe"] = [m.to_dict() for m in self.moe]
        d["unpriced_ops"] = list(self.unpriced_ops)
        d["kv_heads"] = list(self.kv_heads)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layer:
        d = dict(d)
        d["tp_styles"] = tuple(TPStyle.from_dict(s) for s in d.get("tp_styles", ()))
        d["param_names"] = tuple(d.get("param_names", ()))
        d["tied_params"] = tuple(d.get("tied_params", ()))
        d["sync_norm_channels"] = tuple(d.get("sync_norm_channels", ()))
        d["ops"] = tuple(OpRecord.from_dict(o) for o in d.get("ops", ()))
        d["moe"] = tuple(MoEFacts.from_dict(m) for m in d.get("moe", ()))
        d["unpriced_ops"] = tuple(d.get("unpriced_ops", ()))
        d["kv_heads"] = tuple(d.get("kv_heads", ()))
        return cls(**d)


class LayerGraph:
    """The captured model: layers in execution order plus their dataflow.

    ``graph`` is a networkx DiGraph whose nodes are layer names (attribute
    ``layer``) and whose edges carry ``bytes_per_sample`` of the tensors that
    flow from one layer to a later one. ``example_batch`` is the dim-0 size of
    the example inputs the costs were divided by; ``dtype_bytes`` the element
    size of the captured floating-point dtype. ``output_bytes_per_sample`` is
    the model's first floating-point output (the logits a loss reads), whose
    loss keeps a same-sized tensor for backward. ``loss_head`` is the plain linear head whose output
    that is (:class:`~autopar.loss_head.LossHead`, what the chunked loss runs in chunks), None with
    ``loss_refusal`` saying why there is none.
    """

    def __init__(
        self,
        layers: list[Layer],
        *,
        model_name: str,
        example_batch: int,
        dtype_bytes: int,
        edges: list[tuple[str, str, float]] | None = None,
        tracer: str = "",
        seq_len: int | None = None,
        output_bytes_per_sample: float = 0.0,
        cp_refusal: str = NOT_CHECKED_FOR_CP,
        cp_positions: tuple[str, ...] = (),
        cp_attention: tuple[str, ...] = (),
        cp_manual: dict[str, Any] | None = None,
        loss_head: LossHead | None = None,
        loss_refusal: str = NOT_CHECKED,
    ):
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        self.layers = list(layers)
        self.model_name = model_name
        self.example_batch = example_batch
        self.dtype_bytes = dtype_bytes
        self.tracer = tracer
        self.seq_len = seq_len
        self.output_bytes_per_sample = output_bytes_per_sample
        self.cp_refusal = cp_refusal  # why cp cannot split the sequence ("" when it can: capturing.context)
        self.cp_positions = tuple(cp_positions)  # modules the runtime hands global positions under cp
        self.cp_attention = tuple(cp_attention)  # the innermost modules calling SDPA (their forward is cp's)
        # of those, the ones running attention by hand (capturing.manual_attention): path → its positional
        # inputs' (shape, dtype), None for one that is not a tensor (what the lowering proves them on)
        self.cp_manual: dict[str, tuple] = {k: tuple(None if a is None else (tuple(a[0]), a[1]) for a in v)
                                            for k, v in (cp_manual or {}).items()}
        self.loss_head = loss_head
        self.loss_refusal = "" if loss_head is not None else loss_refusal
        self._edges = list(edges or [])
        self._by_name = {layer.name: layer for layer in self.layers}

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The dataflow as a networkx DiGraph, built when first read: planning never reads it, and
        importing networkx is a tenth of a second of every ``autopar plan``."""
        import networkx as nx

        graph = nx.DiGraph()
        for layer in self.layers:
            graph.add_node(layer.name, layer=layer)
        for src, dst, nbytes in self._edges:
            graph.add_edge(src, dst, bytes_per_sample=nbytes)
        return graph

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __getitem__(self, index: int) -> Layer:
        return self.layers[index]

    def __repr__(self) -> str:
        return (
            f"LayerGraph({self.model_name}, {len(self.layers)} layers, "
            f"{self.total_params / 1e6:.1f}M params, "
            f"{self.total_flops_per_sample / 1e9:.2f} GFLOP/sample fwd)"
        )

    @property
    def total_params(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    @property
    def total_flops_per_sample(self) -> float:
        return sum(layer.flops_per_sample for layer in self.layers)

    @cached_property
    def cost_classes(self) -> tuple[int, ...]:
        """Per layer, a class id shared by layers that price alike (the repeated blocks)."""
        ids: dict[tuple, int] = {}
        return tuple(
            ids.setdefault(l.cost_signature() + (l.boundary_bytes_per_sample,), len(ids))
            for l in self.layers
        )

    @cached_property
    def repeated(self) -> tuple[bool, ...]:
        """Per layer, whether its cost class occurs more than once (a block): the runtime gives
        each such layer an FSDP unit of its own and gathers the others into the root unit."""
        counts = Counter(self.cost_classes)
        return tuple(counts[c] > 1 for c in self.cost_classes)

    @cached_property
    def blocks(self) -> tuple[bool, ...]:
        """Per layer, whether it is a block of the stack with a module of its own: what
        ``torch_compile`` compiles one by one (autopar.runtime.compiled) and pricing prices compiled.

        A repeated layer (:attr:`repeated`) with a module, or a layer whose module is one item of a
        stack (``<stack>.<i>``) of which another item is a layer with the same parameter count and
        FLOPs: a Hugging Face decoder's first layer is charged the rotary cos/sin its siblings share
        (its activation and boundary bytes differ), so its cost class is its own, yet it is the same
        module run on the same shapes."""
        def stack_key(layer: Layer) -> tuple | None:
            head, _, tail = (layer.module_path or "").rpartition(".")
            if not head or not tail.isdigit():
                return None
            return head, layer.param_count, round(layer.flops_per_sample, 3)

        keys = [stack_key(l) for l in self.layers]
        counts = Counter(k for k in keys if k is not None)
        return tuple(bool(l.module_path) and (rep or (k is not None and counts[k] > 1))
                     for l, rep, k in zip(self.layers, self.repeated, keys))

    def layer(self, name: str) -> Layer:
        return self._by_name[name]

    def pipeline_view(self) -> LayerGraph:
        """The graph as a pipeline (pp > 1) runs it: the end that borrows tied parameters holds them
        too (their memory, optimizer state and gradient are its stage's). Cached; ``self`` when no
        layer borrows."""
        cached = self.__dict__.get("_pipeline_view")
        if cached is not None:
            return cached
        if not any(l.tied_borrowed for l in self.layers):
            view = self
        else:
            layers = [dataclasses.replace(l, param_count=l.param_count + l.tied_param_count,
                                          param_bytes=l.param_bytes + l.tied_param_bytes,
                                          param_names=l.param_names + l.tied_params)
                      if l.tied_borrowed else l for l in self.layers]
            view = LayerGraph(layers, model_name=self.model_name, example_batch=self.example_batch,
                              dtype_bytes=self.dtype_bytes, tracer=self.tracer, seq_len=self.seq_len,
                              output_bytes_per_sample=self.output_bytes_per_sample,
                              cp_refusal=self.cp_refusal, cp_positions=self.cp_positions,
                              cp_attention=self.cp_attention, cp_manual=self.cp_manual,
                              loss_head=self.loss_head, loss_refusal=self.loss_refusal,
                              edges=[(u, v, d["bytes_per_sample"]) for u, v, d in self.graph.edges(data=True)])
        self.__dict__["_pipeline_view"] = view
        return view

    def fingerprint(self) -> str:
        """A stable hash of the structure and costs: plans are bound to it."""
        payload = json.dumps(
            [
                [l.name, l.kind, l.param_count, round(l.flops_per_sample), l.can_cut_after]
                for l in self.layers
            ],
            sort_keys=True,
        )
        return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "example_batch": self.example_batch,
            "dtype_bytes": self.dtype_bytes,
            "tracer": self.tracer,
            "seq_len": self.seq_len,
            "output_bytes_per_sample": self.output_bytes_per_sample,
            "cp_refusal": self.cp_refusal,
            "cp_positions": list(self.cp_positions),
            "cp_attention": list(self.cp_attention),
            "cp_manual": {k: [None if a is None else [list(a[0]), a[1]] for a in v] for k, v in self.cp_manual.items()},
            "loss_head": self.loss_head.to_dict() if self.loss_head is not None else None,
            "loss_refusal": self.loss_refusal,
            "layers": [layer.to_dict() for layer in self.layers],
            "edges": [[u, v, d["bytes_per_sample"]] for u, v, d in self.graph.edges(data=True)],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerGraph:
        return cls(
            [Layer.from_dict(x) for x in d["layers"]],
            model_name=d["model_name"],
            example_batch=d["example_batch"],
            dtype_bytes=d["dtype_bytes"],
            edges=[tuple(e) for e in d.get("edges", [])],
            tracer=d.get("tracer", ""),
            seq_len=d.get("seq_len"),
            output_bytes_per_sample=d.get("output_bytes_per_sample", 0.0),
            cp_refusal=d.get("cp_refusal", NOT_CHECKED_FOR_CP),
            cp_positions=tuple(d.get("cp_positions", ())),
            cp_attention=tuple(d.get("cp_attention", ())),
            cp_manual=d.get("cp_manual", {}),
            loss_head=LossHead.from_dict(d["loss_head"]) if d.get("loss_head") else None,
            loss_refusal=d.get("loss_refusal", NOT_CHECKED),
        )
