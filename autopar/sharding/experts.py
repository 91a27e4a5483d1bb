"""The tensor-parallel style that also splits a layer's routed experts across their hidden dimension.

Megatron-Core's expert tensor parallelism (ETP): each tp rank holds rows ``[r·I/tp, (r+1)·I/tp)`` of the
gate half and of the up half of a fused gate-up weight [E, 2I, H] and the same columns of the down weight
[E, H, I] (the layouts that take it: ``autopar.experts.layouts.hidden_split_refusal``); every rank routes the
same tokens (the router stays replicated, so no routing
decision changes), computes a partial output and the partials are summed over tp
(``passes/expert_tensor.py``). An MoE layer whose dense part takes the proved ``megatron`` style is
offered a second style, :data:`EXPERTS_STYLE`: the same projections, plus its experts split. The solver
picks between the two per layer on the one price of each (``planning/pricing.py`` reads the style's
``sharded_*`` and all-reduce figures as for any style; ``layer_ops`` marks the experts' GEMMs split),
and the tensor-parallel pass lowers what the chosen style names — what is priced is what runs.

Why here and not in the expert pass: the choice is one more tensor-parallel style of the layer, priced
by the fields every style already has; the expert pass prices and lowers ep, a mesh axis, not a per-layer
choice. The split is exact by linearity (each expert is ``W_down · (act(W_gate x) ⊙ W_up x)``: rows of
``W_gate`` and ``W_up`` and the matching columns of ``W_down`` are independent terms of a sum), for the
layout :func:`experts_refusal` accepts; ``tests/runtime/test_expert_tensor.py`` checks it against one device.

What it leaves out, and why: its experts' saved activations are priced whole on every rank (some are split,
some are the replicated inputs; an overestimate, never an underestimate); sequence parallelism, ep,
cp and pp beside it are not run (:func:`autopar.contract.experts_split_refusal`).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from autopar.experts.layouts import hidden_split_refusal, hidden_split_weights
from autopar.graph import Layer
from autopar.tp_style import TPStyle

EXPERTS_STYLE = "megatron+experts"


def experts_refusal(experts: nn.Module) -> str:
    """Why ``experts`` cannot be split across their hidden dim ("" when they can): the layouts that name
    their gate, up and down weights say (:func:`autopar.experts.layouts.hidden_split_refusal`)."""
    return hidden_split_refusal(experts)


def draft(model: nn.Module, styles: tuple[TPStyle, ...], moe: tuple) -> tuple[TPStyle, ...]:
    """``styles`` plus, for a layer with a ``megatron`` style and splittable experts, :data:`EXPERTS_STYLE`
    naming them (before ops are recorded, so the experts' GEMMs are marked split for it); its figures
    are set by :func:`settle` once the dense style is proved."""
    base = next((s for s in styles if s.name == "megatron"), None)
    if base is None or not moe:
        return styles
    paths, widths = [], set()
    for m in moe:
        try:
            experts = model.get_submodule(m.experts_path)
        except AttributeError:
            return styles
        if m.experts_path == m.module_path or experts_refusal(experts):
            return styles
        paths.append(m.experts_path)
        widths.add(getattr(experts, hidden_split_weights(experts)[1]).shape[2])
    if len(widths) != 1:
        return styles
    return (*styles, dataclasses.replace(base, name=EXPERTS_STYLE, experts=tuple(paths), expert_width=widths.pop()))


def settle(layers: list[Layer]) -> list[Layer]:
    """Each drafted :data:`EXPERTS_STYLE` rebuilt from the layer's proved ``megatron`` style (dropped where it
    was withdrawn): its projections, proof and divisors, plus the intermediate size I; the routed experts'
    parameters and forward FLOPs (top-k experts a token) split; one more all-reduce of the [tokens, H]
    output forward (the partials' sum), and backward two: the input's gradient [tokens, H] and the router's
    top-k weights' [tokens, k] (``passes/expert_tensor.py``); no sequence parallelism."""
    out = []
    for layer in layers:
        drafted = next((s for s in layer.tp_styles if s.name == EXPERTS_STYLE), None)
        if drafted is None:
            out.append(layer)
            continue
        base = next((s for s in layer.tp_styles if s.name == "megatron"), None)
        others = tuple(s for s in layer.tp_styles if s.name != EXPERTS_STYLE)
        if base is None or not base.fwd_allreduce_count:
            out.append(dataclasses.replace(layer, tp_styles=others))
            continue
        stream = base.fwd_allreduce_elems / base.fwd_allreduce_count  # a row output: the [S, H] hidden state
        routed = sum(m.routed_params for m in layer.moe)
        hidden = layer.moe[0].expert_params // (3 * drafted.expert_width)  # a gated expert: 3·I·H parameters
        tokens = stream / hidden  # per sample
        flops = sum(m.top_k * m.expert_flops_per_token for m in layer.moe) * tokens
        count = len(layer.moe)
        style = dataclasses.replace(
            base, name=EXPERTS_STYLE, experts=drafted.experts, expert_width=drafted.expert_width,
            divisors=tuple(sorted({*base.divisors, drafted.expert_width})),
            sharded_params=base.sharded_params + routed,
            sharded_flops_per_sample=base.sharded_flops_per_sample + flops,
            fwd_allreduce_elems=base.fwd_allreduce_elems + stream * count,
            fwd_allreduce_count=base.fwd_allreduce_count + count,
            bwd_allreduce_elems=base.bwd_allreduce_elems + stream * count + tokens * sum(m.top_k for m in layer.moe),
            bwd_allreduce_count=base.bwd_allreduce_count + 2 * count,
            sequence=(), sequence_linked=False,
            sequence_refusal="sequence parallelism is not run beside experts split across their hidden dim")
        out.append(dataclasses.replace(layer, tp_styles=(*others, style)))
    return out


__all__ = ["EXPERTS_STYLE", "draft", "experts_refusal", "settle"]
