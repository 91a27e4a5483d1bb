"""``benchmarks/gpu_check.py --dry``: the GPU check, run on CPU with tiny models so it cannot rot.

The dry run goes through every part the real one does — a world-size-1 process group, calibrate's
compute fit in bf16, bf16 plans with recompute on and off over 1, 2 and 4 microbatches for two
model sizes, measured against predicted time and memory, JSON out — on gloo instead of NCCL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_dry_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry", "--steps", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry"] and result["backend"] == "gloo" and result["world_size"] == 1
    assert not result["failures"]
    ring = result["ring"]  # benchmarks/gpu_ring.py: ring attention's driver against one causal SDPA
    assert ring["ok"] and set(ring["errors"]) == {"mha", "gqa"} and ring["tolerance"] == 1e-5
    ops = result["compute_ops"]  # benchmarks/gpu_compute.py: GEMM shapes, bandwidth, attention
    assert len(ops["gemms"]) >= 3 and all(g["seconds"] > 0 and g["predicted_s"] > 0 for g in ops["gemms"])
    if "fit" in ops:  # on a busy 2-core host the tiny GEMMs' times may not grow with size: said, not fatal
        assert ops["fit"]["rate_flops_s"] > 0 and ops["bandwidth"]["bytes_s"] > 0 and ops["attention"]["fwd_s"] > 0
    else:
        assert "do not grow" in ops["error"]
    assert result["fit"]["rate_flops_s"] > 0 and result["fit"]["gemm_flops_s"]["bf16"] > 0
    host = ops["host"]  # the host's time per op: a tiny block's forward and backward over the ops pricing counts
    assert host["ops"] >= 40 and host["per_op_s"] > 0 and host["preset_host_op_s"] is None  # cpu: no op model
    rows = result["plans"]
    float8 = [r for r in rows if r["float8"]]  # the float8 column: the eager plan ran, emulated by torchao
    rows = [r for r in rows if not r["float8"]]
    assert {r["model"] for r in rows} == {"gpt-dry-a", "gpt-dry-b"} and len(rows) == 8
    assert {r["microbatches"] for r in rows} == {1, 2, 4} and any(r["recompute"] for r in rows)
    assert [(r["model"], r["plan"], r["float8_linears"]) for r in float8] == [
        ("gpt-dry-a", "m1 float8", 8), ("gpt-dry-b", "m1 float8", 12)]
    # the compiled variants: priced compiled on --dry, run only on a GPU
    assert [(k["model"], k["plan"], k["compiled"]) for k in result["skipped"]] == [
        ("gpt-dry-a", "m1 compiled", True), ("gpt-dry-a", "m1 compiled float8", True),
        ("gpt-dry-b", "m1 compiled", True), ("gpt-dry-b", "m1 compiled float8", True)]
    for r in rows + float8:
        assert r["dtype"] == "bf16" and r["masters_fp32"]
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0
        assert 0.5 < r["memory_ratio"] < 2.0, r  # the prediction follows what ran, even this small
    terms = result["memory_terms"]  # on CPU the FSDP2 steps run; the CUDA figures say why they are missing
    assert terms["priced"]["cuda_context_bytes"] > 0 and terms["priced"]["nccl_buffer_bytes"] > 0
    assert terms["cuda_context_bytes"] is None and "no CUDA device" in terms["why_none"]
    assert set(terms) >= {"nccl_world1_bytes", "allocator_overhead", "forward_units_alive"}
