"""Expert tensor parallelism against one process, on gloo: tiny Hugging Face Mixtral (W=4: tp=2 × dp=2 at
ZeRO-3, selective recompute) and DeepSeek-V3 (W=2: tp=2 alone, full recompute; its MoE layer's routed
experts beside a shared expert, MLA attention) trained 3 steps with the MoE layers' routed experts split
across their hidden dim over tp (``megatron+experts``), attention (and DeepSeek-V3's shared expert) split
as ``megatron`` splits it, the routers replicated. Under recompute the split forward and its collectives
re-run in the backward; at ZeRO-3 FSDP2 shards the experts' tp DTensors over dp.

Bars as ``test_expert_parallel.py``'s (fp32 on CPU: first-step loss and full gradients, SGD losses and
full parameters within 1e-5 relative per tensor, AdamW losses within 1e-3 where run): the full gradients and
parameters are read through the runtime's full state dict, so the experts' reordered gate/up rows
come back as one device's [E, 2I, H]. Each rank really holds half of the experts (its parameter
bytes). A checkpoint (DCP) and the safetensors export of a split run hold one device's tensors, and
restore with the experts split or replicated over tp.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import check_equivalent, every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_cases  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(["etp2_deepseek_v3", "resume_across_etp"], module="moe_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(["etp2_dp2_zero3_mixtral"], module="moe_cases")


def _checked(m: dict, mesh: list[int]) -> list[dict]:
    check_equivalent(m)
    for r in every_rank(m):
        assert r["mesh"] == mesh and r["ep"] == 1
        assert any(layer[1] == "megatron+experts" for layer in r["layers"])
        assert r["recomputed"]  # selective / full: the split forward re-runs in the backward
    return every_rank(m)


def test_deepseek_v3_experts_split_over_tp_match_one_device(w2) -> None:
    _checked(w2["etp2_deepseek_v3"], [1, 1, 2])


def test_a_checkpoint_and_exported_weights_hold_one_devices_experts(w2) -> None:
    """DCP and the safetensors export of a split run hold one device's expert tensors: restored split or
    replicated over tp, the third step is the saved run's (exact up to summation order)."""
    for r in every_rank(w2["resume_across_etp"]):
        assert r["split"] == 1 and r["exported_rel"] == 0.0, r
        for name in ("split", "whole"):
            assert r[f"loaded_rel_{name}"] == 0.0, (name, r)
            assert r[f"loss_rel_{name}"] < 1e-5 and r[f"param_rel_{name}"] < 1e-5, (name, r)
        assert r["weights_rel_whole"] == 0.0, r


def test_mixtral_experts_split_over_tp_beside_zero3_match_one_device_and_are_really_split(w4) -> None:
    """A rank holds half of each routed expert weight, then half of that (ZeRO-3 over dp=2): at most half
    of (the whole model less half the experts). With the experts replicated over tp it would hold at least
    half of them, more than that bound where the experts are over 2/3 of the model."""
    ranks = _checked(w4["etp2_dp2_zero3_mixtral"], [1, 2, 2])
    model, _ = moe_cases.hf_mixtral()
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts / total > 2 / 3  # where the two layouts are told apart by the bound
    for r in ranks:
        assert r["local_bytes_frac"] <= (1 - experts / (2 * total)) / 2 + 1e-3, r["local_bytes_frac"]
