"""Attention written by hand (nanoGPT's), recognised op by op so that cp can reroute it.

nanoGPT's ``CausalSelfAttention`` without flash runs, inside one module::

    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))   # scores: a product of two
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))  # activations, (…, S, S)
    att = F.softmax(att, dim=-1)
    att = self.attn_dropout(att)
    y = att @ v

:class:`ManualChains` follows each such chain through the context probe
(:mod:`autopar.capturing.context`): it starts at a product of two activations
that is S × S, and every later op on the chain's tensors must be the next
step of the pattern — a scale by a number, ``masked_fill`` with −inf, a
softmax over the last dim, dropout, and the product with an S-long activation
(v) that ends it. Anything else on the chain (another reduction, the scores
returned, a softmax before the mask) is a refusal naming the op. Under cp the
runtime (``passes/manual_attention.py``) gathers kᵀ and v over the cp group
and gives ``masked_fill`` the causal mask of the rank's global positions; that
rewrite is checked against the module's own forward before any group starts
(the mask's values are unknown here: capture runs on fake or meta tensors).

Such a module really holds its S × S score matrix (S/cp × S per rank under
cp): it is priced as its ops run, and the plan says so in its notes. Each chain's
q and output bytes and its head count (q, kᵀ and v 4-D with one head count, else
0) are recorded too: what cp's head all-to-all (Ulysses) moves and what its
degree must divide.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

PRODUCTS = frozenset({"matmul", "__matmul__", "bmm"})  # q · kᵀ and probs · v (einsum is not followed)
SCALES = frozenset({"mul", "__mul__", "__rmul__", "div", "__truediv__", "true_divide", "mul_", "div_"})
RAW, MASKED, PROBS = "scores", "masked scores", "probabilities"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.dim() == 0)


class ManualChains:
    """The hand-written attention chains of one forward, by the id of each chain tensor (kept alive)."""

    def __init__(self, seq_len: int, batch: int):
        self.seq_len, self.batch = seq_len, batch
        self.live: dict[int, tuple[torch.Tensor, str, str, int]] = {}  # id → (tensor, stage, module, chain)
        self.finished: set[int] = set()
        self.kv_bytes: dict[str, float] = {}  # per module: kᵀ and v bytes per sample
        self.qo_bytes: dict[str, float] = {}  # per module: q and output bytes per sample (Ulysses moves them)
        self.heads: dict[str, tuple[int, ...]] = {}  # per module: each chain's heads (0: not 4-D [b, h, S, d])
        self.calls: dict[str, int] = {}  # per module: completed chains
        self.problem = ""

    def on_chain(self, tensors: list[torch.Tensor]) -> tuple[str, str] | None:
        """The (stage, module) of the first chain tensor among a call's tensor arguments."""
        for t in tensors:
            if id(t) in self.live:
                return self.live[id(t)][1], self.live[id(t)][2]
        return None

    def starts(self, name: str, tensors: list[torch.Tensor], out: Any, where: str) -> bool:
        """Record ``out`` as a chain's scores when ``name`` multiplies two activations into S × S."""
        acts = [t for t in tensors if not isinstance(t, nn.Parameter) and t.dim() >= 2]
        if not (name in PRODUCTS and len(acts) == 2 and isinstance(out, torch.Tensor) and out.dim() >= 2
                and list(out.shape[-2:]) == [self.seq_len] * 2):
            return False
        self.live[id(out)] = (out, RAW, where, len(self.live))
        self._bytes(where, acts[1])
        self._bytes(where, acts[0], self.qo_bytes)
        q, kt = acts
        heads = q.shape[1] if q.dim() == 4 and kt.dim() == 4 and q.shape[1] == kt.shape[1] else 0
        self.heads[where] = tuple(sorted({*self.heads.get(where, ()), heads}))
        return True

    def advance(self, name: str, args: tuple, kwargs: dict, out: Any, stage: str, where: str) -> None:
        """``name`` ran on a chain tensor at ``stage``: move the chain on, or say why cp cannot follow."""
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out)):
            return  # metadata read off a chain tensor (its shape, dtype, device): no step of it
        nxt = self._next(name, args, kwargs, stage)
        chain = self.live[id(args[0])] if nxt is not None else None
        if chain is None or not (where == chain[2] or where.startswith(chain[2] + ".")):  # its module or inside
            self.problem = self.problem or (
                f"{name} on a hand-written attention's {stage} in {where} (cp reroutes only q · kᵀ, a scale, "
                "masked_fill with -inf, softmax over the last dim, dropout and · v)")
            return
        if nxt == "done":
            self._bytes(chain[2], args[1])
            self._bytes(chain[2], out, self.qo_bytes)
            v, heads = args[1], self.heads.get(chain[2], (0,))
            if v.dim() != 4 or v.shape[1] not in heads:  # v's heads not the scores' (Ulysses moves them alike)
                self.heads[chain[2]] = tuple(sorted({*heads, 0}))
            self.calls[chain[2]] = self.calls.get(chain[2], 0) + 1
            self.finished.add(chain[3])
            return
        if isinstance(out, torch.Tensor):
            self.live[id(out)] = (out, nxt, chain[2], chain[3])

    def _next(self, name: str, args: tuple, kwargs: dict, stage: str) -> str | None:
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor) or id(first) not in self.live:
            return None  # the chain tensor must be the op's first operand (scores · v, not v · scores)
        if name in SCALES and stage == RAW and len(args) == 2 and _number(args[1]):
            return RAW
        if name in ("masked_fill", "masked_fill_") and stage == RAW:
            value = args[2] if len(args) > 2 else kwargs.get("value")
            return MASKED if _number(value) and float(value) == -math.inf else None
        if name == "softmax" and stage == MASKED:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            return PROBS if isinstance(dim, int) and dim in (-1, first.dim() - 1) else None
        if name == "dropout" and stage == PROBS:
            return PROBS
        if name in PRODUCTS and stage == PROBS and len(args) == 2 and isinstance(args[1], torch.Tensor):
            v = args[1]
            return "done" if v.dim() >= 2 and v.shape[-2] == self.seq_len and id(v) not in self.live else None
        return None

    def _bytes(self, where: str, t: Any, into: dict[str, float] | None = None) -> None:
        into = self.kv_bytes if into is None else into
        if isinstance(t, torch.Tensor):
            into[where] = into.get(where, 0.0) + t.numel() * t.element_size() / self.batch

    def unfinished(self) -> str:
        """Why a chain that never reached · v cannot be rerouted ("" when every chain finished)."""
        if self.problem:
            return self.problem
        ends = sorted(m for _, _, m, chain in self.live.values() if chain not in self.finished)
        return f"a hand-written attention's scores in {ends[0]} never reach a product with v" if ends else ""


__all__ = ["PRODUCTS", "ManualChains"]
