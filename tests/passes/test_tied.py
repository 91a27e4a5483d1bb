"""Tied input/output embeddings (nanoGPT's and GPT-2's default) no longer forbid pipeline cuts.

The first and last stage each hold the tied weight and sum its gradients;
the plan prices the last stage's copy (memory, optimizer state) and the
all-reduce of the gradient. Other ties keep their layers in one stage, and
a plan that needs a cut there says which tie stops it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import zoo

import autopar
from autopar.errors import PinError

PINS = ["pp=2", "dp=1", "tp=1", "microbatches=2", "schedule=1f1b", "recompute=none", "zero=0"]


def _plan(model: nn.Module, *extra: str):
    graph = autopar.capture(model, zoo._ids())
    return graph, autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4, pins=PINS + list(extra))


@pytest.mark.slow
def test_tied_embeddings_let_a_pipeline_cut_the_model_and_price_both_copies() -> None:
    torch.manual_seed(0)
    graph, tied = _plan(zoo.NanoGPT(zoo.NanoConfig(), tie=True))
    head = graph.layer("lm_head")
    assert head.tied_borrowed and head.tied_params == ("transformer.wte.weight",) and head.param_count == 0
    assert graph.layer("transformer.h.0").can_cut_after and not head.cut_blocked_by
    torch.manual_seed(0)
    _, untied = _plan(zoo.NanoGPT(zoo.NanoConfig(), tie=False))
    # the last stage holds the tied weight as the untied model's head holds its own
    assert tied.predicted.memory_per_rank_bytes == untied.predicted.memory_per_rank_bytes
    # and the two copies' gradients are summed once a step, after the pipeline drains
    assert tied.predicted.breakdown.dp_comm_s > untied.predicted.breakdown.dp_comm_s == 0.0


@pytest.mark.slow
def test_tied_ends_run_replicated_over_tp_in_a_pipeline() -> None:
    torch.manual_seed(0)
    graph = autopar.capture(zoo.NanoGPT(zoo.NanoConfig(), tie=True), zoo._ids())
    plan = autopar.solve(graph, 4, cluster="cpu", dtype="fp32", global_batch=4,
                         pins=["pp=2", "tp=2", "microbatches=2", "transformer.h.*:tp=megatron"])
    styles = {l.name: l.choice.tp for l in plan.layers}
    assert styles["transformer.wte"] is None and styles["lm_head"] is None
    with pytest.raises(PinError):
        autopar.solve(graph, 4, cluster="cpu", dtype="fp32", global_batch=4,
                      pins=["pp=2", "tp=2", "microbatches=2", "lm_head:tp=vocab"])


class _TiedMiddle(nn.Module):
    """Two blocks sharing one weight, not the model's ends: a tie that keeps its layers in one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])
        self.blocks[2][0].weight = self.blocks[0][0].weight

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_any_other_tie_keeps_its_layers_together_and_the_error_names_it() -> None:
    graph = autopar.capture(_TiedMiddle(), (torch.randn(4, 8),))
    assert not graph.layer("blocks.0").can_cut_after and "tied between layers" in graph.layer("blocks.0").cut_blocked_by
    assert graph.layer("blocks.2").can_cut_after
    with pytest.raises(PinError, match=r"no cut goes where blocks\.0\.0\.weight is tied between layers blocks\.0, "
                                       r"blocks\.2"):
        autopar.solve(graph, 3, cluster="cpu", dtype="fp32", global_batch=3, pins=["pp=3"])
