"""float8 training (issue 24, third slice) on CPU, through torchao's emulation: the plan's linears are
converted and nothing else, training on 2 gloo ranks matches one float8 process, and float8 moves
training by its rounding only: under DDP and ZeRO over dp, and under context parallelism (cp=2 at
ZeRO-3, K/V all-gather, Ulysses and ring attention), where a rank's linears see its S/cp tokens.

torchao's CPU emulation (``Float8LinearConfig.emulate``) casts for real, so what differs from a GPU
is only the GEMM's accumulation. Two bars, by recipe:

- ``rowwise``: its scales are powers of 2 (``round_scales_to_power_of_2``), and multiplying by a power
  of 2 does not change how a value rounds to float8; so the scales that differ between a rank's half
  of the batch and the whole batch change nothing, and 2 ranks match one float8 process within
  :data:`EXACT` (measured: ~1e-7).
- ``tensorwise``: its scale is amax / 448 exactly, the amax of the rank's own half of the batch, so
  the rounding differs from one process's as much as float8 differs from fp32 (measured, 3 SGD-momentum
  steps, 4 samples: gradients 3.7e-2 (GPT) and 7.9e-2 (Llama) over all tensors together against
  one float8 process, 3.7e-2 and 7.3e-2 against fp32). :data:`FLOAT8_TOL` bounds it; gradients not
  averaged over dp (a lowering bug) are off by 100%, and the plan's linears must all be converted.

Every case also checks that float8 did round (not the fp32 run) and stays within :data:`FLOAT8_TOL` of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import every_rank

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

EXACT = 1e-5
FLOAT8_TOL = 0.15  # gradients and SGD updates over all tensors together (docstring)
LOSS_TOL = 1e-2
CASES = ["ddp_tensorwise", "zero3_tensorwise", "zero3_rowwise", "hf_llama_zero3", "hf_llama_ddp_rowwise",
         "cp2_rowwise", "cp2_ulysses_tensorwise", "hf_llama_cp2_ring_rowwise"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    pytest.importorskip("torchao", reason="float8 training needs torchao (pip install 'autopar[float8]')")
    return ranks(2).run(CASES, module="float8_cases")


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_float8_trains_on_two_ranks_as_one_float8_process(w2: dict, case: str) -> None:
    for m in every_rank(w2[case]):
        assert "error" not in m, m
        assert m["converted"] == m["planned"] and m["converted"], m
        if m["recipe"] == "rowwise":
            assert m["float8_loss_rel"] < EXACT and m["float8_grad_rel"] < EXACT, m
            assert m["float8_updates_rel"] < EXACT, m
        else:
            assert m["float8_loss_rel"] < LOSS_TOL and m["float8_grads_rel"] < FLOAT8_TOL, m
            assert m["float8_updates_rel"] < FLOAT8_TOL, m
        # float8 does round: it is not the fp32 run (the conversion took effect), yet close to it
        assert 1e-3 < m["fp32_grads_rel"] < FLOAT8_TOL and m["fp32_updates_rel"] < FLOAT8_TOL, m
        assert m["fp32_loss_rel"] < LOSS_TOL, m
    assert w2["ddp_tensorwise"]["zero"] == [0] and w2["zero3_tensorwise"]["zero"] == [3]
    # tensorwise under ZeRO-3: FSDP2 gathers every converted weight in float8 (DDP and rowwise: none),
    # over dp × cp under cp (dp=1 × cp=2: the cp pair holds the shards)
    gathers = case in ("zero3_tensorwise", "hf_llama_zero3", "cp2_ulysses_tensorwise")
    for m in every_rank(w2[case]):
        assert m["gathered"] == (m["planned"] if gathers else []), m


# ------------------------------------------------------------------ refusals, one line each


@pytest.fixture(scope="module")
def tiny():
    import gpt

    import autopar
    from autopar.float8 import settings_for

    model, inputs = gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="meta")
    graph = autopar.capture(model, inputs)
    return graph, settings_for(model, graph, True)


def test_an_old_gpu_is_refused_naming_it_and_a_cpu_emulates(monkeypatch) -> None:
    import torch

    from autopar.errors import Float8Error
    from autopar.runtime.float8 import check_device

    assert check_device(torch.device("cpu")) is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(Float8Error) as err:
        check_device(torch.device("cuda", 0))
    assert "\n" not in str(err.value) and "NVIDIA A100-SXM4-80GB is SM 8.0" in str(err.value)
    assert "8.9" in str(err.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert check_device(torch.device("cuda", 0)) is False


def test_a_missing_torchao_is_one_line(monkeypatch, tiny) -> None:
    import torch.nn as nn

    from autopar.errors import Float8Error
    from autopar.runtime.float8 import convert

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(Float8Error, match=r"needs torchao, which is not installed: pip install 'autopar\[float8\]'"):
        convert(nn.Linear(16, 16), tiny[1], emulate=True)


def test_a_plan_priced_otherwise_or_lowering_what_float8_does_not_run_is_refused(tiny) -> None:
    import dataclasses

    import autopar
    from autopar.admission import Here, admit
    from autopar.errors import Float8Error

    def check_float8(plan, asked=None):
        admit(None, plan, Here(world_size=plan.world_size, float8=asked))

    graph, f8 = tiny
    plain = autopar.solve(graph, 2, cluster="cpu", global_batch=4)
    with pytest.raises(Float8Error, match="priced without float8"):
        check_float8(plain, True)
    priced = autopar.solve(graph, 2, cluster="cpu", global_batch=4, float8=f8)
    check_float8(priced, None)
    check_float8(priced, "tensorwise")
    with pytest.raises(Float8Error, match="priced with float8"):
        check_float8(priced, False)
    with pytest.raises(Float8Error, match="not rowwise"):
        check_float8(priced, "rowwise")
    from autopar.mesh import Mesh

    tp = dataclasses.replace(priced, mesh=Mesh(pp=1, dp=1, tp=2))
    with pytest.raises(Float8Error, match=r"tensor parallelism \(tp=2\)"):
        check_float8(tp)


def test_run_float8_reaches_the_scripts_compile_through_the_environment(monkeypatch) -> None:
    from autopar.runtime.float8 import FLOAT8_ENV, requested

    monkeypatch.delenv(FLOAT8_ENV, raising=False)
    assert requested(None) is None and requested(False) is False
    monkeypatch.setenv(FLOAT8_ENV, "rowwise")  # what `autopar run --float8 rowwise` sets for its ranks
    assert requested(None) == "rowwise" and requested(False) is False


@pytest.mark.distributed
def test_cli_verify_float8_rowwise_is_the_same_as_one_float8_process(capsys) -> None:
    pytest.importorskip("torchao", reason="float8 training needs torchao (pip install 'autopar[float8]')")
    from autopar.tools.cli import main

    gpt = str(ROOT / "examples/gpt.py") + ":gpt_tiny"
    args = ["verify", gpt, "--world-size", "2", "--batch-size", "4", "--pin", "zero=3", "--float8", "rowwise"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "float8        rowwise scaling, 8 linears" in out and "OK: SAME as one process" in out
