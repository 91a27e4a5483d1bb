"""float8 as a plan choice, without a GPU and without torchao: which linears are converted, how they are
priced, where float8 is refused, and the plan's JSON and table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import autopar
from autopar.cost_models.presets import load_cluster
from autopar.errors import Float8Error, PlanError
from autopar.float8 import Float8Settings, Recipe, describe, select_linears, settings_for
from autopar.plan import Plan
from autopar.planning.layer_compute import layer_compute
from autopar.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
GPT = str(ROOT / "examples/gpt.py") + ":gpt_tiny"


def _gpt(**kw):
    import gpt

    model, inputs = gpt.gpt(**{"n_layer": 2, "d_model": 32, "n_head": 4, "vocab_size": 256, "seq_len": 16,
                               "device": "meta", **kw})
    return model, inputs, autopar.capture(model, inputs)


def _llama(intermediate: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False)
    import torch

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    inputs = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)
    return model, inputs, autopar.capture(model, inputs)


@pytest.fixture(scope="module")
def gpt_tiny():
    return _gpt()


# ------------------------------------------------------------------ which linears


@pytest.mark.slow
def test_the_blocks_linears_are_converted_and_the_head_is_not(gpt_tiny) -> None:
    model, _, g = gpt_tiny
    picked = select_linears(model, g)
    assert [l.path for l in picked] == [f"blocks.{i}.{p}" for i in range(2)
                                        for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert {l.layer for l in picked} == {"blocks.0", "blocks.1"}
    assert (picked[0].in_features, picked[0].out_features) == (32, 96)
    assert "lm_head" not in {l.path for l in picked}  # outside the blocks: stays in the plan's dtype


@pytest.mark.slow
def test_a_hugging_face_llama_converts_its_decoder_projections_whose_dims_are_multiples_of_16() -> None:
    model, _, g = _llama(128)
    names = {l.path.removeprefix("model.layers.0.") for l in select_linears(model, g) if l.layer == "model.layers.0"}
    assert names == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    model, _, g = _llama(136)  # 136 is no multiple of 16: the MLP's three projections stay
    names = {l.path.rpartition(".")[2] for l in select_linears(model, g)}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_a_model_with_nothing_to_convert_is_refused_in_one_line() -> None:
    model, _, g = _gpt(d_model=24, n_head=4)  # 24 and 72 are no multiples of 16
    with pytest.raises(Float8Error, match="nothing to convert"):
        settings_for(model, g, True)
    with pytest.raises(Float8Error, match="recipe 'blockwise'"):
        settings_for(model, g, "blockwise")


# ------------------------------------------------------------------ pricing


@pytest.mark.slow
def test_converted_gemms_run_at_the_float8_peak_plus_their_casts() -> None:
    model, _, g = _gpt(d_model=1024, n_head=16, seq_len=2048)
    block = g.layers[[l.name for l in g.layers].index("blocks.0")]
    shapes = settings_for(model, g, True).shapes("blocks.0")
    assert shapes == {(3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)}
    h100 = load_cluster("h100-80g").device
    assert h100.peak_flops_fp8 == 1979e12  # dense, NVIDIA's datasheet (3,958 with sparsity)
    for compiled in (False, True):
        bf16 = layer_compute(block, None, 1, 8, h100, "bf16", compiled=compiled)
        f8 = layer_compute(block, None, 1, 8, h100, "bf16", compiled=compiled, float8=shapes)
        assert f8.device_fwd_s != bf16.device_fwd_s and f8.device_bwd_s != bf16.device_bwd_s
    # compiled (casts fused) the casts cost far less than eager (33 bytes an element in 10 kernels), but at this
    # width, with the H100's GEMMs at their measured rate, they cost about what the faster GEMMs save (within
    # 5%; an H200 measured compiled float8 1.3× slower than bf16 at d = 1,024: docs/benchmarks.md): float8 pays
    # only wider (the next test); eager, its casts cost more than the GEMMs save
    def total(t):
        return t.device_fwd_s + t.device_bwd_s

    compiled_bf16 = layer_compute(block, None, 1, 8, h100, "bf16", compiled=True)
    compiled_f8 = layer_compute(block, None, 1, 8, h100, "bf16", compiled=True, float8=shapes)
    eager_bf16 = layer_compute(block, None, 1, 8, h100, "bf16")
    eager_f8 = layer_compute(block, None, 1, 8, h100, "bf16", float8=shapes)
    assert total(compiled_f8) == pytest.approx(total(compiled_bf16), rel=0.05)
    assert total(eager_f8) > 1.1 * total(compiled_f8) and total(eager_f8) > total(eager_bf16)
    # the host issues each eager cast's 10 kernels: float8 triples an eager block's host time here
    assert eager_f8.host_fwd_s > 2.5 * eager_bf16.host_fwd_s and compiled_f8.host_fwd_s < eager_f8.host_fwd_s
    # a device without a float8 peak (the CPU's emulation) gains nothing and pays the casts
    cpu = load_cluster("cpu").device
    plain, emulated = layer_compute(block, None, 1, 1, cpu, "fp32"), layer_compute(block, None, 1, 1, cpu, "fp32",
                                                                                    float8=shapes)
    assert emulated.device_fwd_s > plain.device_fwd_s and emulated.device_bwd_s > plain.device_bwd_s


@pytest.mark.slow
def test_a_matmul_bound_plan_on_h100_is_faster_in_float8_and_a_tiny_one_is_not() -> None:
    model, _, g = _gpt(n_layer=4, d_model=4096, n_head=32, seq_len=2048)
    f8 = settings_for(model, g, True)
    kw = dict(cluster="h100-80g", global_batch=16, compiled=True)
    base = autopar.solve(g, 8, pins=["tp=1", "pp=1", "ep=1", "cp=1"], **kw)
    fast = autopar.solve(g, 8, float8=f8, **kw)
    assert fast.predicted.step_time_s < 0.85 * base.predicted.step_time_s
    assert fast.predicted.breakdown.compute_s < base.predicted.breakdown.compute_s
    model, _, g = _gpt()
    tiny = dict(cluster="h100-80g", global_batch=8)
    assert (autopar.solve(g, 8, float8=settings_for(model, g, True), **tiny).predicted.step_time_s
            > autopar.solve(g, 8, pins=["tp=1", "pp=1", "ep=1", "cp=1"], **tiny).predicted.step_time_s)


@pytest.mark.slow
def test_fsdp_gathers_tensorwise_weights_in_float8_priced_at_one_byte_an_element() -> None:
    """ZeRO-3 all-gathers each converted weight twice a step; gathered in float8 (tensorwise, the
    default) it moves 1 byte an element instead of bf16's 2, plus one all-reduce a step of every
    weight's amax (a block's share of it). The same block priced otherwise differs by exactly that;
    at ZeRO-0 nothing is gathered and the prices are equal."""
    import dataclasses

    from autopar.contract import DataParallelism
    from autopar.cost_models.communication import Collective, collective_time_s
    from autopar.cost_models.pipeline import Schedule, ScheduleKind
    from autopar.mesh import Mesh
    from autopar.planning.configuration import Configuration, TrainingSpec
    from autopar.planning.pricing import PriceTable

    model, _, g = _gpt(n_layer=4, d_model=1024, n_head=16, seq_len=1024)
    gathered = settings_for(model, g, True)
    assert gathered.fsdp_all_gather and not settings_for(model, g, "rowwise").fsdp_all_gather
    plain = dataclasses.replace(gathered, fsdp_all_gather=False)
    cluster = load_cluster("h100-80g").for_world_size(8)
    config = Configuration(Mesh(dp=8), 1, Schedule(ScheduleKind.NONE), DataParallelism(True, 3))
    tables = {f8: PriceTable(g, config, cluster, TrainingSpec(8, dtype="bf16", float8=f8)) for f8 in (gathered, plain)}
    i = g.layer("blocks.0").index

    def dp_comm(f8, zero: int) -> float:
        table = tables[f8]
        k = next(k for k, c in enumerate(table.choices[i]) if c.zero == zero and c.tp is None and not c.recompute)
        return table.prices[i][k].dp_comm_s

    group = tables[plain].dp_group
    weights = 12 * 1024 * 1024  # the block's four converted weights: 3d·d + d·d + 4d·d + d·4d
    saved = (2 * (collective_time_s(Collective.ALL_GATHER, 2 * weights, group, cluster)
                  - collective_time_s(Collective.ALL_GATHER, weights, group, cluster))
             - collective_time_s(Collective.ALL_REDUCE, 4 * 4, group, cluster, count=4 / 16))
    assert saved > 0
    assert dp_comm(plain, 3) - dp_comm(gathered, 3) == pytest.approx(saved, rel=1e-3)  # the unit's latency share
    assert dp_comm(plain, 1) > dp_comm(gathered, 1)  # ZeRO-1/2 gather once a step, in float8 too
    shown = [l for l in autopar.solve(g, 8, cluster="h100-80g", global_batch=8, float8=gathered,
                                      pins=["tp=1", "pp=1", "dp=8", "zero=3"]).summary().splitlines()
             if l.startswith("float8 ")]
    assert shown[0].endswith("FSDP2 gathers their weights in float8")
    with pytest.raises(PlanError, match="tensorwise scaling only"):
        Float8Settings(Recipe.ROWWISE, gathered.linears, fsdp_all_gather=True)
    assert Float8Settings.from_dict(gathered.to_dict()) == gathered
    old = {k: v for k, v in gathered.to_dict().items() if k != "fsdp_all_gather"}  # a plan written before
    assert Float8Settings.from_dict(old) == plain


# ------------------------------------------------------------------ where it runs


@pytest.mark.parametrize("cluster", ["a100-80g", "v100-16g"])
def test_a_device_without_float8_is_refused_in_one_line_naming_it(gpt_tiny, cluster: str) -> None:
    model, _, g = gpt_tiny
    with pytest.raises(Float8Error) as err:
        autopar.solve(g, 2, cluster=cluster, float8=settings_for(model, g, True))
    text = str(err.value)
    assert "\n" not in text and load_cluster(cluster).device.name in text and "8.9" in text


def test_a_cpu_cluster_emulates_and_the_plan_says_so(gpt_tiny) -> None:
    model, _, g = gpt_tiny
    plan = autopar.solve(g, 2, cluster="cpu", float8=settings_for(model, g, "rowwise"), pins=["zero=3"])
    assert any("torchao's emulation" in n and "no float8 speedup" in n for n in plan.notes)
    assert any("gathers the converted weights in bf16" in n and "not rowwise" in n for n in plan.notes)
    plan = autopar.solve(g, 2, cluster="cpu", float8=settings_for(model, g, True), pins=["zero=3"])
    assert any("gathers the converted weights of sharded layers in float8" in n for n in plan.notes)
    assert {"tp=1", "pp=1", "ep=1"} <= set(plan.pins) and "cp=1" not in plan.pins  # float8 runs beside cp
    beside_cp = autopar.solve(g, 2, cluster="cpu", float8=settings_for(model, g, True), pins=["cp=2", "zero=3"])
    assert beside_cp.mesh.cp == 2 and beside_cp.training.float8 is not None
    with pytest.raises(Float8Error, match="does not run tensor parallelism"):
        autopar.solve(g, 2, cluster="cpu", float8=settings_for(model, g, True), pins=["tp=2"])


# ------------------------------------------------------------------ the plan file and the table


def test_a_float8_plan_round_trips_shows_its_linears_and_old_plans_load_without(gpt_tiny) -> None:
    model, _, g = gpt_tiny
    plan = autopar.solve(g, 2, cluster="cpu", global_batch=4, float8=settings_for(model, g, "rowwise"))
    assert Plan.from_json(plan.to_json()) == plan
    f8 = plan.training.float8
    assert f8.recipe is Recipe.ROWWISE and len(f8.linears) == 8
    shown = plan.summary()
    assert "float8 linears" in shown.splitlines()[0]
    line = next(l for l in shown.splitlines() if l.startswith("float8 "))
    assert line == ("float8        rowwise scaling, 8 linears: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj of "
                    "blocks.0 … blocks.1 (2 layers); every other layer in bf16")
    data = json.loads(plan.to_json())
    assert data["training"]["float8"]["linears"][0] == {"path": "blocks.0.attn.c_attn", "layer": "blocks.0",
                                                        "in_features": 32, "out_features": 96}
    del data["training"]["float8"]  # a plan written before the field
    assert Plan.from_json(json.dumps(data)).training.float8 is None
    data["training"]["float8"] = {"recipe": "blockwise", "linears": []}
    with pytest.raises(PlanError, match="recipe is 'blockwise'"):
        Plan.from_json(json.dumps(data))
    data["training"]["float8"] = {"recipe": "tensorwise", "linears": [{"path": "x"}]}
    with pytest.raises(PlanError, match="each linear"):
        Plan.from_json(json.dumps(data))
    assert Float8Settings.from_dict(f8.to_dict()) == f8 and describe(f8).startswith("rowwise scaling")


@pytest.mark.slow
def test_cli_plan_float8_writes_and_shows_the_linears(tmp_path: Path, capsys) -> None:
    out = tmp_path / "f8.json"
    assert main(["plan", GPT, "--world-size", "2", "--cluster", "cpu", "--float8", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.training.float8 is not None and plan.training.float8.recipe is Recipe.TENSORWISE
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "float8        tensorwise scaling" in capsys.readouterr().out
    plain = tmp_path / "plain.json"
    assert main(["plan", GPT, "--world-size", "2", "--cluster", "cpu", "-o", str(plain)]) == 0
    capsys.readouterr()
    assert main(["diff", str(plain), str(out)]) == 0
    row = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("float8"))
    assert row.split()[1:] == ["-", "tensorwise,", "8", "linears", "*"]
    assert main(["plan", GPT, "--world-size", "2", "--cluster", "a100-80g", "--float8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "A100-SXM4-80GB" in err and "compute capability 8.9" in err
