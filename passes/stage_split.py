"""Stage split: cut a traced model into one module per virtual pipeline stage.

Takes the model, example inputs shaped like one *microbatch* (an
export-captured graph specialises on the batch size), the LayerGraph and the
Plan. Returns one ``torch.fx.GraphModule`` per virtual stage ``0 … pp·chunks−1``:
stage k's ``forward`` takes the values that cross into it (stage 0: the
model's inputs, in ``forward``'s order) and returns those that cross out,
in graph order (one value bare, several as a tuple; the last stage returns
the model's output, a one-element output unwrapped). A value that is a
tuple, dict, dataclass or ``ModelOutput`` crosses as its tensor leaves, made
contiguous, and is rebuilt on the receiving stage
(:mod:`autopar.capturing.boundary`); an element taken from a layer's tuple
output travels alone.

What stays true:

* **Same parameter objects, same names.** A stage is
  ``GraphModule(traced_root, stage_graph)``, which copies in exactly the
  submodules and attributes its nodes use *by reference* under their
  original paths, so ``stage.named_parameters()`` yields the model's own
  ``Parameter`` objects under their original FQNs (``blocks.0.attn.c_attn.weight``),
  and passes applied by module path (tensor parallel, checkpoint, FSDP) act
  on the model's modules. Intermediate containers (``blocks``) are fresh,
  empty ``nn.Module`` s.
* **Layer modules are called** when the model is FX-traceable with each layer
  kept as one ``call_module`` node, or exported with the layers' call
  signatures kept (``StageSplit.layers_called``): hooks on them run. Where
  export cannot keep them, a stage is ATen ops on ``get_attr`` parameters and
  no layer module is ever called.
* A parameter is used by one stage only, but tied input/output embeddings,
  which the first and last stage both hold (``passes/tied.py`` sums their
  gradients); any other tie across a cut is a :class:`LoweringError`.
  Buffers and constants may be read by several stages.

Why not ``torch.fx.passes.split_module``: it flattens every qualified name
(``blocks.0.attn`` becomes ``blocks_0_attn``), which breaks FQNs and the
module-path passes. Why not ``torch.distributed.pipelining.pipeline``: it
exports strictly with its own split points and moves parameters into new
submodules. The cut here is ~40 lines over the capture's own node→layer map.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.nn as nn

from autopar.capturing import trace_layers
from autopar.capturing.boundary import check_sendable, crossing_values, receive, send
from autopar.errors import LoweringError
from autopar.graph import LayerGraph
from autopar.plan import Plan

_INPUT_STAGE = -1


@dataclass
class StageSplit:
    """The stage modules and how they were made.

    ``modules[k]`` is virtual stage k; ``layers[k]`` the plan's layer names in
    it; ``tracer`` ``"fx-layers"``, ``"fx"`` or ``"export"`` (see
    :func:`autopar.capturing.trace_layers`); ``layers_called`` whether each
    layer's module is one called submodule of its stage.
    """

    modules: list[fx.GraphModule]
    layers: list[list[str]]
    tracer: str
    inputs: list[list[str]] = field(default_factory=list)  # value names crossing into each stage
    outputs: list[list[str]] = field(default_factory=list)  # value names crossing out

    @property
    def layers_called(self) -> bool:
        return self.tracer in ("fx-layers", "export-layers")


def _node_stages(gm: fx.GraphModule, node_layer: dict[str, str], plan: Plan) -> dict[fx.Node, int]:
    """Stage of each placeholder (−1) and compute node; get_attr nodes get none (copied where used)."""
    stage_of = {lp.name: lp.stage for lp in plan.layers}
    stages: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            stages[n] = _INPUT_STAGE
        elif n.name in node_layer:
            layer = node_layer[n.name]
            if layer not in stage_of:
                raise LoweringError(f"the model has layer {layer!r}, which the plan does not place: "
                                    "re-plan this model")
            stages[n] = stage_of[layer]
            src = n.args[0] if n.target is operator.getitem and n.args else None
            if isinstance(src, fx.Node) and src in stages and isinstance(n.args[1], int) and (
                    src.op == "call_module" or isinstance(src.meta.get("val"), (tuple, list))):
                stages[n] = stages[src]  # an element taken from a tuple travels alone, not the tuple
        elif n.op in ("call_function", "call_method", "call_module") and n.users:
            raise LoweringError(f"node {n.name} ({n.target}) belongs to no layer; cannot place it in a stage")
    for n, s in stages.items():
        for user in n.users:
            if user in stages and stages[user] < s:
                raise LoweringError(f"{node_layer.get(user.name)!r} (stage {stages[user]}) uses a value of "
                                    f"{node_layer.get(n.name)!r} (stage {s}): stages must follow the dataflow")
    return stages


def _crossings(gm: fx.GraphModule, stages: dict[fx.Node, int], n_stages: int) -> list[list[fx.Node]]:
    """For each cut k (after stage k), the values made at or before k and used after it, in graph order."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    last_use: dict[fx.Node, int] = {}
    for n in stages:
        uses = [n_stages if u is output else stages.get(u, _INPUT_STAGE) for u in n.users]
        last_use[n] = max(uses, default=_INPUT_STAGE)
    return [[n for n in stages if stages[n] <= k < last_use[n]] for k in range(n_stages - 1)]


def _stage_graph(gm: fx.GraphModule, stages: dict[fx.Node, int], k: int, inputs: list[fx.Node],
                 outputs: list[fx.Node] | None, values: dict[fx.Node, Any]) -> fx.Graph:
    """Stage k's graph: placeholders for ``inputs`` (a pytree value: one per tensor leaf, rebuilt),
    its own nodes, output ``outputs`` flattened to their tensor leaves (None: the model's output)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        if n.op == "placeholder" and k == 0:
            env[n] = g.node_copy(n)
            env[n].meta = dict(n.meta)
        else:
            env[n] = receive(g, n.name, values[n])

    def arg(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":
            env[n] = g.node_copy(n)
        return env[n]

    for n in gm.graph.nodes:
        if stages.get(n) == k:
            for a in n.all_input_nodes:
                arg(a)
            env[n] = g.node_copy(n, arg)
    if outputs is None:
        out = fx.map_arg(next(n for n in gm.graph.nodes if n.op == "output").args[0], arg)
        if isinstance(out, (tuple, list)) and len(out) == 1:
            out = out[0]
        g.output(out)
    else:
        sent = [t for n in outputs for t in send(g, env[n], values[n])]
        g.output(sent[0] if len(sent) == 1 else tuple(sent))
    g.lint()
    return g


def _check_parameters(model: nn.Module, modules: list[fx.GraphModule], tied: set[str]) -> None:
    """Every stage parameter is the model's own object, and no parameter is in two stages but
    the ``tied`` embeddings, which the first and last stage share."""
    owner = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    shared = {id(model.get_parameter(name)) for name in tied}
    seen: dict[int, int] = {}
    for k, mod in enumerate(modules):
        for name, p in mod.named_parameters():
            if id(p) not in owner:
                raise LoweringError(f"stage {k}'s parameter {name} is not one of the model's: "
                                    "the tracer copied it")
            if id(p) in shared and {seen.get(id(p), k), k} <= {0, len(modules) - 1}:
                seen.setdefault(id(p), k)
                continue
            if seen.setdefault(id(p), k) != k:
                raise LoweringError(f"parameter {owner[id(p)]} is used by stages {seen[id(p)]} and {k} "
                                    "(tied weights?): put every layer using it in one stage")


def _canonical_names(model: nn.Module, stage: fx.GraphModule) -> None:
    """A parameter the stage reads by ``get_attr`` under another of its names (a tied weight that
    torch.export keeps under its last name, ``lm_head.weight``) is held under the model's first
    name (``model.embed_tokens.weight``), the one its ``named_parameters()`` gives: verify,
    checkpoints and exported weights find it there."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters():
        first.setdefault(id(p), name)
    renamed: set[str] = set()
    for node in stage.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            p = stage.get_parameter(node.target)
        except AttributeError:
            continue
        name = first.get(id(p), node.target)
        if name == node.target:
            continue
        owner, _, attr = name.rpartition(".")
        if owner:
            try:
                stage.get_submodule(owner)
            except AttributeError:
                stage.add_submodule(owner, nn.Module())
        (stage.get_submodule(owner) if owner else stage).register_parameter(attr, p)
        renamed.add(node.target)
        node.target = name
    still = {n.target for n in stage.graph.nodes if n.op in ("get_attr", "call_module")}
    for old in renamed - still:
        owner, _, attr = old.rpartition(".")
        if not any(old.startswith(f"{t}.") for t in still):
            del (stage.get_submodule(owner) if owner else stage)._parameters[attr]
    if renamed:
        stage.recompile()


def split_model(model: nn.Module, example_inputs: Any, graph: LayerGraph, plan: Plan) -> StageSplit:
    """Trace ``model`` and cut it at the plan's stage boundaries (see the module docstring).

    ``example_inputs`` are shaped like one microbatch. Raises
    :class:`LoweringError` if a layer has no stage in the plan, a stage uses a
    later stage's value, a cut carries a value that cannot be sent (see
    :mod:`.boundary`), or tied parameters span a cut; :class:`CaptureError` if the model cannot be traced.
    """
    known = {l.name for l in graph}
    if {lp.name for lp in plan.layers} != known:
        raise LoweringError("the plan's layers are not the graph's: re-plan this model")
    gm, node_layer, tracer = trace_layers(model, example_inputs)
    n_stages = plan.stages
    stages = _node_stages(gm, node_layer, plan)
    cuts = _crossings(gm, stages, n_stages)
    values = crossing_values(gm, example_inputs, {n for c in cuts for n in c})
    for k, cut in enumerate(cuts):
        check_sendable(cut, values, k)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ins = [placeholders] + cuts
    outs: list[list[fx.Node] | None] = [*cuts, None]
    modules = []
    for k in range(n_stages):
        g = _stage_graph(gm, stages, k, ins[k], outs[k], values)
        modules.append(fx.GraphModule(gm, g, class_name=f"Stage{k}"))
    tied = {p for layer in graph for p in layer.tied_params} if n_stages > 1 else set()
    _check_parameters(model, modules, tied)
    for mod in modules:
        _canonical_names(model, mod)
    by_stage: list[list[str]] = [[] for _ in range(n_stages)]
    for lp in plan.layers:
        by_stage[lp.stage].append(lp.name)
    return StageSplit(modules, by_stage, tracer, inputs=[[n.name for n in c] for c in ins],
                      outputs=[[n.name for n in c] for c in cuts] + [["output"]])


def split_stages(model: nn.Module, example_inputs: Any, graph: LayerGraph, plan: Plan) -> list[nn.Module]:
    """One module per virtual stage (``split_model(...).modules``); see the module docstring."""
    return list(split_model(model, example_inputs, graph, plan).modules)


__all__ = ["StageSplit", "split_model", "split_stages"]
