"""cp's attention in one process: each rank's two query chunks against only the key prefix each can
see (``passes.context_parallel.prefix_attention``) equal plain causal SDPA over the whole sequence at
that rank's positions, forward and gradients, for cp = 2, 3, 4, with grouped-query heads
(``enable_gqa``) and a non-default ``scale``. The gather is simulated: K and V are the whole sequence
in global order, as the all-gather and reorder leave them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.passes.context_parallel import ContextAttention, positions, prefix_attention

B, HEADS, D = 2, 4, 8


def _qkv(seq: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq * 7 + kv_heads)
    return tuple(torch.randn(B, h, seq, D, generator=g, dtype=torch.float64, requires_grad=True)
                 for h in (HEADS, kv_heads, kv_heads))


def _starts(seq: int, cp: int, rank: int) -> tuple[int, int]:
    chunk = seq // (2 * cp)
    return rank * chunk, (2 * cp - 1 - rank) * chunk


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("kv_heads,kwargs", [(HEADS, {}), (2, {"enable_gqa": True}), (1, {"enable_gqa": True}),
                                             (2, {"enable_gqa": True, "scale": 0.3}), (HEADS, {"scale": 1.7})])
def test_prefix_chunks_equal_causal_attention_on_the_whole_sequence(cp: int, kv_heads: int, kwargs: dict) -> None:
    seq = 2 * cp * 5
    q, k, v = _qkv(seq, kv_heads)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    grad = torch.randn(full.shape, dtype=full.dtype, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad(full, (q, k, v), grad)
    got = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        here = positions(seq, cp, rank)
        out = prefix_attention(F.scaled_dot_product_attention, q.index_select(2, here), k, v,
                               _starts(seq, cp, rank), {"dropout_p": 0.0, **kwargs})
        assert _rel(out, full.index_select(2, here)) < 1e-12
        for acc, g in zip(got, torch.autograd.grad(out, (q, k, v), grad.index_select(2, here))):
            acc += g  # K and V's gradients summed over the ranks: the all-gather's reduce-scatter
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-12


def test_is_causal_on_a_rectangular_prefix_is_what_the_test_catches() -> None:
    """The mistake the explicit mask avoids: SDPA's ``is_causal`` aligns top-left, so the tail chunk
    (keys longer than its queries) would miss most of its keys; the comparison above catches it."""
    cp, seq = 2, 20
    q, k, v = _qkv(seq, HEADS)
    here = positions(seq, cp, 0)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).index_select(2, here)

    def top_left(rows, keys, values, attn_mask, is_causal, **kw):
        return F.scaled_dot_product_attention(rows, keys, values, is_causal=True, **kw)

    wrong = prefix_attention(top_left, q.index_select(2, here), k, v, _starts(seq, cp, 0), {})
    assert _rel(wrong, want) > 1e-2


def test_the_mode_runs_two_prefix_calls_of_the_rank_s_chunks() -> None:
    """The mode's chunk starts are the rank's head and tail chunks (``positions``)."""
    for cp in (2, 3, 4):
        for rank in range(cp):
            mode = ContextAttention(None, 8 * cp, cp, rank)
            chunk = 4
            assert mode.starts == tuple(int(p) for p in positions(8 * cp, cp, rank)[::chunk])
