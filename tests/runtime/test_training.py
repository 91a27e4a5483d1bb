"""The training loop users write: clipping by the global gradient norm, learning-rate schedules,
evaluation, data-parallel coordinates, bf16 mixed precision as priced, dropout streams.

The distributed cases run once a session on the shared rank pools (:mod:`training_runs`); each is
compared, on every rank, with the same training in one process. Bars: clipping, schedules and evaluation 1e-5 relative
(fp32, SGD with momentum); bf16 losses within ``BF16_LOSS_TOL`` of the fp32 run of the same plan
(bf16 compute with fp32 masters, optimizer state and loss: 1e-4 was measured).
"""

from __future__ import annotations

import pytest
import torch
from distributed import EXACT, every_rank
from equivalence_cases import gpt_tiny
from training_cases import BATCH, BF16_LOSS_TOL, MAX_NORM, PLANS, batches, loss_rel, reference, sgd, warmup, worst

import autopar


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["clip_zero3", "clip_tp", "clip_pp"])
def test_clipping_schedules_and_evaluation_match_one_device(training, name: str) -> None:
    for m in every_rank(training.case(name)):
        assert min(m["ref_norms"]) > MAX_NORM  # every step was clipped
        assert m["norm_rel"] < EXACT, (m["norms"], m["ref_norms"])
        assert m["param_rel"] < EXACT
        assert m["eval_rel"] < EXACT and m["eval_moved"] == 0.0
        assert m["step"] == 3 and m["lr"] == pytest.approx(0.05)  # the warm-up schedule ran


@pytest.mark.distributed
def test_dp_rank_and_size_feed_a_sampler(training) -> None:
    assert [m["dp"] for m in every_rank(training.case("clip_zero3"))] == [[0, 2], [1, 2]]
    assert [m["dp"] for m in every_rank(training.case("clip_tp"))] == [[0, 1], [0, 1]]


@pytest.mark.distributed
@pytest.mark.parametrize("name, masters", [("bf16_zero3", False), ("bf16_ddp", True), ("bf16_tp", True),
                                           ("bf16_pp", True)])
def test_bf16_computes_in_bf16_and_keeps_fp32_masters(training, name: str, masters: bool) -> None:
    for m in every_rank(training.case(name)):
        assert m["optimized"] == ["torch.float32"] and m["state"] == ["torch.float32"]
        assert m["compute"] == ["torch.bfloat16"]
        assert m["masters"] is masters  # FSDP2's sharded fp32 parameters are the masters themselves
        assert m["module"] == (["torch.bfloat16"] if masters else ["torch.float32"])
        assert m["loss_rel"] < BF16_LOSS_TOL, (m["losses"], m["fp32_losses"])
        assert m["losses"] != m["fp32_losses"]  # it did run in bf16


@pytest.mark.distributed
def test_tensor_parallel_ranks_draw_the_same_dropout_masks(training) -> None:
    for m in every_rank(training.case("dropout_tp")):  # each rank gathered every rank's loss
        assert m["tp_losses"][0] == m["tp_losses"][1]
        assert m["next_step_differs"]  # each step has a stream of its own


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def _one_process(dtype: str = "fp32", **kwargs):
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    graph = autopar.capture(model, inputs)
    plan = autopar.solve(graph, 1, cluster="cpu", dtype=dtype, pins=list(PLANS["w1"]), global_batch=BATCH)
    return autopar.compile(model, world_size=1, plan=plan, graph=graph, **kwargs)


@pytest.mark.slow
def test_one_process_clips_and_schedules_like_torch() -> None:
    pm = _one_process(optimizer=sgd, max_grad_norm=MAX_NORM, lr_scheduler=warmup)
    norms = []
    for x, y in batches(3):
        pm.train_step(x, y)
        norms.append(pm.grad_norm)
    ref = reference(3, clip=MAX_NORM, scheduler=True)
    assert loss_rel(norms, ref.grad_norms) < EXACT
    assert worst(pm.state_dict(full=True), ref.params) < EXACT


def test_without_max_grad_norm_nothing_is_measured() -> None:
    pm = _one_process(optimizer=sgd)
    pm.train_step(*batches(1)[0])
    assert pm.grad_norm is None and pm.step == 1


@pytest.mark.slow
def test_one_process_bf16_keeps_fp32_masters_and_follows_fp32() -> None:
    adam = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    bf16, fp32 = _one_process("bf16", optimizer=adam), _one_process(optimizer=adam)
    assert all(p.dtype == torch.bfloat16 for p in bf16.module.parameters())
    assert all(p.dtype == torch.float32 for g in bf16.optimizer.param_groups for p in g["params"])
    got = [bf16.train_step(x, y) for x, y in batches(3)]
    want = [fp32.train_step(x, y) for x, y in batches(3)]
    assert loss_rel(got, want) < BF16_LOSS_TOL
    x, y = batches(4)[-1]
    assert abs(bf16.evaluate(x, y) - fp32.evaluate(x, y)) / fp32.evaluate(x, y) < BF16_LOSS_TOL
    # the bf16 weights are the masters rounded
    for p, master in zip(bf16.masters.params, bf16.masters.masters):
        assert torch.equal(p, master.to(torch.bfloat16))
