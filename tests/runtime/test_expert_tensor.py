"""Expert tensor parallelism against one process, on gloo (W=2): tiny Hugging Face Mixtral and DeepSeek-V3
(its MoE layer: routed experts beside a shared expert, MLA attention) trained 3 steps with the MoE
layers' routed experts split across their hidden dim over tp=2 (``megatron+experts``), attention (and
DeepSeek-V3's shared expert) split as ``megatron`` splits it, the routers replicated; under selective
(Mixtral) and full (DeepSeek-V3) recompute, so the split forward and its collectives also re-run in the
backward.

Bars as ``test_expert_parallel.py``'s (fp32 on CPU: first-step loss and full gradients, SGD losses and
full parameters within 1e-5 relative per tensor, AdamW losses within 1e-3): the full gradients and
parameters are read through the runtime's full state dict, so the experts' ``_StridedShard`` gate/up
layout gathers back to one device's [E, 2I, H]. Each rank really holds half of the experts (its parameter
bytes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import check_equivalent, every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_cases  # noqa: E402

pytestmark = pytest.mark.distributed

CASES = ["etp2_mixtral", "etp2_deepseek_v3"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(CASES, module="moe_cases")


@pytest.mark.parametrize("case", CASES)
def test_experts_split_over_tp_match_one_device(w2, case):
    check_equivalent(w2[case])
    for r in every_rank(w2[case]):
        assert r["mesh"] == [1, 1, 2] and r["ep"] == 1
        assert any(layer[1] == "megatron+experts" for layer in r["layers"])
        assert r["recomputed"]  # under recompute (selective, full): the split forward re-runs in the backward



def test_experts_really_split(w2):
    """A rank holds half of each routed expert weight: at most the whole model less half the experts (with
    the experts replicated over tp it would hold them whole: 1/2 + E/2T of the bytes, over this bound)."""
    model, _ = moe_cases.hf_mixtral()
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts / total > 0.5  # where the two layouts are told apart by the bound
    for r in every_rank(w2["etp2_mixtral"]):
        assert r["local_bytes_frac"] <= 1 - experts / (2 * total) + 1e-9, r["local_bytes_frac"]
