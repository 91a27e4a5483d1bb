"""Pipeline parallelism: stage splitting in-process, and pp > 1 plans against one device.

The distributed cases (:mod:`pipeline_cases`) run in one request per world size
to the session's rank pools (2, 4, 8 gloo processes), checked on every rank.
Bars (DESIGN.md, fp32 on CPU): first-step loss and gradients, and parameters and
losses over 3 SGD-with-momentum steps, within 1e-5 relative; 3 AdamW steps'
losses within 1e-3.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from distributed import check_equivalent as _check_equivalent
from distributed import every_rank
from equivalence_cases import gpt_tiny, hf_llama, mlp_small

import autopar
from autopar.cost_models.pipeline import ScheduleKind
from autopar.errors import LoweringError
from autopar.mesh import Mesh
from autopar.passes.stage_split import split_model

W2_EQUIV = ["pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_model_parallel", "pp_hf_llama", "pp_hf_llama_recompute"]
W2_ERRORS: list[str] = []
W2_UNITS = ["meta_pipeline"]
W4_EQUIV = ["pp2_dp2_zero3", "pp2_dp2_hf_llama", "pp2_dp2_plain_dp", "pp2_dp2_interleaved", "pp2_dp2_block_stages"]
W4_MORE = ["pp2_tp2_hf_llama"]
W8_EQUIV = ["pp2_dp2_tp2", "solver_pick_w8"]


# ------------------------------------------------------------------ splitting, in-process


def _plan(graph, pins: list[str], world: int = 2, batch: int = 8):
    base = ["pp=2", "dp=1", "tp=1", "zero=0", "recompute=none", "microbatches=4"]
    return autopar.solve(graph, world, cluster="cpu", dtype="fp32", global_batch=batch, pins=base + pins)


def _chain(modules: list[nn.Module], inputs: tuple) -> torch.Tensor:
    h: object = inputs
    for mod in modules:
        h = mod(*h) if isinstance(h, tuple) else mod(h)
    return h  # type: ignore[return-value]


def _llama_example():
    import llama

    return llama.llama_tiny(device="cpu")


@pytest.mark.parametrize("build,pins", [
    (gpt_tiny, ["schedule=1f1b"]),
    (gpt_tiny, ["schedule=interleaved_1f1b", "chunks=2"]),
    (mlp_small, ["schedule=1f1b"]),
    (_llama_example, ["schedule=1f1b"]),
    (hf_llama, ["schedule=interleaved_1f1b", "chunks=2"]),
])
@pytest.mark.slow
def test_stages_chain_to_the_model(build, pins: list[str]) -> None:
    torch.manual_seed(0)
    model, inputs = build()
    graph = autopar.capture(model, inputs)
    plan = _plan(graph, pins)
    mb = tuple(t[:1].expand(2, *t.shape[1:]).clone() for t in inputs)
    split = split_model(model, mb, graph, plan)
    assert len(split.modules) == plan.stages
    ref = model(*mb)
    ref = ref.logits if hasattr(ref, "logits") else ref
    assert torch.equal(_chain(split.modules, mb), ref)
    # the model's own parameter objects, under their original names, each in one stage
    own = dict(model.named_parameters())
    names = [n for m in split.modules for n, _ in m.named_parameters()]
    assert sorted(names) == sorted(own)
    assert all(p is own[n] for m in split.modules for n, p in m.named_parameters())
    assert split.tracer == ("export-layers" if build is hf_llama else "fx-layers")


@pytest.mark.slow
def test_layer_modules_are_called_in_fx_stages() -> None:
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    graph = autopar.capture(model, inputs)
    split = split_model(model, inputs, graph, _plan(graph, ["schedule=1f1b", "blocks.1:stage=1"]))
    called = {str(n.target) for m in split.modules for n in m.graph.nodes if n.op == "call_module"}
    assert {"blocks.0", "blocks.1", "tok_emb", "lm_head"} <= called
    assert split.modules[1].get_submodule("blocks.1") is model.blocks[1]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_tied_ends_may_be_cut_apart_but_any_other_tie_may_not() -> None:
    model, inputs = _Tied(), (torch.zeros(2, 4, dtype=torch.long),)
    graph = autopar.capture(model, inputs)
    assert graph.layer("blocks.0").can_cut_after and graph.layer("head").tied_borrowed  # first/last: free
    # a hand-made plan that cuts between two blocks sharing a weight is refused when lowering
    model.blocks[1][0].weight = model.blocks[0][0].weight
    graph = autopar.capture(model, inputs)
    flat = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=8, pins=["pp=1", "tp=1"])
    layers = tuple(replace(l, stage=0 if i < 2 else 1) for i, l in enumerate(flat.layers))
    cut = replace(flat, mesh=Mesh(pp=2), layers=layers, schedule=ScheduleKind.GPIPE)
    with pytest.raises(LoweringError, match="tied"):
        split_model(model, inputs, graph, cut)


# ------------------------------------------------------------------ distributed


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2_EQUIV + W2_ERRORS + W2_UNITS, module="pipeline_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4_EQUIV + W4_MORE, module="pipeline_cases")


@pytest.fixture(scope="module")
def w8(ranks) -> dict[str, dict]:
    return ranks(8).run(W8_EQUIV, module="pipeline_cases")


@pytest.mark.distributed
@pytest.mark.parametrize("case", W2_EQUIV)
def test_two_ranks_match_one_device(w2: dict, case: str) -> None:
    _check_equivalent(w2[case])
    assert w2[case]["mesh"] == [2, 1, 1]


@pytest.mark.distributed
def test_pinned_schedules_are_the_ones_run(w2: dict) -> None:
    assert (w2["pp_gpipe"]["schedule"], w2["pp_1f1b"]["schedule"]) == ("gpipe", "1f1b")
    assert (w2["pp_interleaved"]["schedule"], w2["pp_interleaved"]["chunks"]) == ("interleaved_1f1b", 2)
    assert max(w2["pp_interleaved"]["stages"]) == 3  # 4 virtual stages on 2 ranks
    assert w2["pp_model_parallel"]["microbatches"] == 1
    assert w2["pp_hf_llama"]["tracer"] == "export-layers" and w2["pp_1f1b"]["tracer"] == "fx-layers"


def _fracs(m: dict) -> list[float]:
    return [r["local_bytes_frac"] for r in every_rank(m)]


@pytest.mark.distributed
def test_each_pp_rank_holds_its_stages_only(w2: dict, w4: dict, w8: dict) -> None:
    assert _fracs(w2["pp_1f1b"]) == pytest.approx([0.5] * 2, abs=0.05)
    assert _fracs(w4["pp2_dp2_zero3"]) == pytest.approx([0.25] * 4, abs=0.03)
    assert _fracs(w8["pp2_dp2_tp2"]) == pytest.approx([0.125] * 8, abs=0.03)


@pytest.mark.distributed
def test_meta_model_is_materialised_stage_by_stage(w2: dict) -> None:
    for m in every_rank(w2["meta_pipeline"]):
        assert not m["any_meta"]
        assert 0.3 < m["local_bytes_frac"] < 0.7  # its own stage only, not the whole model
        assert all(l == l for l in m["losses"]) and m["losses"][-1] < m["losses"][0]  # finite, learns


@pytest.mark.distributed
def test_export_captured_model_keeps_recompute_and_tp_inside_its_stages(w2: dict, w4: dict) -> None:
    m = w2["pp_hf_llama_recompute"]
    _check_equivalent(m)
    assert m["tracer"] == "export-layers" and all(rc for name, _, _, rc, _ in m["layers"] if ".layers." in name)
    m = w4["pp2_tp2_hf_llama"]
    _check_equivalent(m)
    assert m["mesh"] == [2, 1, 2] and all(tp == "megatron" for name, tp, *_ in m["layers"] if ".layers." in name)


@pytest.mark.distributed
@pytest.mark.parametrize("case", W4_EQUIV)
def test_four_ranks_match_one_device(w4: dict, case: str) -> None:
    _check_equivalent(w4[case])
    assert w4[case]["mesh"] == [2, 2, 1]


@pytest.mark.distributed
@pytest.mark.parametrize("case", W8_EQUIV)
def test_eight_ranks_match_one_device(w8: dict, case: str) -> None:
    _check_equivalent(w8[case])
    pp, dp, tp = w8[case]["mesh"]
    assert pp * dp * w8[case]["cp"] * tp == 8
