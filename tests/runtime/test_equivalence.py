"""Same numbers as one device: every plan against the unsharded model, on gloo processes.

One request per world size to the session's rank pools runs every case (equivalence,
pass units, errors); each test reads its case's metrics, on every rank. Bars (DESIGN.md,
fp32 on CPU): first-step loss and gradients, and parameters and losses over 3
SGD-with-momentum steps, within 1e-5 relative; 3 AdamW steps' losses within 1e-3 on the one
case an engine marks for AdamW (equivalence_cases.ADAM_CASES, checked by test_adam_cases).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from distributed import EXACT, every_rank
from distributed import check_equivalent as _check_equivalent
from equivalence_cases import ADAM_CASES, Spec

pytestmark = pytest.mark.distributed

W2_EQUIV = ["dp", "zero1", "zero2", "zero3", "tp_mlp", "tp_gpt", "hf_llama_tp", "toy_axis_dp_zero3",
            "tp_plain_gpt_narrowed"]
W2_UNITS = ["runtime_cases:" + c for c in ("tp_pass", "zero_pass", "meta_zero3", "meta_tp", "state_dicts",
                                          "ddp_replicas", "err_world_size", "err_bad_batch",
                                          "err_nonscalar_loss")]
W4_EQUIV = ["dp2_tp2_gpt", "mixed_zero_recompute"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2_EQUIV + W2_UNITS)


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4_EQUIV)


@pytest.mark.parametrize("case", W2_EQUIV)
def test_two_ranks_match_one_device(w2: dict, case: str) -> None:
    _check_equivalent(w2[case])


@pytest.mark.parametrize("case", W4_EQUIV)
def test_four_ranks_match_one_device(w4: dict, case: str) -> None:
    _check_equivalent(w4[case])
    assert w4[case]["mesh"] == [1, 2, 2]


def test_a_toy_axis_is_a_dimension_of_the_device_mesh_and_changes_no_number(w2: dict) -> None:
    """A mesh axis declared through autopar.mesh alone reaches the device mesh (lowering reads the
    plan's mesh) and, at degree 1, trains exactly as the plan without it."""
    toy, plain = w2["toy_axis_dp_zero3"], w2["zero3"]
    for r in every_rank(toy):
        assert r["mesh_dims"] == ["pp", "dp", "cp", "tp", "xp"]
    for r in every_rank(plain):
        assert r["mesh_dims"] == ["pp", "dp", "cp", "tp"]
    assert [r["losses"] for r in every_rank(toy)] == [r["losses"] for r in every_rank(plain)]


def test_a_block_proved_on_a_narrower_copy_runs_at_full_size(w2: dict) -> None:
    """A config-less block over the simulation limit is proved on a copy of its own class (a narrow
    copy per group of twin blocks) and trains at tp=2 as one device does (checked above)."""
    m = w2["tp_plain_gpt_narrowed"]
    assert m["narrowed"] and all(f > 1 for f in m["narrowed"])
    assert [l[1] for l in m["layers"] if l[0].startswith("blocks.")] == ["megatron", "megatron"]


def test_plans_are_the_pinned_ones(w2: dict, w4: dict) -> None:
    assert w2["zero2"]["microbatches"] == 2  # accumulation exercised
    assert w2["tp_gpt"]["mesh"] == [1, 1, 2] and w2["dp"]["mesh"] == [1, 2, 1]
    mixed = {name: (tp, zero, rc) for name, tp, zero, rc, _ in w4["mixed_zero_recompute"]["layers"]}
    assert mixed["tok_emb"] == ("vocab", 0, False) and mixed["pos_emb"] == ("vocab", 1, False)
    assert mixed["blocks.0"] == ("megatron", 3, True) and mixed["blocks.1"] == ("megatron", 1, True)
    assert mixed["ln_f"] == (None, 2, True) and mixed["lm_head"] == ("vocab", 3, False)
    assert w4["mixed_zero_recompute"]["microbatches"] == 2


def _fracs(m: dict) -> list[float]:
    return [r["local_bytes_frac"] for r in every_rank(m)]


def test_sharded_parameters_take_their_share(w2: dict, w4: dict) -> None:
    assert _fracs(w2["dp"]) == pytest.approx([1.0] * 2)
    assert _fracs(w2["zero3"]) == pytest.approx([0.5] * 2, abs=0.01)
    assert _fracs(w2["tp_gpt"]) == pytest.approx([0.5] * 2, abs=0.02)  # LayerNorms replicated
    assert _fracs(w4["dp2_tp2_gpt"]) == pytest.approx([0.25] * 4, abs=0.01)


def test_losses_are_the_same_on_every_rank(w2: dict) -> None:
    # each rank trained on its half of the batch; train_step all-reduces the loss
    losses = [r["losses"] for r in every_rank(w2["zero1"])]
    assert all(isinstance(x, float) for x in losses[0])
    assert losses[1] == losses[0]


def test_tensor_parallel_pass(w2: dict) -> None:
    for m in every_rank(w2["runtime_cases:tp_pass"]):
        assert m["layers"] == ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "lm_head"]
        assert m["permuted"] == [f"blocks.{i}.attn.c_attn.{p}" for i in (0, 1) for p in ("bias", "weight")]
        assert m["c_attn_local"] == [48, 32] and m["c_proj_local"] == [32, 16]
        assert m["tok_emb_local"] == [128, 32] and m["lm_head_local"] == [128, 32]
        # the model's own attributes stay whole: its forward runs under the sharding rules
        assert (m["n_head"], m["d_model"]) == (4, 32)
        assert m["forward_rel"] < EXACT


def test_zero_pass(w2: dict) -> None:
    for m in every_rank(w2["runtime_cases:zero_pass"]):
        # each block its own unit; embeddings, norm and head (zero 0, 1, 1, 3) share the root's,
        # at the highest of their stages
        assert m["zero_by_path"] == {"blocks.0": 3, "blocks.1": 2, "": 3}
        assert m["deferred"] == []  # no ZeRO-0/1 unit left to sync on the last microbatch only
        assert m["types"]["tok_emb"] == "Embedding" and m["types"]["blocks.0"].startswith("FSDP")
        assert m["all_fsdp"]
        assert m["blocks0_c_fc_local"] == [64, 32]  # ZeRO-3 over dp=2: half of 128 rows
        assert m["tok_emb_local"] == [128, 32]  # sharded with the root, ZeRO-3


def test_meta_model_is_materialised_shard_by_shard(w2: dict) -> None:
    for m in every_rank(w2["runtime_cases:meta_zero3"]):
        assert m["local_bytes_frac"] == pytest.approx(0.5, abs=0.01)
        assert not m["any_meta"] and m["loss"] == pytest.approx(m["loss"])  # finite


def test_meta_model_under_tensor_parallelism_trains(w2: dict) -> None:
    for m in every_rank(w2["runtime_cases:meta_tp"]):
        assert m["local_bytes_frac"] == pytest.approx(0.5, abs=0.02)
        assert m["losses"][-1] < m["losses"][0]  # default AdamW learns the fixed batch


def test_ddp_replicas_start_from_the_first_ranks_weights(w2: dict) -> None:
    for m in every_rank(w2["runtime_cases:ddp_replicas"]):
        assert m["replicas_rel"] == 0.0 and m["first_rank_rel"] == 0.0


def test_full_state_dict_is_the_original_layout(w2: dict) -> None:
    for m in every_rank(w2["runtime_cases:state_dicts"]):
        assert m["same_keys"] and m["max_rel"] == 0.0


@pytest.mark.parametrize("case,error,words", [
    ("err_world_size", "PlanError", "4 ranks but 2 were launched"),
    ("err_nonscalar_loss", "BatchError", "scalar"),
])
def test_bad_input_is_a_typed_error_on_every_rank(w2: dict, case: str, error: str, words: str) -> None:
    for m in every_rank(w2["runtime_cases:" + case]):
        assert m["raised"] == error and words in m["message"]


def test_bad_batch(w2: dict) -> None:
    for m in every_rank(w2["runtime_cases:err_bad_batch"]):
        assert m["local"]["raised"] == "BatchError" and "local_batch()" in m["local"]["message"]
        assert m["global"]["raised"] == "BatchError" and "dp 2" in m["global"]["message"]


def test_adam_cases() -> None:
    """The AdamW leg runs on exactly the cases ADAM_CASES names, one an engine (a Spec with adam=True
    found in any case module's tables, a bare Spec or the first of a tuple)."""
    marked = set()
    for path in sorted(Path(__file__).resolve().parents[1].glob("*_cases.py")):
        module = importlib.import_module(path.stem)
        for table in (v for v in vars(module).values() if isinstance(v, dict)):
            for name, value in table.items():
                spec = value[0] if isinstance(value, tuple) and value else value
                if isinstance(spec, Spec) and spec.adam:
                    marked.add(f"{path.stem}:{name}")
    assert marked == set(ADAM_CASES.values())
    assert len(set(ADAM_CASES.values())) == len(ADAM_CASES)
