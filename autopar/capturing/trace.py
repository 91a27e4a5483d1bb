"""Capture: trace a model into a LayerGraph of layers with costs per sample.

We trace with ``torch.fx.symbolic_trace`` and fall back to
``torch.export.export(strict=False)`` (Hugging Face models need it:
:mod:`~autopar.capturing.tracing`). Nodes are
grouped into layers by ``nn_module_stack``; then the graph is executed once on
the example inputs (meta tensors are the normal case, so a 175B model costs
nothing) while counting FLOPs and the tensors autograd saves for backward, per
node. Layer costs, dataflow between layers and tensor-parallel styles all come
from that one measured run.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from autopar.capturing import boundary, context, cuts, hf_masks, moe, op_costs, torch_transformer, twins
from autopar.capturing.export_layers import export_with_layer_calls
from autopar.capturing.layers import group_layers, layer_names
from autopar.capturing.loss_head import find_loss_head
from autopar.capturing.op_costs import OpRecorder, extra_flop_rules, layer_ops, selective_costs
from autopar.capturing.stateful import batch_norm_channels, recompute_refusal
from autopar.capturing.tracing import _leaf_trace, _short, _split_inputs, _trace
from autopar.errors import CaptureError
from autopar.graph import Layer, LayerGraph
from autopar.sharding import experts
from autopar.sharding.detect import LayerView, NodeStats, detect_tp_styles, embedding_tables, megatron_refusal
from autopar.sharding.verify import verify_styles

# --------------------------------------------------------------------------- measuring


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """An identity for ``t``'s storage that also works on meta tensors (views share it)."""
    try:
        s = t.untyped_storage()
        return s._cdata, int(s.nbytes())
    except Exception:  # noqa: BLE001 - tensors without storage count by their own size
        return id(t), t.numel() * t.element_size()


def _is_sdpa(node: fx.Node) -> bool:
    return "scaled_dot_product_attention" in str(getattr(node.target, "__name__", node.target))


def _sdpa_flops(n: fx.Node, interp: fx.Interpreter) -> float:
    """Attention-core FLOPs (QK^T and PV) by formula: CPU's fused kernel is not counted by torch."""
    args, _ = interp.fetch_args_kwargs_from_env(n)
    q, k, v = args[:3]
    batch_heads = q.numel() // (q.shape[-1] * q.shape[-2])
    return float(2 * batch_heads * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))


class _TwinLayers:
    """Follows the meter from layer to layer: records measured layers, replays their twins.

    On entering a layer it computes the layer's signature (structure plus
    input metadata, :mod:`autopar.capturing.twins`); if a measured layer had the same
    one, the layer's stats are set from it and its nodes are not executed.
    Otherwise the layer runs and, on leaving it, becomes a record — unless it
    touched real data or changed its inputs' metadata in place.
    """

    def __init__(self, runs: list[tuple[str | None, list[fx.Node]]], node_layer: dict[fx.Node, int]):
        self.runs = runs
        self.node_layer = node_layer
        self.records: dict[tuple, list[twins.LayerRecord]] = {}
        self.layer: int | None = None
        self.replayed: dict[fx.Node, Any] | None = None
        self.recording: tuple[tuple, list, list[torch.Tensor]] | None = None
        self.op_costs: dict[int, list] = {}  # id(record) → its nodes' selective-recompute costs

    def real_data_seen(self) -> None:
        """A value with real data: its layer's results may depend on data, never reuse them."""
        self.recording = None

    def step(self, meter: _Meter, n: fx.Node) -> tuple[bool, Any]:
        """Before node ``n`` runs: (True, its value) if its layer is replayed, else (False, None)."""
        layer = self.node_layer.get(n)
        if layer != self.layer and (layer is not None or n.op == "output"):
            self._leave(meter)
            if layer is not None:
                self._enter(meter, layer)
        if self.replayed is not None and layer is not None:
            return True, self.replayed.get(n)
        return False, None

    def _enter(self, meter: _Meter, layer: int) -> None:
        self.layer = layer
        key, nodes = self.runs[layer]
        try:
            static, ext_nodes = twins.static_signature(meter.module, key, nodes)
            values = [self._input_value(meter, e) for e in ext_nodes]
            inputs_sig, inputs = twins.input_signature(values, meter.state_keys)
        except Exception:  # noqa: BLE001 - anything unusual: measure the layer, record nothing
            return
        signature = (static, inputs_sig)
        for record in self.records.get(signature, []):
            try:
                self.replayed = twins.replay(record, nodes, inputs, meter)
                meter.ops.adopt(nodes, self.op_costs.get(id(record), ()))
                return
            except Exception:  # noqa: BLE001 - this record cannot serve; try the next or execute
                continue
        self.recording = (signature, values, inputs)

    @staticmethod
    def _input_value(meter: _Meter, node: fx.Node) -> Any:
        """The value of an input of the layer being entered (a get_attr may sit later in the graph)."""
        if node in meter.env:
            return meter.env[node]
        if node.op == "get_attr":
            return meter.fetch_attr(str(node.target))
        raise twins.NotReplayable(f"input {node.name} has no value yet")

    def _leave(self, meter: _Meter) -> None:
        if self.recording is not None and self.layer is not None:
            signature, values, inputs = self.recording
            try:
                if twins.input_signature(values, meter.state_keys)[0] != signature[1]:
                    raise twins.NotReplayable("the layer changed its inputs in place")
                record = twins.make_record(signature, self.runs[self.layer][1], inputs, meter)
                self.records.setdefault(signature, []).append(record)
                self.op_costs[id(record)] = [meter.ops.costs.get(n) for n in self.runs[self.layer][1]]
            except Exception:  # noqa: BLE001 - not a usable record; the measurement stands
                pass
        self.layer = self.replayed = self.recording = None


class _Meter(fx.Interpreter):
    """Executes the graph once, measuring FLOPs and saved activations per node.

    Saved tensors are attributed to the node running when autograd packs them,
    each storage once over the whole run; parameter and buffer storages are
    model state, not activations. Packed tensors are kept alive so a storage
    address cannot be reused by another tensor during the run.
    """

    def __init__(self, gm: fx.GraphModule, state_keys: set[int], runs: list[tuple[str | None, list[fx.Node]]],
                 node_layer: dict[fx.Node, int], replay: bool = True, stand_ins: dict | None = None):
        super().__init__(gm, garbage_collect_values=True)
        self.stand_ins = stand_ins or {}  # MoE block path → moe.Block, run by moe.stand_in on meta
        self.stats: dict[fx.Node, NodeStats] = {}
        self.state_keys = state_keys
        self.seen: set[Any] = set()
        self.producer: dict[Any, fx.Node] = {}
        self.keep: list[torch.Tensor] = []
        self.current: fx.Node | None = None
        self.counter = FlopCounterMode(display=False, custom_mapping=extra_flop_rules())
        # every save attempt per node, (storage key, bytes, producer), for twin replay
        self.events: dict[fx.Node, list[twins.Event]] = {}
        self.twins = _TwinLayers(runs, node_layer) if replay else None
        # what selective recompute keeps and re-runs, per node (fused attention: see _run_sdpa)
        self.ops = OpRecorder(lambda: None if self.current is None or _is_sdpa(self.current) else self.current,
                              self.counter.get_total_flops, _storage_key)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage_key(t)
        node = self.current
        if node is None:
            return t
        self.events.setdefault(node, []).append((key, float(nbytes), self.producer.get(key, node)))
        if key in self.state_keys or key in self.seen:
            return t
        self.seen.add(key)
        self.keep.append(t)
        self.stats[node].saved.append((float(nbytes), self.producer.get(key, node)))
        return t

    def _note(self, t: torch.Tensor) -> None:
        """Remember that the current node produced ``t``'s storage (first producer wins)."""
        key, _ = _storage_key(t)
        if key not in self.producer:
            self.producer[key] = self.current  # type: ignore[assignment]
            self.keep.append(t)  # pin the storage: its address must not be reused this run

    def run_node(self, n: fx.Node) -> Any:
        if self.twins is not None:
            replayed, value = self.twins.step(self, n)
            if replayed:
                return value
        self.current = n
        st = self.stats[n] = NodeStats(paths=twins.stack_paths(n))
        before = self.counter.get_total_flops()
        if _is_sdpa(n):
            result = self._run_sdpa(n)
        elif n.op == "call_module" and n.target in self.stand_ins:
            args, _ = self.fetch_args_kwargs_from_env(n)
            block = self.stand_ins[n.target]
            result = (moe.stand_in(self.module.get_submodule(n.target), block, args[0])
                      if args[0].is_meta else super().run_node(n))
        else:
            result = super().run_node(n)
        st.flops = float(self.counter.get_total_flops() - before)
        if _is_sdpa(n) and isinstance(result, torch.Tensor):
            st.flops = _sdpa_flops(n, self)
            self.ops.record_attention(n, st.flops)
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self._note(t)
                st.holds_tensor = True
                if not t.is_meta and self.twins is not None:
                    self.twins.real_data_seen()
        if isinstance(result, torch.Tensor):
            st.is_tensor = True
            st.out_numel = result.numel()
            st.out_bytes = result.numel() * result.element_size()
            st.out_last_dim = int(result.shape[-1]) if result.dim() else None
            st.out_first_dim = int(result.shape[0]) if result.dim() else None
            st.out_floating = result.is_floating_point()
        elif st.holds_tensor:
            st.unsendable = boundary.describe(result)
            leaves = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
            st.leaf_bytes = sum(t.numel() * t.element_size() for t in leaves)
            st.leaf_first_dims = tuple(int(t.shape[0]) if t.dim() else None for t in leaves)
        self.current = None
        return result

    def _run_sdpa(self, n: fx.Node) -> Any:
        """SDPA as a fused kernel saves q, k, v, out and logsumexp, not the T×T matrix, and an
        explicit ``attn_mask`` (T×T) as its bias.

        The meta math path would save the attention probabilities; GPUs run
        flash/efficient attention, and CPU (torch 2.13, no dropout) its own flash
        kernel, which save these (checked with saved-tensor hooks on CPU).
        """
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            result = super().run_node(n)
        if not isinstance(result, torch.Tensor) or not result.requires_grad:
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        for t in [*args[:3], result]:
            if isinstance(t, torch.Tensor):
                self._pack(t)
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            # the kernels save a boolean mask as an additive bias in q's dtype, a new tensor per call
            # (CPU's flash kernel, checked on torch 2.13; CUDA's memory-efficient kernel likewise)
            bias_bytes = float(mask.numel() * args[0].element_size())
            self.stats[n].saved.append((bias_bytes, n))
            self.events.setdefault(n, []).append((None, bias_bytes, n))
        elif isinstance(mask, torch.Tensor):
            self._pack(mask)  # a float mask is saved as given (shared storages counted once)
        lse_bytes = result.numel() // max(int(result.shape[-1]), 1) * 4
        self.stats[n].saved.append((float(lse_bytes), n))
        self.ops.keep_fused(n, result, lse_bytes)  # selective recompute keeps the kernel's outputs
        self.events.setdefault(n, []).append((None, float(lse_bytes), n))
        return result

    def measure(self, flat_inputs: list) -> dict[fx.Node, NodeStats]:
        with self.counter, self.ops, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            with torch.enable_grad():
                self.run(*flat_inputs, enable_io_processing=False)
        self.keep.clear()
        self.producer.clear()
        return self.stats


def _state_keys(model: nn.Module, gm: fx.GraphModule) -> set[int]:
    keys = set()
    for mod in (model, gm):
        for t in [*mod.parameters(), *mod.buffers()]:
            keys.add(_storage_key(t)[0])
    return keys


# --------------------------------------------------------------------------- costs


def _param_owners(
    model: nn.Module, gm: fx.GraphModule, runs: list[tuple[str | None, list[fx.Node]]], node_layer: dict[fx.Node, int]
) -> tuple[dict[str, int], dict[str, set[int]]]:
    """Canonical parameter FQN → owning layer index (module prefix first, else first user),
    and → every layer that uses it (more than one for tied weights)."""
    canon = dict(model.named_parameters())
    by_id = {id(p): name for name, p in canon.items()}
    alias = {n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in by_id}
    owners: dict[str, int] = {}
    for name in canon:
        for i, (key, _) in enumerate(runs):
            if key is not None and name.startswith(key + "."):
                owners[name] = i
                break
    users: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        used: list[tuple[str, list[int]]] = []
        if node.op == "get_attr":
            used.append((str(node.target), [node_layer[u] for u in node.users if u in node_layer]))
        elif node.op == "call_module" and node in node_layer:
            sub = gm.get_submodule(str(node.target))
            used += [(f"{node.target}.{n}", [node_layer[node]]) for n, _ in sub.named_parameters()]
        for fqn, layers in used:
            name = alias.get(fqn)
            if name is not None and layers:
                users.setdefault(name, set()).update(layers)
    for name in canon:
        if name not in owners:
            owners[name] = min(users.get(name, {0}))
    return owners, users


def _dtype_bytes(model: nn.Module, flat_inputs: list) -> int:
    dtypes = Counter(p.dtype for p in model.parameters() if p.is_floating_point())
    if dtypes:
        return dtypes.most_common(1)[0][0].itemsize
    for t in flat_inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.element_size()
    return 4


def _output_bytes(gm: fx.GraphModule, stats: dict[fx.Node, NodeStats]) -> int:
    """Bytes of the model's first floating-point output (what the loss reads: logits, ``.logits``)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for leaf in pytree.tree_leaves(out.args):
        st = stats.get(leaf) if isinstance(leaf, fx.Node) else None
        if st is not None and st.is_tensor and st.out_floating:
            return st.out_bytes
    return 0


def _batch_and_seq(flat_inputs: list) -> tuple[int, int | None]:
    tensors = [t for t in flat_inputs if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise CaptureError("example inputs need a tensor with a batch dimension (dim 0)")
    ints = [t for t in tensors if not t.is_floating_point() and not t.is_complex() and t.dim() >= 2]
    return int(tensors[0].shape[0]), (int(ints[0].shape[1]) if ints else None)


def capture(
    model: nn.Module,
    example_inputs: tuple | dict | torch.Tensor,
    *,
    name: str | None = None,
    replay_twins: bool = True,
    trace_once_per_kind: bool = True,
) -> LayerGraph:
    """Trace ``model`` on ``example_inputs`` (meta is fine) into a LayerGraph with per-sample costs.

    ``replay_twins=False`` executes every layer instead of replaying layers identical to one already measured (see
    :mod:`autopar.capturing.twins`); the result is the same, only slower — kept for testing that claim; so is
    ``trace_once_per_kind=False`` (export every block of a stack, not one per kind:
    :mod:`autopar.capturing.stack_once`).

    Hugging Face's causal masks are traced as eager mode runs them (SDPA's ``is_causal``, no S × S tensor:
    :mod:`autopar.capturing.hf_masks`); PyTorch's ``nn.TransformerEncoder`` and kin as a training step runs
    them, each block a layer (:mod:`autopar.capturing.torch_transformer`).

    Mixture-of-experts blocks (:mod:`autopar.capturing.moe`) are recorded on their layers (``Layer.moe``); Hugging
    Face's eager experts are captured through HF's ``grouped_mm`` path, and where the graph cannot run a block's
    routing loop on the example inputs, the blocks are traced whole and run as a balanced stand-in.
    """
    args, kwargs = _split_inputs(model, example_inputs)
    blocks = moe.find_blocks(model)
    with (moe.static_hf_experts(model) as hf_static, hf_masks.eager_causal_masks(model, args, kwargs),
          torch_transformer.as_training_runs(model)):
        try:
            return _capture(model, args, kwargs, name, replay_twins, trace_once_per_kind, blocks, hf_static)
        except CaptureError as first:
            if not blocks:
                raise
            try:
                return _capture(model, args, kwargs, name, replay_twins, trace_once_per_kind, blocks, hf_static,
                                stand_in=True)
            except CaptureError:
                raise first from None  # the model's own failure, not the stand-in's


def _capture(model: nn.Module, args: tuple, kwargs: dict, name: str | None, replay_twins: bool,
             trace_once_per_kind: bool, blocks: list[moe.Block], hf_static: set[str],
             stand_in: bool = False) -> LayerGraph:
    if stand_in:
        gm, flat, tracer = _leaf_trace(model, args, kwargs, {b.path for b in blocks})
    else:
        gm, flat, tracer = _trace(model, args, kwargs, once_per_kind=trace_once_per_kind)
    runs, node_layer = group_layers(gm, model)
    if not runs:
        raise CaptureError(f"cannot capture {type(model).__name__}: the traced graph computes nothing")
    try:
        meter = _Meter(gm, _state_keys(model, gm), runs, node_layer, replay=replay_twins,
                       stand_ins={b.path: b for b in blocks} if stand_in else None)
        stats, ops = meter.measure(flat), meter.ops.costs
    except Exception as exc:  # noqa: BLE001
        raise CaptureError(
            f"cannot capture {type(model).__name__}: running the {tracer} graph on the example inputs "
            f"failed: {_short(exc)}"
        ) from exc
    batch, seq_len = _batch_and_seq(flat)
    dtype_bytes = _dtype_bytes(model, flat)
    n = len(runs)
    names = layer_names(runs)
    owners, users = _param_owners(model, gm, runs, node_layer)
    params = dict(model.named_parameters())
    inputs, boundary, cut_ok, edges, blocked = cuts.layer_costs(cuts.crossings(gm, node_layer, stats, n, batch),
                                                                 n, names)
    cuts.block_buffer_writes(gm, node_layer, names, cut_ok, blocked)
    tied: dict[int, list[str]] = {}
    first_owner = min(owners.values(), default=0)
    for pname, layers in users.items():
        if len(layers) == 2 and sorted(layers) == [first_owner, n - 1] and owners[pname] == first_owner:
            # input and output embeddings tied (nanoGPT's, GPT-2's): the first and last stage each
            # hold the weight and sum its gradients (Megatron-LM's embedding group); cuts stay free
            tied.setdefault(first_owner, []).append(pname)
            tied.setdefault(n - 1, []).append(pname)
            continue
        middle = sorted(set(layers) - {first_owner, n - 1})
        if middle and {first_owner, n - 1} <= layers and owners[pname] == first_owner:
            # read by the input embedding, the head and layers between (T5's shared embedding: its
            # decoder's too): the two ends hold it as above, and each reader between keeps one stage
            # with the nearer end, so every reader sits on the first or the last stage
            tied.setdefault(first_owner, []).append(pname)
            tied.setdefault(n - 1, []).append(pname)
            span = (range(first_owner, middle[-1]) if middle[-1] - first_owner <= n - 1 - middle[0]
                    else range(middle[0], n - 1))
            for i in span:
                if cut_ok[i] and i not in blocked:
                    blocked[i] = (f"{pname} is tied between layers {names[first_owner]}, "
                                  f"{', '.join(names[j] for j in middle)} and {names[n - 1]}: a tied weight's "
                                  "readers must sit on the first or the last stage")
                cut_ok[i] = False
            continue
        for i in range(min(layers), max(layers)):  # any other tie keeps its layers in one stage
            if cut_ok[i] and i not in blocked:
                blocked[i] = (f"{pname} is tied between layers "
                              f"{', '.join(names[j] for j in sorted(layers))}, which must share a stage")
            cut_ok[i] = False
    layers = []
    tables = embedding_tables(model)
    for i, (key, nodes) in enumerate(runs):
        mine = [p for p, owner in owners.items() if owner == i]
        view = LayerView(model, key, nodes, stats, batch, dtype_bytes, tables)
        moe_facts = _moe_facts(key, nodes, stats, ops, blocks, hf_static, stand_in, batch)  # + experts split:
        styles = experts.draft(model, detect_tp_styles(view), moe_facts)
        sac = selective_costs(key, nodes, ops, lambda x: stats[x].paths, styles, batch)
        layers.append(
            Layer(
                name=names[i],
                index=i,
                kind=type(model.get_submodule(key)).__name__ if key is not None else "glue",
                flops_per_sample=sum(stats[x].flops for x in nodes) / batch,
                param_count=sum(params[p].numel() for p in mine),
                param_bytes=sum(params[p].numel() * params[p].element_size() for p in mine),
                activation_bytes_per_sample=sum(b for x in nodes for b, _ in stats[x].saved) / batch,
                input_bytes_per_sample=inputs[i] / batch,
                boundary_bytes_per_sample=boundary[i] / batch,
                can_cut_after=cut_ok[i],
                tp_styles=styles,
                param_names=tuple(mine),
                module_path=key,
                glue_saved_bytes_per_sample=sum(b for x in nodes if key not in stats[x].paths
                                                for b, _ in stats[x].saved) / batch if key else 0.0,
                cut_blocked_by=blocked.get(i, ""),
                tp_refusal="" if any(s.name == "megatron" for s in styles) else megatron_refusal(view),
                recompute_refusal=recompute_refusal(model, key),
                sync_norm_channels=batch_norm_channels(model, key),
                **sac.layer_fields(),
                tied_params=tuple(tied.get(i, ())),
                tied_param_count=sum(params[p].numel() for p in tied.get(i, ())),
                tied_param_bytes=sum(params[p].numel() * params[p].element_size() for p in tied.get(i, ())),
                tied_borrowed=i == n - 1 and bool(tied.get(i)) and n - 1 != first_owner,
                ops=layer_ops(nodes, ops, lambda x: stats[x].paths, styles, batch),
                moe=moe_facts,
                unpriced_ops=tuple(sorted({op for x in nodes if x in ops for op in ops[x].unpriced})),
            )
        )
    layers = experts.settle(verify_styles(model, args, kwargs, layers, batch, seq_len))
    # a block run as a stand-in is not the layer's program: where the inputs were real, the styles were
    # proved on the block itself (verify_styles runs the model's own modules: its routing loop, its experts
    # whole on every rank); on meta nothing ran the loop, so none is offered
    if stand_in and any(t.is_meta for t in flat if isinstance(t, torch.Tensor)):
        layers = [dataclasses.replace(l, tp_styles=(), tp_refusal=f"tensor parallelism withdrawn: "
                                      f"{l.moe[0].module_path} is traced whole (its routing loop cannot run "
                                      "on the meta device)") if l.moe else l for l in layers]
    layers, facts = context.probe_layers(model, args, kwargs, seq_len, batch, layers)  # what cp needs
    calls = gm.meta.get("layer_calls") if tracer == "export" else False  # known from stack_once
    if calls or (calls is None and
                 export_with_layer_calls(model, args, kwargs, {k for k, _ in runs if k}) is not None):
        tracer = "export-layers"  # pipeline stages can call the layer modules (TP, recompute, FSDP per layer)
    head, no_head = find_loss_head(model, args, kwargs, layers[-1])  # what the chunked loss runs on
    return LayerGraph(
        layers, model_name=name or type(model).__name__, example_batch=batch, dtype_bytes=dtype_bytes,
        edges=[(names[a], names[b], v / batch) for (a, b), v in edges.items()],
        tracer=tracer, seq_len=seq_len,
        output_bytes_per_sample=_output_bytes(gm, stats) / batch,
        loss_head=head, loss_refusal=no_head,
        **facts.graph_fields(),
    )


def _moe_facts(key: str | None, nodes: list[fx.Node], stats: dict[fx.Node, NodeStats], ops: dict,
               blocks: list[moe.Block], hf_static: set[str], stand_in: bool, batch: int) -> tuple:
    """The MoE blocks inside layer ``key``: how their dispatch was captured, what their experts saved."""
    facts = []
    for b in blocks:
        if key is None or not (b.path == key or b.path.startswith(key + ".")):
            continue
        under = b.path if stand_in else b.experts_path  # a stand-in is one node: the whole block
        inside = [x for x in nodes if any(p == under or p.startswith(under + ".") for p in stats[x].paths)]
        grouped = any(g in op_costs.GROUPED_MM_OPS for x in inside if x in ops for g in ops[x].op_names)
        dispatch = (moe.Dispatch.STAND_IN if stand_in else moe.Dispatch.GROUPED if grouped
                    else moe.Dispatch.CAPACITY if b.capacity_factor is not None else moe.Dispatch.LOOP)
        dispatch = moe.Dispatch.HF_EAGER if b.experts_path in hf_static else dispatch
        saved = sum(nb for x in inside for nb, _ in stats[x].saved) / batch
        facts.append(b.facts(dispatch, saved))
    return tuple(facts)


__all__ = ["capture"]
