"""Context parallelism (cp): the sequence split over the cp ranks, attention by all-gathered K/V, by
the head all-to-all (DeepSpeed-Ulysses) or by K/V passed round the cp ring (torch's ring attention,
``passes/context_ring.py``), as the plan's ``cp_attention`` says.

Every rank of a cp group holds, of each sequence of S tokens, two chunks of
S/(2·cp): chunk ``r`` and chunk ``2·cp − 1 − r`` (head-tail load balancing:
under a causal mask the early chunks attend to few keys and the late ones to
many, so each rank gets one of each and all do equal work; torch's
``_HeadTailLoadBalancer`` orders them the same way). :func:`positions` gives
a rank's global token positions; :func:`shard_sequence` slices inputs and
targets to them (every tensor whose dim 1 is S).

Three things make the sharded forward compute what one device computes, each
proved on the model at capture (``autopar.capturing.context``, else cp is
refused there):

* **attention sees every key.** :class:`ContextAttention`, a
  ``TorchFunctionMode`` held over the forward of each module capture saw
  calling SDPA (``graph.cp_attention``; a recomputed forward too), turns each causal
  ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` into: K and V
  all-gathered over the cp group with autograd (``all_gather_single_autograd``:
  its backward reduce-scatters their gradients, summing every rank's
  queries' contributions), put back in global order, and, per query chunk,
  SDPA against only the keys it can see (:func:`prefix_attention`: chunk c's
  L = S/(2·cp) queries against keys [0, (c + 1)·L), the causal mask on the
  diagonal L × L block only), so the masked keys past each chunk are never
  computed (L × (2·cp + 1)·L scores instead of S/cp × S; the masked half of
  each diagonal block still is). It runs on gloo (CPU) and NCCL alike.
  Under Ulysses (``plan.cp_attention`` ``ulysses``, :func:`ulysses_attention`) the
  same call instead moves q, k and v by an all-to-all over the cp group
  (``all_to_all_single_autograd``: its backward is the reverse all-to-all) from
  [b, h, S/cp, d] (this rank's tokens, all heads) to [b, h/cp, S, d] (every token,
  this rank's heads), puts the gathered tokens in global order, runs the
  model's own causal SDPA over the whole sequence, and moves the output back the
  same way. cp must divide the key/value heads (``contract.ulysses_refusal``):
  query head group j and key/value head group j both land on rank j, so
  grouped-query heads stay with their key/value head;
* **positions are global.** The modules capture found receiving positions
  computed in the model from ``arange(S)`` (``graph.cp_positions``: the
  project's GPT's ``pos_emb``, a Hugging Face model's ``rotary_emb`` and its
  decoder layers' ``position_ids``) get, by a forward pre-hook, every integer
  input equal to ``arange(S/cp)`` replaced by the rank's global positions
  (a recomputed module runs the hook again, given positions already global,
  which it leaves as they are; it dispatches nothing, so selective recompute's
  replay finds only the ops its forward recorded);
* **the loss and gradients are the global batch's.** Each rank's loss is the
  mean over its S/cp tokens of each sample, equal counts on every rank, so the
  mean over the dp × cp ranks is the global mean, and the data-parallel pass
  averages gradients over the flattened dp × cp mesh (:func:`data_mesh`).

Beside tensor parallelism (cp × tp, the groups from the one device mesh (pp, dp, cp, tp)): the tp
ranks of one cp × dp position hold the same tokens and split the heads and MLP as without cp. An
attention module then runs inside its layer's TP ``ShardMode`` (``passes/tensor_parallel.py``), so
q, k and v reach this mode as plain tensors holding the tp rank's heads, tagged by the TP rules;
:func:`_tp_heads` finds them, the gather, reorder and masked SDPA run as plain ops on those
shards (K and V gathered over the cp group alone; under Ulysses the tp rank's heads all-to-all'd
over it, under the ring the tp rank's heads' K/V passed round it) and the output is tagged with the
query's head layout, as the TP rules' SDPA would. A style holding key or value projections whole on every tp
rank is refused (:func:`check_context_parallel`). A vocab-parallel position embedding gets its
positions as a replicated DTensor (its style's input hook runs first), which the position hook
swaps in its local tensor. Sequence parallelism composes: a block's hidden state is the tp rank's
share of the cp rank's S/cp tokens, gathered before the column projections, so attention still
reads whole S/cp chunks of its heads.

All hold under every per-layer choice the planner offers beside cp, each run
against one device (``tests/runtime/test_context_parallel.py``): ZeRO 0–3 per
layer (FSDP2 ``replicate`` or ``fully_shard`` units over ``dp_cp``, gradient
sync deferred to the last microbatch at ZeRO-0/1), recompute none, full,
selective or alternate_mm per layer (the mode is held over the attention
module's forward, so a recomputation re-enters it and gathers K and V again),
gradient accumulation over any microbatch count, and cp=2 × tp=2 with sp off and on (also
beside ZeRO-3 and selective recompute, and ZeRO-1 and full recompute, over 2 microbatches) and
dp=2 × cp=2 × tp=2 at ZeRO-3.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from autopar.admission import context_parallel_refusals, owning_layer
from autopar.errors import LoweringError
from autopar.passes.context_chunks import positions, to_heads, to_tokens

DATA_DIM = "dp_cp"  # the flattened dp × cp device-mesh dimension the data-parallel pass wraps over


def shard_sequence(batch: Any, seq_len: int, cp: int, rank: int) -> Any:
    """``batch`` (a tensor, tuple or dict; None stays None) with every tensor whose dim 1 is ``seq_len``
    cut to this rank's tokens (:func:`positions`); other tensors pass whole."""
    index = positions(seq_len, cp, rank)

    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == seq_len:
            return t.index_select(1, index.to(t.device))
        return t

    return pytree.tree_map(cut, batch)


def data_mesh(mesh: Any, cp: int) -> Any:
    """The 1-D device mesh the data-parallel pass wraps over: ``dp``, or ``dp × cp`` flattened."""
    if cp <= 1:
        return mesh["dp"]
    # _flatten made once returns the same mesh after (no new groups); slicing the flattened name from the root
    # instead, mesh[DATA_DIM], is deprecated since torch 2.11 ("bookkeep the flattened mesh directly")
    return mesh["dp", "cp"]._flatten(DATA_DIM)


def prefix_attention(func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: tuple[int, ...],
                     kwargs: dict) -> torch.Tensor:
    """Causal SDPA of a rank's query chunks against the keys each can see: ``q`` holds, along dim −2,
    ``len(starts)`` chunks of L queries whose global positions start at ``starts``; ``k`` and ``v``
    hold the whole sequence in global order. Chunk c starting at p runs ``func`` (SDPA) on the key
    prefix [0, p + L) with the boolean mask ``key ≤ query`` — all true left of its diagonal L × L
    block, lower-triangular on it — so nothing past the chunk's last position is computed.

    The mask is explicit, not ``is_causal``: SDPA's causal mask is aligned top-left (query i sees
    keys ≤ i), wrong for a prefix longer than the queries. ``kwargs`` (``scale``, ``enable_gqa``,
    ``dropout_p``) pass through; the chunks' outputs are concatenated back in ``q``'s order.
    Equal to one SDPA of ``q`` against all keys with the global causal mask, to float rounding
    (``tests/passes/test_context_prefix.py``)."""
    chunk = q.shape[-2] // len(starts)
    outs = []
    for i, p in enumerate(starts):
        keys = torch.arange(p + chunk, device=q.device)
        mask = keys[None, :] <= (p + torch.arange(chunk, device=q.device))[:, None]
        rows = q.narrow(-2, i * chunk, chunk)
        prefix_k, prefix_v = k.narrow(-2, 0, p + chunk), v.narrow(-2, 0, p + chunk)
        outs.append(func(rows, prefix_k, prefix_v, **{**kwargs, "attn_mask": mask, "is_causal": False}))
    return torch.cat(outs, dim=-2)


def _tp_heads(args: tuple, kwargs: dict) -> tuple[Any, Any] | None:
    """Under tensor parallelism (an attention module inside a layer run by the TP pass's
    ``ShardMode``), the mode and the head layout of this call's query, key and value; None without TP.

    q, k and v reach SDPA as plain tensors holding this tp rank's heads, tagged by the TP rules. cp's
    gather, reorder and masked SDPA are exact per head, so they run as plain ops on those shards (the
    all-gather over the cp group alone: the tp ranks of one cp position hold other heads of the same
    tokens) and the output is tagged as the TP rules' SDPA tags it, with the query's layout. A key or
    value not split on its heads like the query (held whole: fewer key/value heads than tp ranks)
    would need the rules' head cut and gradient sum: refused (:func:`check_context_parallel` refuses
    such plans before any group starts)."""
    from autopar.sharding.rules import current_mode

    mode = current_mode()
    if mode is None:
        return None
    names = ("query", "key", "value")
    qkv = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]
    layouts = [mode.layout(t) for t in qkv]
    if layouts[0] is None and layouts[1] is None and layouts[2] is None:
        return None
    q = qkv[0]
    if layouts[0] is None or layouts[0].dim != q.dim() - 3 or any(
            lay is None or lay.dim != t.dim() - 3 for lay, t in zip(layouts[1:], qkv[1:])):
        raise LoweringError("cp beside tp needs query, key and value each split on their heads "
                            "(a key or value held whole on every tp rank is not lowered under cp)")
    return mode, layouts[0]


def ulysses_attention(func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor,
                      group: Any, cp: int, kwargs: dict) -> torch.Tensor:
    """Causal SDPA by the head all-to-all (DeepSpeed-Ulysses): ``q``, ``k``, ``v`` [b, heads, S/cp, d] hold
    this rank's tokens; each goes by one all-to-all over ``group`` to [b, heads/cp, S, d] in global token
    order (:func:`to_heads`), ``func`` runs causal over the whole sequence, and the output goes back by the
    inverse permutation and one all-to-all (:func:`to_tokens`). ``all_to_all_single_autograd`` is torch's
    autograd-aware collective (its backward the reverse all-to-all; gloo and NCCL run it)."""
    q, k, v = (to_heads(x, order, group, cp) for x in (q, k, v))
    return to_tokens(func(q, k, v, **{**kwargs, "attn_mask": None, "is_causal": True}), order, group, cp)


class ContextAttention(TorchFunctionMode):
    """Causal SDPA over the whole sequence from this rank's queries (see the module docstring), by
    K/V all-gather, with ``ulysses`` by the head all-to-all (:func:`ulysses_attention`), with ``ring`` by
    K/V passed round the cp ring (``passes/context_ring.py``)."""

    def __init__(self, group: Any, seq_len: int, cp: int, rank: int, ulysses: bool = False, ring: bool = False):
        super().__init__()
        self.group, self.seq_len, self.cp, self.ulysses, self.ring = group, seq_len, cp, ulysses, ring
        chunk = seq_len // (2 * cp)
        self.starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)  # the head and tail chunks (positions)
        gathered = torch.cat([positions(seq_len, cp, r) for r in range(cp)])  # global position of each row
        self.order = torch.argsort(gathered)  # gathered rows in global order

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        heads = _tp_heads(args, kwargs)
        if heads is None:
            return self._attention(func, list(args), kwargs)
        mode, layout = heads
        with torch._C.DisableTorchFunction():  # local head shards: plain ops, gathered over cp alone
            out = self._attention(func, list(args), kwargs)
        return mode.tag(out, layout)

    def _attention(self, func: Any, args: list, kwargs: dict) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        for i, value in enumerate(args[:len(names)]):
            kwargs[names[i]] = value
        q, k, v = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
        if kwargs.get("attn_mask") is not None or not kwargs.get("is_causal", False):
            raise LoweringError("under cp, scaled_dot_product_attention must be causal with no attn_mask "
                                "(capture proved it was: the model changed since)")
        local = q.shape[-2]
        if local * self.cp != self.seq_len:
            raise LoweringError(f"under cp={self.cp} attention expected {self.seq_len // self.cp} local tokens, "
                                f"got {local}")
        if self.ring:
            from autopar.passes.context_ring import ring_attention

            return ring_attention(q, k, v, self.group, kwargs)
        order = self.order.to(k.device)
        if self.ulysses:
            if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[1] % self.cp or q.shape[1] % self.cp:
                raise LoweringError(f"Ulysses at cp={self.cp} needs query, key and value [batch, heads, sequence, "
                                    f"dim] with heads divisible by {self.cp}, got {list(q.shape)}, {list(k.shape)} "
                                    "(capture proved them: the model changed since)")
            return ulysses_attention(func, q, k, v, order, self.group, self.cp, kwargs)
        k = all_gather_single_autograd(k.contiguous(), gather_dim=k.dim() - 2, group=self.group)
        v = all_gather_single_autograd(v.contiguous(), gather_dim=v.dim() - 2, group=self.group)
        k, v = k.index_select(k.dim() - 2, order), v.index_select(v.dim() - 2, order)
        return prefix_attention(func, q, k, v, self.starts, kwargs)


@dataclass
class ContextParallelResult:
    """What the pass made: the position hooks and the attention modules whose forward holds the mode."""

    group: Any
    seq_len: int
    cp: int
    rank: int
    hooks: list[Any]
    attention: tuple[str, ...]
    ulysses: bool = False  # the head all-to-all, not the K/V all-gather
    ring: bool = False  # K/V passed round the cp ring, not all-gathered


def _held(forward: Any, mode: Any) -> Any:
    """``forward`` run under the attention mode ``mode()`` makes (:class:`ContextAttention`, or
    ``passes.manual_attention.ManualContextAttention`` for attention written by hand). On the module,
    not around the step: a checkpointed block's forward re-runs inside backward, where a mode entered
    around the step is no longer on the stack (the recomputation then saved other tensors than the forward)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with mode():
            return forward(*args, **kwargs)

    run.__autopar_cp__ = True  # type: ignore[attr-defined]
    return run


def is_held(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs under the cp attention mode."""
    return getattr(module.forward, "__autopar_cp__", False)


def _global_positions(local: torch.Tensor) -> Any:
    """A forward pre-hook: integer inputs equal to ``arange(S/cp)`` become ``local`` (the global positions).

    Its ops run with the dispatch modes set aside: a recomputed module's pre-hooks run again inside
    its recomputation (the composable ``checkpoint`` calls the module anew, with the inputs this hook
    already made global, which it then leaves alone), and selective recompute's replay mode refuses
    every op its forward did not record inside the checkpointed region, where this hook did not run
    (a Hugging Face decoder layer takes ``position_ids``: "aten.expand.default encountered during
    backward but not found in storage")."""
    from torch.utils._python_dispatch import _disable_current_modes

    def swap(t: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(t, DTensor):  # a vocab-parallel position embedding's input, made a replicated DTensor
            if not all(isinstance(p, Replicate) for p in t.placements):  # by its TP style's hook, run first
                return t
            return DTensor.from_local(swap(t.to_local()), t.device_mesh, t.placements, run_check=False)
        if (isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() >= 1
                and t.shape[-1] == local.numel()
                and torch.equal(t, torch.arange(local.numel(), device=t.device, dtype=t.dtype).expand_as(t))):
            return local.to(device=t.device, dtype=t.dtype).expand_as(t)
        return t

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        with _disable_current_modes():
            return pytree.tree_map(swap, args), pytree.tree_map(swap, kwargs)

    return hook


def check_context_parallel(graph: Any, plan: Any) -> None:
    """Raise :class:`LoweringError` where ``plan``'s cp cannot run on this model (before any group starts):
    admission's rules (:func:`autopar.admission.context_parallel_refusals`), the first of them."""
    if found := context_parallel_refusals(graph, plan):
        raise LoweringError(found[0])


def part_paths(graph: Any, layers: Any, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Of ``paths`` (``graph.cp_positions`` or ``graph.cp_attention``), those a pipeline stage holding
    ``layers`` (its plan entries; None: the whole model) runs: the ones inside its layers' modules."""
    if layers is None:
        return paths
    names = {lp.name for lp in layers}
    return tuple(p for p in paths if owning_layer(graph, p) in names)


def apply_context_parallel(module: nn.Module, graph: Any, plan: Any, mesh: Any,
                           layers: Any = None) -> ContextParallelResult:
    """Hook the position modules of ``module`` and make the attention mode for this rank; ``layers``:
    a pipeline stage's plan entries (its share of those modules), None for the whole model."""
    check_context_parallel(graph, plan)
    cp_mesh = mesh["cp"]
    rank, seq_len = cp_mesh.get_local_rank(), graph.seq_len
    local = positions(seq_len, plan.mesh.cp, rank)
    hooks = [module.get_submodule(path).register_forward_pre_hook(_global_positions(local), with_kwargs=True)
             for path in part_paths(graph, layers, graph.cp_positions)]
    group, cp = cp_mesh.get_group(), plan.mesh.cp
    ulysses, ring = str(plan.cp_attention) == "ulysses", str(plan.cp_attention) == "ring"
    attention = part_paths(graph, layers, graph.cp_attention)
    from autopar.passes.manual_attention import ManualContextAttention, group_gather, group_move

    gather, move = group_gather(group, seq_len, cp), (group_move(group, seq_len, cp) if ulysses else None)
    for path in attention:
        attn = module.get_submodule(path)
        if path in graph.cp_manual:  # by hand: kᵀ and v gathered (the rank's mask rows), or heads all-to-all'd
            attn.forward = _held(attn.forward, lambda: ManualContextAttention(gather, local, seq_len, move))
        else:
            attn.forward = _held(attn.forward, lambda: ContextAttention(group, seq_len, cp, rank, ulysses, ring))
    return ContextParallelResult(group, seq_len, plan.mesh.cp, rank, hooks, attention, ulysses, ring)


__all__ = ["DATA_DIM", "ContextAttention", "ContextParallelResult", "apply_context_parallel",
           "check_context_parallel", "data_mesh", "is_held", "owning_layer", "part_paths", "positions",
           "prefix_attention", "shard_sequence", "to_heads", "to_tokens", "ulysses_attention"]
