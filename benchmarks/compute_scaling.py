"""Predicted TFLOP/s per GPU of the project's GPT from ~2B to 1T under fixed Megatron-like plans.

    python benchmarks/compute_scaling.py            # per-op model (the presets) beside the FLOPs model

Public tables of large-model runs report TFLOP/s per GPU that *rise* with
model size (bigger, better-shaped GEMMs; a smaller share of memory-bound
work); issue 12 found autopar's FLOPs model predicting the opposite. This
prints both models' predictions on A100 80 GB for the same plans, to show
the trend. Nothing here is fitted: the efficiencies come from the
calibration set (``benchmarks/calibration_set.py``) and the shape terms
from the cited GEMM measurements (``cost_models/hardware.py``).

Each plan is pinned whole: tensor parallelism inside a node (8, the
Megatron style on every block) from 20B up, a 1F1B pipeline that leaves a
few blocks per stage, data parallelism over the rest, microbatches of one
sequence (2048 tokens, vocabulary 51,200, as Megatron-LM's GPT runs),
full recompute on the blocks. TFLOP/s counts what the GPUs execute:
forward, backward and the recomputed forward (4 × forward FLOPs).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402

import autopar  # noqa: E402
from autopar.choice import LayerChoice, Recompute  # noqa: E402
from autopar.cost_models.hardware import ClusterSpec  # noqa: E402
from autopar.cost_models.pipeline import Schedule, ScheduleKind  # noqa: E402
from autopar.cost_models.presets import PRESETS  # noqa: E402
from autopar.mesh import Mesh  # noqa: E402
from autopar.planning.configuration import Configuration, TrainingSpec  # noqa: E402
from autopar.planning.pricing import PriceTable  # noqa: E402

SEQ, VOCAB = 2048, 51200
FLOPS_MODEL_EFFICIENCY = 0.609  # A100's fitted efficiency under the FLOPs model, before per-op records


@dataclass(frozen=True)
class ScalingRun:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    gpus: int
    tp: int
    pp: int
    global_batch: int

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


RUNS = (
    ScalingRun("GPT 2.7B", 32, 2560, 32, 64, 1, 1, 512),
    ScalingRun("GPT 20B", 44, 6144, 64, 256, 8, 1, 1024),
    ScalingRun("GPT 175B", 96, 12288, 96, 1024, 8, 16, 1536),
    ScalingRun("GPT 1T", 128, 25600, 160, 3072, 8, 64, 3072),
)


def flops_model(cluster: ClusterSpec) -> ClusterSpec:
    """The same cluster priced by FLOPs alone (no per-op terms), at that model's fitted efficiency."""
    device = replace(cluster.device, op_model=None, matmul_efficiency=FLOPS_MODEL_EFFICIENCY)
    return replace(cluster, device=device)


def block_tflops(run: ScalingRun, graph: autopar.LayerGraph, cluster: ClusterSpec) -> float:
    """TFLOP/s per GPU one transformer block's compute runs at under the plan (a microbatch's
    forward, backward and recomputed forward on one tp rank): the compute model alone."""
    block = next(layer for layer in graph if layer.name.startswith("blocks."))
    config = Configuration(Mesh(pp=run.pp, dp=run.dp, tp=run.tp), run.global_batch // run.dp,
                           Schedule(ScheduleKind.ONE_F_ONE_B))
    table = PriceTable(graph, config, cluster, TrainingSpec(run.global_batch))
    choice = LayerChoice(tp="megatron" if run.tp > 1 else None, recompute=Recompute.FULL)
    price = table.prices[block.index][table.index_of(block.index, choice)]
    return 4 * block.flops_per_sample * table.microbatch_size / run.tp / price.compute_mb_s / 1e12


def predict(run: ScalingRun, graph: autopar.LayerGraph, cluster: ClusterSpec) -> tuple[float, float]:
    """TFLOP/s per GPU the plan is predicted to execute over the whole step, and a block's compute."""
    microbatches = run.global_batch // run.dp
    pins = [f"tp={run.tp}", f"pp={run.pp}", f"dp={run.dp}", f"microbatches={microbatches}", "zero=0",
            "schedule=1f1b" if run.pp > 1 else "schedule=none", "blocks.*:recompute=full",
            *([] if run.tp == 1 else ["blocks.*:tp=megatron"])]
    plan = autopar.solve(graph, run.gpus, cluster=cluster, global_batch=run.global_batch, pins=pins,
                         memory_gb=10_000)
    per_gpu = 4 * graph.total_flops_per_sample * run.global_batch / run.gpus / 1e12
    return per_gpu / plan.predicted.step_time_s, block_tflops(run, graph, cluster)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="a100-80g")
    args = parser.parse_args()
    cluster = PRESETS[args.cluster]
    peak = cluster.device.peak_flops_bf16 / 1e12
    print(f"TFLOP/s per GPU on {args.cluster} (peak {peak:.0f}): whole step (one block's compute)")
    print("| model | GPUs | tp | pp | dp | per-op model | FLOPs model |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run in RUNS:
        net, inputs = gpt.gpt(n_layer=run.n_layer, d_model=run.d_model, n_head=run.n_head,
                              vocab_size=VOCAB, seq_len=SEQ)
        graph = autopar.capture(net, inputs)
        cells = [f"{step:.0f} ({compute:.0f})" for step, compute in
                 (predict(run, graph, cluster), predict(run, graph, flops_model(cluster)))]
        print(f"| {run.name} | {run.gpus} | {run.tp} | {run.pp} | {run.dp} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
