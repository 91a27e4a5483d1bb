"""Tensor-parallel style detection on a measured layer.

Capture hands this module the FX nodes of one layer with what executing them
measured (FLOPs, saved activations, output sizes). We look for structures
whose split we can describe exactly:

* ``megatron`` — inside a submodule P, projections (``nn.Linear`` or Hugging
  Face's ``Conv1D``) run in order where all but the last read one replicated
  input of width w (column: split output features) and the last maps the
  columns' result back to w (row: split input features). This finds a
  *candidate*; whether the layer's code between the projections runs exactly
  on shards, and how a fused projection's output is cut into segments, is
  decided by simulating it (:mod:`autopar.sharding.verify`).
* ``vocab`` — an ``nn.Embedding`` layer (split the vocabulary), or a layer
  ending in an LM-head linear with ``out_features >= 8 * in_features`` or onto
  an embedding's vocabulary.

Anything we cannot describe exactly is not admitted: a wrong style would make
the lowering pass compute different numbers than one device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx
import torch.nn as nn

from autopar.sharding.channel_ops import channel_params
from autopar.sharding.rules import projection_dims
from autopar.tp_style import TPStyle


@dataclass
class NodeStats:
    """What executing one FX node measured; sizes are totals for the example batch."""

    paths: tuple[str, ...] = ()
    flops: float = 0.0
    # (bytes, producer node) of every storage first saved for backward here
    saved: list[tuple[float, fx.Node]] = field(default_factory=list)
    is_tensor: bool = False
    holds_tensor: bool = False  # a tensor, or a tuple/list with tensors inside
    out_numel: int = 0
    out_bytes: int = 0
    out_last_dim: int | None = None
    out_first_dim: int | None = None
    out_floating: bool = False
    # a tuple, dict, dataclass… : why it cannot cross a pipeline cut ('' when it can), its tensor
    # leaves' bytes and dims 0
    unsendable: str = ""
    leaf_bytes: int = 0
    leaf_first_dims: tuple[int | None, ...] = ()


@dataclass
class LayerView:
    """One layer's nodes in graph order plus everything detection needs."""

    model: nn.Module
    path: str | None
    nodes: list[fx.Node]
    stats: dict[fx.Node, NodeStats]
    batch: int
    dtype_bytes: int
    # the model's embedding tables as (vocabulary, id of the weight), read once for all its layers
    # (:func:`embedding_tables`); None: read from ``model`` when needed
    embeddings: tuple[tuple[int, int], ...] | None = None


def embedding_tables(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """(vocabulary, id of the weight) of every ``nn.Embedding`` in ``model``."""
    return tuple((m.num_embeddings, id(m.weight)) for m in model.modules() if isinstance(m, nn.Embedding))


def linear_dims(mod: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a projection tensor parallelism can split (Linear, Conv1D); else None."""
    return projection_dims(mod)


def _numel(mod: nn.Module, skip_bias: bool = False) -> int:
    return sum(p.numel() for n, p in mod.named_parameters(recurse=False) if not (skip_bias and n == "bias"))


def _inside(stats: NodeStats, path: str) -> bool:
    return path in stats.paths


def _external_inputs(nodes: list[fx.Node], members: set[fx.Node], view: LayerView) -> set[fx.Node]:
    """Tensor values consumed by ``nodes`` but produced outside ``members`` (params excluded)."""
    out: set[fx.Node] = set()
    for n in nodes:
        for a in n.all_input_nodes:
            if a in members or a.op == "get_attr":
                continue
            st = view.stats.get(a)
            if a.op == "placeholder" or (st is not None and st.is_tensor):
                out.add(a)
    return out


def _depends_on(
    start: set[fx.Node], targets: set[fx.Node], stop: set[fx.Node], allowed: set[fx.Node], view: LayerView
) -> tuple[bool, bool]:
    """Walk tensor dataflow back from ``start`` inside ``allowed``: (reaches targets, reaches stop)."""
    seen: set[fx.Node] = set()
    todo = list(start)
    hit_t = hit_s = False
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in targets:
            hit_t = True
            continue
        if n in stop:
            hit_s = True
            continue
        if n not in allowed:
            continue
        for a in n.all_input_nodes:
            st = view.stats.get(a)
            if a in targets or a in stop or (st is not None and st.holds_tensor):
                todo.append(a)
    return hit_t, hit_s


@dataclass
class _Pair:
    """One accepted column→row group inside a submodule P."""

    path: str
    columns: list[str]
    row: str
    divisors: list[int]
    params: int
    flops: float
    act_elems: float
    allreduce_elems: float


def _try_pair(view: LayerView, p_path: str, linears: list[str]) -> _Pair | None:
    """Check the column→row pattern for the linears of P (in execution order)."""
    mods = {lp: view.model.get_submodule(lp) for lp in linears}
    dims = {lp: linear_dims(m) for lp, m in mods.items()}
    cols, row = linears[:-1], linears[-1]
    width = dims[cols[0]][0]  # type: ignore[index]
    if any(dims[c][0] != width for c in cols) or dims[row][1] != width:  # type: ignore[index]
        return None
    p_nodes = [n for n in view.nodes if _inside(view.stats[n], p_path)]
    in_mod = {lp: [n for n in p_nodes if _inside(view.stats[n], lp)] for lp in linears}
    if any(not v for v in in_mod.values()):
        return None
    # every column reads the same replicated value X from outside its module
    xs = [_external_inputs(in_mod[c], set(in_mod[c]), view) for c in cols]
    if any(len(x) != 1 for x in xs) or len(set().union(*xs)) != 1:
        return None
    x_node = next(iter(xs[0]))
    first = p_nodes.index(in_mod[cols[0]][0])
    row_start = p_nodes.index(in_mod[row][0])
    if any(p_nodes.index(in_mod[c][-1]) > row_start for c in cols):
        return None
    col_nodes = {n for c in cols for n in in_mod[c]}
    core = [n for n in p_nodes[first:row_start] if n not in col_nodes]
    row_in = _external_inputs(in_mod[row], set(in_mod[row]), view)
    col_outs = {in_mod[c][-1] for c in cols}
    hit_cols, hit_x = _depends_on(row_in, col_outs, {x_node}, set(core), view)
    if not hit_cols or hit_x:
        return None
    divisors = [dims[c][1] for c in cols]  # type: ignore[index]
    sharded = col_nodes | set(core)
    act = sum(b for n in sharded | set(in_mod[row]) for b, prod in view.stats[n].saved if prod in sharded)
    return _Pair(
        path=p_path,
        columns=list(cols),
        row=row,
        divisors=divisors,
        params=sum(_numel(mods[c]) for c in cols) + _numel(mods[row], skip_bias=True),
        flops=sum(view.stats[n].flops for n in sharded | set(in_mod[row])),
        act_elems=act / view.dtype_bytes,
        allreduce_elems=float(view.stats[in_mod[row][-1]].out_numel),
    )


def _try_inner(view: LayerView, p_path: str, linears: list[str]) -> _Pair | None:
    """A selective state-space mixer (Mamba's): one column projection reads the replicated input
    (``in_proj``), projections inside the group read only what it made (``x_proj``, contracting over
    the sharded channels: :func:`autopar.sharding.channel_ops.inner_row`), and the last maps the
    channels back to the input's width (``out_proj``). The inner projections stay whole on every rank;
    the simulation decides whether the code between runs exactly on shards."""
    col, inner, row = linears[0], linears[1:-1], linears[-1]
    dims = {lp: linear_dims(view.model.get_submodule(lp)) for lp in linears}
    if not inner or dims[col][0] != dims[row][1]:  # type: ignore[index]
        return None
    p_nodes = [n for n in view.nodes if _inside(view.stats[n], p_path)]
    in_mod = {lp: [n for n in p_nodes if _inside(view.stats[n], lp)] for lp in linears}
    if any(not v for v in in_mod.values()):
        return None
    xs = _external_inputs(in_mod[col], set(in_mod[col]), view)
    if len(xs) != 1:
        return None
    row_start = p_nodes.index(in_mod[row][0])
    reach = set(in_mod[col])  # what depends on the column's output
    for n in p_nodes[:row_start]:
        if n not in reach and any(a in reach for a in n.all_input_nodes):
            reach.add(n)
    for lp in (*inner, row):  # each reads what the column made, never the replicated input itself
        ext = _external_inputs(in_mod[lp], set(in_mod[lp]), view)
        if not ext or not ext <= reach:
            return None
    sharded = reach - {n for lp in inner for n in in_mod[lp]}
    act = sum(b for n in sharded | set(in_mod[row]) for b, prod in view.stats[n].saved if prod in sharded)
    mods = {lp: view.model.get_submodule(lp) for lp in (col, row)}
    channels = channel_params(view.model, (col,), (row,)).get(col, ())  # split with the column
    return _Pair(
        path=p_path,
        columns=[col],
        row=row,
        divisors=[dims[col][1]],  # type: ignore[index]
        params=_numel(mods[col]) + _numel(mods[row], skip_bias=True)
        + sum(view.model.get_parameter(p).numel() for p in channels),
        flops=sum(view.stats[n].flops for n in reach | set(in_mod[row])),
        act_elems=act / view.dtype_bytes,
        allreduce_elems=float(view.stats[in_mod[row][-1]].out_numel),
    )


def _try_low_rank(view: LayerView, p_path: str, linears: list[str]) -> _Pair | None:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank *down*-projections (``q_a_proj``,
    ``kv_a_proj_with_mqa``) feed *up*-projections through norms, and the row reads the heads the
    up-projections made. Megatron-Core shards MLA by heads after the up-projections: those are the
    columns, the down-projections (and their norms, and the shared rotary key) run whole on every
    rank. A linear is a down-projection when another non-row linear reads its output; the rest are
    the columns. The simulation decides whether the code between them runs exactly on shards."""
    row = linears[-1]
    p_nodes = [n for n in view.nodes if _inside(view.stats[n], p_path)]
    in_mod = {lp: [n for n in p_nodes if _inside(view.stats[n], lp)] for lp in linears}
    if any(not v for v in in_mod.values()):
        return None
    lin_nodes = {n for lp in linears for n in in_mod[lp]}
    outs = {in_mod[lp][-1]: lp for lp in linears[:-1]}
    down: set[str] = set()
    for lp in linears[:-1]:
        todo, seen = list(_external_inputs(in_mod[lp], set(in_mod[lp]), view)), set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in outs:
                down.add(outs[n])
            elif n in p_nodes and n not in lin_nodes:
                todo.extend(n.all_input_nodes)
    cols = [lp for lp in linears[:-1] if lp not in down]
    if not down or not cols:
        return None
    dims = {lp: linear_dims(view.model.get_submodule(lp)) for lp in linears}
    col_nodes = {n for c in cols for n in in_mod[c]}
    row_start = p_nodes.index(in_mod[row][0])
    if any(p_nodes.index(in_mod[c][-1]) > row_start for c in cols):
        return None
    reach = set(col_nodes)  # what depends on a column's output: the sharded part of the layer
    for n in p_nodes[:row_start]:
        if n not in reach and any(a in reach for a in n.all_input_nodes):
            reach.add(n)
    if any(n in reach for d in down for n in in_mod[d]):
        return None  # a down-projection reads the heads: not this pattern
    row_in = _external_inputs(in_mod[row], set(in_mod[row]), view)
    if not row_in or not row_in <= reach:
        return None
    sharded = reach
    act = sum(b for n in sharded | set(in_mod[row]) for b, prod in view.stats[n].saved if prod in sharded)
    mods = {lp: view.model.get_submodule(lp) for lp in cols + [row]}
    return _Pair(
        path=p_path,
        columns=cols,
        row=row,
        divisors=[dims[c][1] for c in cols],  # type: ignore[index]
        params=sum(_numel(mods[c]) for c in cols) + _numel(mods[row], skip_bias=True),
        flops=sum(view.stats[n].flops for n in sharded | set(in_mod[row])),
        act_elems=act / view.dtype_bytes,
        allreduce_elems=float(view.stats[in_mod[row][-1]].out_numel),
    )


def _convolutions(view: LayerView) -> str:
    """Why a layer of convolutions has no tensor-parallel style ("" when it runs none): a plan then says
    why its tp ranks leave a ResNet's or a UNet's blocks whole (named by class, so that a stack of such
    blocks folds into one note)."""
    kinds: set[str] = set()
    for n in view.nodes:
        for path in view.stats[n].paths:
            try:
                mod = view.model.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(mod, nn.modules.conv._ConvNd):
                kinds.add(type(mod).__name__)
    if not kinds:
        return ""
    return (f"tensor parallelism not offered: its convolutions ({', '.join(sorted(kinds))}) have no "
            "tensor-parallel rule (only linear projections in column → row groups are split)")


def _executed_linears(view: LayerView) -> list[str]:
    """Linear-like module paths of the layer, in order of first execution."""
    seen: list[str] = []
    for n in view.nodes:
        for path in view.stats[n].paths:
            if path in seen:
                continue
            try:
                mod = view.model.get_submodule(path)
            except AttributeError:
                continue
            if linear_dims(mod) is not None:
                seen.append(path)
    return seen


_ROUTING_HOPS = 8  # ops between a router's projection and its top-k (softmax, casts, a bias, a sigmoid…)


def _routes(view: LayerView, path: str, others: tuple[str, ...] = ()) -> bool:
    """Whether the projection at ``path`` is an MoE router: its output reaches a top-k within a few ops.
    A router outside every column → row group reads the replicated hidden state and runs whole on every
    rank (its ``[tokens, experts]`` scores are small), so it does not withdraw tensor parallelism from
    the block (Llama 4's MoE layer, its shared expert a group of its own); the shard simulation still
    proves the block. ``others``: projections the way to the top-k may not pass through (the router itself,
    not a projection whose output reaches a router)."""
    mine = [n for n in view.nodes if _inside(view.stats[n], path)]
    if not mine:
        return False
    if any(_is_topk(n) for n in mine):  # a router module that picks its experts itself (Llama 4's)
        return True
    frontier, seen = {mine[-1]}, set(mine)
    for _ in range(_ROUTING_HOPS):
        nxt = set()
        for n in frontier:
            for user in n.users:
                if _is_topk(user):
                    return True
                if user not in seen and not any(_inside(view.stats[user], o) for o in others if user in view.stats):
                    seen.add(user)
                    nxt.add(user)
        frontier = nxt
    return False


def _gates(view: LayerView, path: str) -> bool:
    """Whether the projection at ``path`` is a per-token scalar gate (one output feature: Qwen2-MoE's
    ``shared_expert_gate``, whose sigmoid scales the shared expert's output). Like a router it reads the
    replicated hidden state and its ``[tokens, 1]`` output is small, so it runs whole on every rank
    beside the groups; the shard simulation proves the block with it so."""
    dims = linear_dims(view.model.get_submodule(path))
    return dims is not None and dims[1] == 1


def _is_topk(node: fx.Node) -> bool:
    return "topk" in str(getattr(node.target, "__name__", node.target))


def _megatron(view: LayerView) -> TPStyle | None:
    """Find minimal submodules P (deepest first) whose linears form a column→row group."""
    found, _ = _megatron_or_why(view)
    return found


def megatron_refusal(view: LayerView) -> str:
    """Why a layer with projections has no Megatron candidate (empty when it has one, or has fewer
    than two projections): the projections no column → row group covers, named."""
    found, why = _megatron_or_why(view)
    return "" if found is not None else why


def _megatron_or_why(view: LayerView) -> tuple[TPStyle | None, str]:
    linears = _executed_linears(view)
    if len(linears) < 2 or view.path is None:
        return None, _convolutions(view) if view.path is not None else ""
    candidates = {lp.rsplit(".", 1)[0] if "." in lp else "" for lp in linears}
    for lp in linears:  # every ancestor inside the layer is a candidate too
        parts = lp.split(".")
        for i in range(len(parts) - 1, 0, -1):
            anc = ".".join(parts[:i])
            if anc == view.path or anc.startswith(view.path + "."):
                candidates.add(anc)
    candidates = {c for c in candidates if c == view.path or c.startswith(view.path + ".")}
    used: set[str] = set()
    pairs: list[_Pair] = []
    gates = {lp for lp in linears if _gates(view, lp)}  # one output feature: no tp degree divides it
    for p_path in sorted(candidates, key=lambda c: -c.count(".") - (c != "")):
        mine = [lp for lp in linears if lp.startswith(p_path + ".") and lp not in used and lp not in gates]
        if len(mine) < 2:
            continue
        pair = _try_pair(view, p_path, mine) or _try_inner(view, p_path, mine)
        # else: a router is no group's column or row (a Switch block's, beside its fused-QKV attention)
        routers = {lp for lp in mine if _routes(view, lp, tuple(o for o in linears if o != lp))}
        if pair is None and routers and len(mine) - len(routers) >= 2:
            pair = _try_pair(view, p_path, [lp for lp in mine if lp not in routers])
        pair = pair or _try_low_rank(view, p_path, mine)
        if pair is not None:
            pairs.append(pair)
            used.update(mine)  # a low-rank pair's down-projections run whole, unsharded
    # routers and scalar gates outside every group run whole on every rank
    routers = {lp for lp in linears if lp not in used and (_routes(view, lp) or lp in gates)}
    if not pairs or len(used | routers) != len(linears):
        left = [lp for lp in linears if lp not in used and lp not in routers]
        return None, ("tensor parallelism not offered: no column → row projection group covers "
                      f"{', '.join(left[:4])}{' …' if len(left) > 4 else ''} (a group is column projections "
                      "reading one replicated input, then a row projection mapping their result back to it)")
    pairs.sort(key=lambda p: linears.index(p.columns[0]))
    whole = _functional_attention(view)
    b = view.batch
    elems = sum(p.allreduce_elems for p in pairs) / b
    return TPStyle(
        name="megatron",
        column=tuple(c for p in pairs for c in p.columns),
        row=tuple(p.row for p in pairs),
        divisors=tuple(sorted(set(d for p in pairs for d in p.divisors))),
        sharded_params=sum(p.params for p in pairs),
        sharded_flops_per_sample=sum(p.flops for p in pairs) / b,
        sharded_activation_elems_per_sample=sum(p.act_elems for p in pairs) / b,
        fwd_allreduce_elems=elems,
        fwd_allreduce_count=len(pairs),
        bwd_allreduce_elems=elems,
        bwd_allreduce_count=len(pairs),
        runs_whole=(f"its attention ({', '.join(whole)}: nn.MultiheadAttention) runs whole on every tp rank: the "
                    "module hands its packed in_proj_weight and out_proj's weight to F.multi_head_attention_forward, "
                    "where no projection module runs for the rules to split; priced so") if whole else "",
    ), ""


def _functional_attention(view: LayerView) -> list[str]:
    """The layer's ``nn.MultiheadAttention`` modules (relative paths), which compute through the functional
    ``F.multi_head_attention_forward``: a Megatron style splits none of them (their projections never run as
    modules), so they run whole beside the groups it splits."""
    if view.path is None:
        return []
    root = view.model.get_submodule(view.path) if view.path else view.model
    return [name for name, mod in root.named_modules() if isinstance(mod, nn.MultiheadAttention)]


def _vocab_embedding(view: LayerView) -> TPStyle | None:
    if view.path is None:
        return None
    mod = view.model.get_submodule(view.path)
    if not isinstance(mod, nn.Embedding):
        return None
    out = [n for n in view.nodes if view.stats[n].is_tensor and _inside(view.stats[n], view.path)]
    if not out:
        return None
    elems = view.stats[out[-1]].out_numel / view.batch
    return TPStyle(
        name="vocab",
        vocab=(view.path,),
        divisors=(mod.num_embeddings,),
        sharded_params=mod.weight.numel(),
        fwd_allreduce_elems=elems,
        fwd_allreduce_count=1,
    )


def _vocab_head(view: LayerView) -> TPStyle | None:
    """An LM head: the layer's last computing node runs in a wide Linear."""
    computing = [n for n in view.nodes if view.stats[n].flops > 0]
    if not computing:
        return None
    last = computing[-1]
    head = next(
        (p for p in reversed(view.stats[last].paths) if _linear_at(view.model, p) is not None), None
    )
    if head is None:
        return None
    d_in, d_out = _linear_at(view.model, head)  # type: ignore[misc]
    tables = view.embeddings if view.embeddings is not None else embedding_tables(view.model)
    if d_out < 8 * d_in and not _is_vocabulary(tables, d_out):
        return None
    mod = view.model.get_submodule(head)
    # a weight tied to an embedding is that layer's parameter (its vocab style shards it alike): not this one's
    tied = mod.weight.numel() if any(table == id(mod.weight) for _, table in tables) else 0
    nodes = [n for n in view.nodes if _inside(view.stats[n], head)]
    ext = _external_inputs(nodes, set(nodes), view)
    in_elems = sum(view.stats[x].out_numel for x in ext if x in view.stats)
    return TPStyle(
        name="vocab",
        column=(head,),
        vocab=(head,),
        divisors=(d_out,),
        sharded_params=_numel(mod) - tied,
        sharded_flops_per_sample=sum(view.stats[n].flops for n in nodes) / view.batch,
        fwd_allgather_elems=view.stats[nodes[-1]].out_numel / view.batch,
        bwd_allreduce_elems=in_elems / view.batch,
        bwd_allreduce_count=1,
    )


def _is_vocabulary(tables: tuple[tuple[int, int], ...], width: int) -> bool:
    """Whether ``width`` is an embedding's vocabulary in ``model``: a head onto it is an LM head
    however narrow the vocabulary is next to the hidden size (GPT-3: 51,200 onto 12,288), a head
    tied to the embedding's weight included (both then shard the weight's vocabulary rows over tp:
    the contract splits the two ends together or neither, :func:`autopar.contract.loss_fixed_tp`)."""
    return any(vocabulary == width for vocabulary, _ in tables)


def _linear_at(model: nn.Module, path: str) -> tuple[int, int] | None:
    try:
        return linear_dims(model.get_submodule(path))
    except AttributeError:
        return None


def detect_tp_styles(view: LayerView) -> tuple[TPStyle, ...]:
    """Every tensor-parallel style the layer admits (empty when none is exact)."""
    styles: list[TPStyle] = []
    for finder in (_megatron, _vocab_embedding, _vocab_head):
        style = finder(view)
        if style is not None:
            styles.append(style)
    return tuple(styles)


__all__ = ["NodeStats", "LayerView", "detect_tp_styles", "embedding_tables", "linear_dims", "megatron_refusal"]
