"""Models as their upstream writes them (tests/zoo.py) train the numbers one device trains.

For each model: Megatron tensor parallelism on its blocks (tp=2, the style
asserted applied from the plan), ZeRO-3 (dp=2), and both on a 2-D mesh
(dp=2 × tp=2, ZeRO-3); a 1F1B pipeline with TP and recompute on the blocks
inside its stages (Hugging Face models are exported with their layers' call
signatures kept, so stages call the layer modules); and a 3-D plan on 8 ranks
for two of them (nanoGPT's 3-D plan is its tied default's, interleaved: the
tied test). Bars as in test_equivalence: first-step gradients and
parameters after 3 SGD-with-momentum steps within 1e-5 relative.
"""

from __future__ import annotations

import pytest
from distributed import check_equivalent, every_rank
from zoo import MODELS, TIED
from zoo_cases import SEQUENCE_MODELS

from autopar.choice import Recompute

pytestmark = pytest.mark.distributed

SEQUENCE_W4 = ("nanogpt", "hf_gpt2", "hf_llama", "hf_phi3", "hf_neox")  # the 2-D and pipeline plans, on five

W2 = ([f"zoo_cases:{m}/{kind}" for m in MODELS for kind in ("tp", "zero3")] + [f"zoo_cases:{m}/pp2" for m in TIED]
      + ["zoo_cases:tp_dropout_masks"] + [f"zoo_cases:{m}/sp" for m in SEQUENCE_MODELS]
      + ["zoo_cases:nanogpt/sp_mixed"])
W4 = ([f"zoo_cases:{m}/{kind}" for m in MODELS for kind in ("dp2tp2", "pp2tp2")]
      + [f"zoo_cases:{m}/{kind}" for m in SEQUENCE_W4 for kind in ("dp2tp2sp", "pp2tp2sp")])
# 3-D (pp × dp × tp, ZeRO-3) on 8 ranks: two Hugging Face models under 1F1B here, and nanoGPT's own code under
# the interleaved schedule in nanogpt_tied/pp2dp2 (which left nanogpt/3d nothing of its own to check: its
# every pair of axes runs at W=4 above, and examples/gpt's 3-D 1F1B is test_pipeline's pp2_dp2_tp2)
W8 = [f"zoo_cases:{m}/3d" for m in ("hf_llama", "hf_neox")] + [f"zoo_cases:{m}/pp2dp2" for m in TIED]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2)


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4)


@pytest.fixture(scope="module")
def w8(ranks) -> dict[str, dict]:
    return ranks(8).run(W8)


def _blocks_tensor_parallel(metrics: dict, model: str) -> None:
    pattern = MODELS[model][1].removesuffix(".*")
    blocks = [(name, tp) for name, tp, *_ in metrics["layers"] if name.startswith(pattern + ".")]
    assert blocks and all(tp == "megatron" for _, tp in blocks), blocks


@pytest.mark.parametrize("model", list(MODELS))
def test_tensor_parallel_blocks_match_one_device(w2: dict, model: str) -> None:
    metrics = w2[f"zoo_cases:{model}/tp"]
    check_equivalent(metrics)
    assert metrics["mesh"] == [1, 1, 2]
    _blocks_tensor_parallel(metrics, model)


@pytest.mark.parametrize("model", list(MODELS))
def test_zero3_matches_one_device(w2: dict, model: str) -> None:
    metrics = w2[f"zoo_cases:{model}/zero3"]
    check_equivalent(metrics)
    assert metrics["mesh"] == [1, 2, 1] and all(zero == 3 for _, _, zero, *_ in metrics["layers"])


@pytest.mark.parametrize("model", list(MODELS))
def test_tensor_parallel_inside_zero3_on_a_2d_mesh_matches_one_device(w4: dict, model: str) -> None:
    metrics = w4[f"zoo_cases:{model}/dp2tp2"]
    check_equivalent(metrics)
    assert metrics["mesh"] == [1, 2, 2]
    _blocks_tensor_parallel(metrics, model)


@pytest.mark.parametrize("model", list(MODELS))
def test_a_pipeline_keeps_tensor_parallelism_and_recompute_inside_its_stages(w4: dict, model: str) -> None:
    metrics = w4[f"zoo_cases:{model}/pp2tp2"]
    check_equivalent(metrics)
    assert metrics["mesh"] == [2, 1, 2] and metrics["schedule"] == "1f1b"
    _blocks_tensor_parallel(metrics, model)
    prefix = MODELS[model][1].removesuffix(".*") + "."
    assert all(rc for name, _, _, rc, _ in metrics["layers"] if name.startswith(prefix))
    assert metrics["tracer"] in ("fx-layers", "export-layers")


def _blocks_sequence_parallel(metrics: dict, model: str) -> None:
    pattern = MODELS[model][1].removesuffix(".*")
    blocks = [(tp, sp) for name, tp, _, _, sp in metrics["layers"] if name.startswith(pattern + ".")]
    assert blocks and all(tp == "megatron" and sp for tp, sp in blocks), blocks


@pytest.mark.parametrize("model", SEQUENCE_MODELS)
def test_sequence_parallel_blocks_match_one_device(w2: dict, model: str) -> None:
    metrics = w2[f"zoo_cases:{model}/sp"]
    check_equivalent(metrics)
    assert metrics["mesh"] == [1, 1, 2]
    _blocks_sequence_parallel(metrics, model)


@pytest.mark.parametrize("model", SEQUENCE_W4)
def test_sequence_parallelism_inside_zero3_and_inside_pipeline_stages_matches_one_device(w4: dict, model: str) -> None:
    """dp=2 × tp=2 with ZeRO-3, and a 1F1B pipeline of 2 with selective recompute on the blocks: the
    hidden state crosses the pipeline boundary whole (gathered before it is sent)."""
    for kind, mesh in (("dp2tp2sp", [1, 2, 2]), ("pp2tp2sp", [2, 1, 2])):
        metrics = w4[f"zoo_cases:{model}/{kind}"]
        check_equivalent(metrics)
        assert metrics["mesh"] == mesh
        _blocks_sequence_parallel(metrics, model)


def test_a_plan_mixing_sequence_parallelism_and_recompute_per_block_matches_one_device(w2: dict) -> None:
    metrics = w2["zoo_cases:nanogpt/sp_mixed"]
    check_equivalent(metrics)
    by_name = {name: (sp, rc) for name, _, _, rc, sp in metrics["layers"]}
    assert by_name["transformer.h.0"] == (True, Recompute.FULL)
    assert by_name["transformer.h.1"] == (False, Recompute.SELECTIVE)


@pytest.mark.parametrize("model", [c.split(":")[1].split("/")[0] for c in W8 if c.endswith("/3d")])
def test_a_3d_plan_on_8_ranks_matches_one_device(w8: dict, model: str) -> None:
    metrics = w8[f"zoo_cases:{model}/3d"]
    check_equivalent(metrics)
    assert metrics["mesh"] == [2, 2, 2]
    _blocks_tensor_parallel(metrics, model)


@pytest.mark.parametrize("model", list(TIED))
def test_tied_embeddings_split_across_pipeline_stages_match_one_device(w2: dict, w8: dict, model: str) -> None:
    """nanoGPT's and GPT-2's default: the first and last stage each hold the tied weight and sum its
    gradients (a 1F1B pipeline of 2, and an interleaved 3-D plan with TP and ZeRO-3)."""
    for metrics, mesh in ((w2[f"zoo_cases:{model}/pp2"], [2, 1, 1]), (w8[f"zoo_cases:{model}/pp2dp2"], [2, 2, 2])):
        check_equivalent(metrics)
        assert metrics["mesh"] == mesh
        stages = {name: stage for name, stage in zip((l[0] for l in metrics["layers"]), metrics["stages"])}
        assert stages["transformer.wte"] == 0 and stages["lm_head"] == max(stages.values()) > 0


def test_tp_ranks_draw_the_same_dropout_masks_where_the_activation_is_replicated(w2: dict) -> None:
    """Each rank seeded differently before training: the runtime seeds the tp group alike, so the
    replicated parameters (LayerNorms, row biases) of nanoGPT with dropout 0.1 stay equal."""
    for m in every_rank(w2["zoo_cases:tp_dropout_masks"]):
        assert m["dropout_on"] and m["spread"] == 0.0
