"""The loss's memory as priced (``PriceTable.loss_bytes``) and as torch's cross-entropy holds it: at its
peak, while log-softmax's backward runs, three fp32 tensors the size of the logits are live (the saved
log-probabilities, the gradient it takes and the one it gives), as an H200 showed under a bf16 plan
(``benchmarks/gpu_memory_peak.py``); pricing had two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from synthetic import transformer_graph

from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.mesh import Mesh
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable


def _peak_bytes(fn) -> int:
    """The most bytes of CPU tensors live at once while ``fn`` ran, above those live before it."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        todo.extend(node.children)
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


def test_cross_entropy_on_upcast_logits_holds_three_fp32_logits_at_its_peak() -> None:
    tokens, vocab = 512, 8192
    h = torch.randn(tokens, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, 16, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))

    def step() -> None:  # the runtime's loss: bf16 logits upcast for cross-entropy, not held past it
        F.cross_entropy((h @ w.t()).float(), y).backward()

    step()
    fp32_logits = tokens * vocab * 4
    assert _peak_bytes(step) / fp32_logits == pytest.approx(3.0, abs=0.15)


@pytest.mark.parametrize("schedule, m, kept", [(ScheduleKind.NONE, 1, 1), (ScheduleKind.GPIPE, 4, 4),
                                               (ScheduleKind.ONE_F_ONE_B, 4, 1)])
def test_the_loss_is_priced_as_its_kept_log_probs_and_two_more_at_its_peak(schedule: ScheduleKind, m: int,
                                                                          kept: int) -> None:
    graph = transformer_graph(2, 256, 64, vocab=1024, heads=4)
    pp = 1 if schedule is ScheduleKind.NONE else 2
    table = PriceTable(graph, Configuration(Mesh(pp=pp), m, Schedule(schedule)), PRESETS["h100-80g"].for_world_size(pp),
                       TrainingSpec(4 * m, dtype="bf16"))
    one = 4 * graph.output_bytes_per_sample * 4 / graph.dtype_bytes  # a microbatch's fp32 logits
    peak, beside_layer = table.loss_bytes
    assert peak == pytest.approx((kept + 2) * one, abs=2) and beside_layer == pytest.approx((kept - 1) * one, abs=2)
    last = table.rank_workspace_bytes(pp - 1)
    assert last - table.workspace_bytes == max(peak - table.layer_transient_bytes, beside_layer)
    assert pp == 1 or table.rank_workspace_bytes(0) == table.workspace_bytes
