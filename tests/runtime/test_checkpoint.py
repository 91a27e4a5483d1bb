"""Distributed checkpoints: saved under one plan and world size, loaded under another, training on
as if never interrupted; visible only when complete; refused, with nothing loaded, when foreign,
incomplete or damaged.

The resharding pairs run once a session on the shared rank pools (:mod:`training_runs`: W = 4
saves, W = 2 loads and saves again), checked on every rank; W = 4 → W = 1 and the error cases run
here, in this process (one rank, no process group). Bar: SGD with momentum (its state resharded
too), every loss and the final parameters within 1e-5 of one process trained without a break.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from distributed import EXACT, every_rank, ok
from equivalence_cases import gpt_tiny, mlp_small
from training_cases import BATCH, PLANS, K, batches, loss_rel, reference, sgd, train, worst

import autopar
from autopar.errors import CheckpointError

PAIRS = [  # (plan that saved, case that loaded it under another plan)
    ("zero3_w4", "zero3_w4_to_tp"),   # ZeRO-3 on 4 ranks → tensor parallel on 2
    ("zero1_w4", "zero1_w4_to_pp"),   # ZeRO-1 on 4 → pipeline on 2
    ("tp_w2", "tp_to_pp"),            # tensor parallel (fused q/k/v rows permuted) → pipeline
    ("tp_w2", "tp_to_zero3"),         # tensor parallel → ZeRO-3
    ("pp_w2", "pp_to_zero1"),         # pipeline (saved asynchronously) → ZeRO-1
    ("pp_w2", "pp_to_tp"),            # pipeline → tensor parallel
]


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.distributed
@pytest.mark.parametrize("saved, loaded", PAIRS, ids=[p[1] for p in PAIRS])
def test_a_checkpoint_loads_under_another_plan_and_trains_on_as_one_device(training, saved: str,
                                                                           loaded: str) -> None:
    ref_losses = every_rank(training.case(loaded))[0]["ref_losses"]
    for first in every_rank(training.case("save_" + saved)):
        assert loss_rel(first["losses"], ref_losses[:K]) < EXACT
    for then in every_rank(training.case(loaded)):
        assert then["step"] == K and then["extra"] == {"data_position": K, "plan": saved}
        assert then["loss_rel"] < EXACT, (then["losses"], then["ref_losses"])
        assert then["param_rel"] < EXACT


@pytest.mark.distributed
def test_an_async_save_holds_the_step_it_was_called_at(training) -> None:
    # the pipeline's save was asynchronous and a step was trained while it was written: the
    # pairs loading it resume from step K exactly, so the save copied the state first
    assert all(m["param_rel"] < EXACT for m in every_rank(training.case("pp_to_zero1")))
    assert all(m["loss_rel"] < EXACT for m in every_rank(training.case("pp_to_tp")))


def _compiled(build=gpt_tiny, plan_name: str = "w1", optimizer=sgd, dtype: str = "fp32", **kwargs):
    torch.manual_seed(0)
    model, inputs = build()
    graph = autopar.capture(model, inputs)
    pins = PLANS[plan_name] if build is gpt_tiny else ()
    plan = autopar.solve(graph, 1, cluster="cpu", dtype=dtype, pins=list(pins),
                         global_batch=BATCH if build is gpt_tiny else 2)
    return autopar.compile(model, world_size=1, plan=plan, graph=graph, optimizer=optimizer, **kwargs)


@pytest.mark.distributed
def test_four_ranks_to_one_process(training) -> None:
    ok(training.case("save_dp2tp2_w4"))
    pm = _compiled()
    assert pm.load(training.dir / "dp2tp2_w4") == {"data_position": K, "plan": "dp2tp2_w4"}
    losses = train(pm, batches(2 * K)[K:])
    ref = reference(2 * K)
    assert loss_rel(losses, ref.losses[K:]) < EXACT
    assert worst(pm.state_dict(full=True), ref.params) < EXACT


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    root = tmp_path_factory.mktemp("ckpt")
    pm = _compiled()
    for step, (x, y) in enumerate(batches(2)):
        pm.train_step(x, y)
        pm.save(root / f"step-{step + 1}", extra={"step": step + 1})
    return root, [float(p.detach().sum()) for p in pm.optimizer.param_groups[0]["params"]]


@pytest.mark.slow
def test_latest_checkpoint_is_the_newest_complete_one(saved, tmp_path: Path) -> None:
    root, _ = saved
    assert autopar.latest_checkpoint(root) == root / "step-2"
    shutil.copytree(root / "step-2", tmp_path / "step-9.partial")  # a save that did not finish
    shutil.copytree(root / "step-2", tmp_path / "step-8")
    (tmp_path / "step-8" / "autopar.json").unlink()
    shutil.copytree(root / "step-1", tmp_path / "step-1")
    assert autopar.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    assert autopar.latest_checkpoint(tmp_path / "none") is None


def _damaged(saved: Path, tmp_path: Path, how: str) -> Path:
    path = tmp_path / f"damaged-{how}"
    shutil.copytree(saved, path)
    data = path / "__0_0.distcp"
    if how == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif how == "truncated":
        data.write_bytes(data.read_bytes()[:-100])
    elif how == "missing":
        data.unlink()
    elif how == "metadata":
        (path / ".metadata").write_bytes(bytes(len((path / ".metadata").read_bytes())))  # same size, zeros
    return path


@pytest.mark.parametrize("how, message", [
    ("flipped", "__0_0.distcp is corrupt (CRC-32"),
    ("truncated", "__0_0.distcp has"),
    ("missing", "__0_0.distcp is missing"),
    ("metadata", ".metadata is corrupt"),
])
def test_a_damaged_checkpoint_is_refused_and_nothing_loads(saved, tmp_path: Path, how: str, message: str) -> None:
    root, _ = saved
    pm = _compiled()
    before = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    with pytest.raises(CheckpointError, match="is damaged") as err:
        pm.load(_damaged(root / "step-1", tmp_path, how))
    assert message in str(err.value) and "Nothing was loaded" in str(err.value)
    assert worst(pm.state_dict(full=True), before) == 0 and not pm.optimizer.state and pm.step == 0


@pytest.mark.slow
def test_an_incomplete_checkpoint_is_refused(saved, tmp_path: Path) -> None:
    root, _ = saved
    shutil.copytree(root / "step-1", tmp_path / "step-5.partial")
    with pytest.raises(CheckpointError, match="incomplete: its save did not finish"):
        _compiled().load(tmp_path / "step-5")
    with pytest.raises(CheckpointError, match="does not exist"):
        _compiled().load(tmp_path / "step-6")


@pytest.mark.slow
def test_a_checkpoint_of_another_model_or_optimizer_is_refused(saved) -> None:
    root, _ = saved
    with pytest.raises(CheckpointError, match="saved for another model"):
        _compiled(build=mlp_small).load(root / "step-1")
    adam = _compiled(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    with pytest.raises(CheckpointError, match=r"optimizer state exp_avg, exp_avg_sq, step of \d+ parameters"):
        adam.load(root / "step-1")
    assert not adam.optimizer.state  # no state made up for the load that was refused
    with pytest.raises(CheckpointError, match="saved without an lr_scheduler"):
        _compiled(lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)).load(root / "step-1")


def test_a_single_process_round_trip_restores_everything(saved) -> None:
    root, sums = saved
    pm = _compiled()
    assert pm.load(root / "step-2") == {"step": 2} and pm.step == 2
    assert [float(p.detach().sum()) for p in pm.optimizer.param_groups[0]["params"]] == sums
    assert all("momentum_buffer" in s for s in pm.optimizer.state.values())


@pytest.mark.slow
def test_a_bf16_checkpoint_holds_the_fp32_masters_and_loads_into_an_fp32_plan(tmp_path: Path) -> None:
    adam = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    bf16 = _compiled(optimizer=adam, dtype="bf16")
    train(bf16, batches(2))
    bf16.save(tmp_path / "bf16")
    fp32 = _compiled(optimizer=adam)
    fp32.load(tmp_path / "bf16")
    masters = {e.fqn: e.value.detach() for e in bf16.entries}
    assert worst(fp32.state_dict(full=True), masters) == 0.0
    assert worst({str(i): v["exp_avg"] for i, v in enumerate(fp32.optimizer.state.values())},
                 {str(i): v["exp_avg"] for i, v in enumerate(bf16.optimizer.state.values())}) == 0.0
