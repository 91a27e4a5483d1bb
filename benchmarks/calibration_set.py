"""The calibration set: torchtitan's published Llama 3.1 runs beside autopar's predictions.

    python benchmarks/calibration_set.py          # the table, with the presets as they are
    python benchmarks/calibration_set.py --fit    # also fit each device family's efficiency

Each published run is priced as the hand-made plan it was (everything pinned:
FSDP = ZeRO-3 on every layer, pp = tp = 1, one microbatch, the published
local batch, torch's cross-entropy over the whole logits as torchtitan ran it:
``loss=full``). Activation checkpointing is pinned on the transformer blocks
only, as torchtitan applies it (``apply_ac`` wraps each of ``model.layers``):
selective (SAC) as the policy these runs used, full as full recompute; the
embedding, final norm and head recompute nothing.

torchtitan's op-level SAC keeps attention's output and every *other* ``mm``
output, recomputing the rest (``torchtitan/distributed/activation_checkpoint.py``,
"Saves output of all compute ops, except every second mm"). autopar runs that
policy as ``recompute=alternate_mm`` (``passes/recompute.py``), priced from the
captured graph like its own selective policy (which keeps every matmul-class
output), so the SAC rows pin ``alternate_mm``: what is priced is what those
runs ran. (Priced with autopar's ``selective`` instead, the 8B rows keep
~19 GiB more activations per GPU than torchtitan's policy does.)

The published peaks are the caching allocator's peak reserved memory
(torchtitan's ``max_reserved_gib``); the predicted column is the plan's
allocated peak times 1 + the preset's ``allocator_overhead_fraction``.

How the presets' ``matmul_efficiency`` is made and what ``--fit`` fits: the graphs carry per-op
records, so the runs are priced by the per-op compute model, whose large-GEMM efficiency η_max is a
device fact times a stack fact (``cost_models/hardware.py``). The device's is each family's best
measured GEMM (``gpu_figures.BEST_GEMM``, cited); the stack's, ``TORCH_EAGER_GEMM_SHARE``, is what
``--fit`` fits: η is solved per run by fixed-point iteration to reproduce the published tokens/s,
and the A100 runs' geometric mean over A100's device efficiency is the eager stack's share (the only
runs of this stack on a part whose GEMM rate is measured). The H100 runs then fit the one device figure
no measurement gives, the 500 W part's share of the 700 W part's GEMM rate (``H100_500W_GEMM_SHARE``).
The caching allocator's reserve over what it allocates (``ALLOCATOR_OVERHEAD_FRACTION``, a stack fact:
fragmentation) is fitted on the runs that publish their peak reserved memory (the H100 runs), the geometric
mean of published reserved over predicted allocated. No other public figure is used for fitting: the rest are
kept back to validate the model.

:func:`calibration_rows` returns the table's rows (``benchmarks/suite.py``
puts them in its report).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import llama  # noqa: E402

import autopar  # noqa: E402
from autopar.cost_models.presets import PRESETS  # noqa: E402

GiB = 2**30


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str  # spec function in examples/llama.py
    cluster: str
    gpus: int
    local_batch: int
    recompute: str  # "alternate_mm" (torchtitan's op-level SAC) or "full", on the transformer blocks
    tokens_per_s_per_gpu: float
    peak_memory_gib: float | None


RUNS = [
    PublishedRun("Llama 3.1 8B, 8 × H100, FSDP, SAC", "llama3_8b", "h100-96g", 8, 2, "alternate_mm", 5762, 82.4),
    PublishedRun("Llama 3.1 8B, 128 × H100, FSDP, SAC", "llama3_8b", "h100-96g", 128, 2, "alternate_mm", 5605, 67.0),
    PublishedRun("Llama 3.1 8B, 64 × A100, FSDP, SAC", "llama3_8b", "a100-80g", 64, 1, "alternate_mm", 2904, None),
    PublishedRun("Llama 3.1 70B, 64 × A100, FSDP, full AC", "llama3_70b", "a100-80g", 64, 1, "full", 331, None),
]
FAMILY = {"h100-96g": "H100", "a100-80g": "A100"}
BLOCKS = "layers.*"  # examples/llama.py's transformer blocks
NOT_BLOCKS = ("embed_tokens", "norm", "lm_head")


def price(run: PublishedRun, graph, efficiency: float | None = None) -> autopar.Plan:
    cluster = PRESETS[run.cluster]
    if efficiency is not None:
        cluster = replace(cluster, device=replace(cluster.device, matmul_efficiency=efficiency))
    pins = ["pp=1", "tp=1", "microbatches=1", "zero=3", "loss=full", f"{BLOCKS}:recompute={run.recompute}",
            *(f"{name}:recompute=none" for name in NOT_BLOCKS)]
    return autopar.solve(graph, run.gpus, cluster=cluster, global_batch=run.local_batch * run.gpus,
                         pins=pins, memory_gb=10_000)  # price the plan; memory is reported, not enforced


def fit_efficiency(run: PublishedRun, graph) -> float:
    eta = PRESETS[run.cluster].device.matmul_efficiency
    for _ in range(20):
        predicted = price(run, graph, eta).predicted.tokens_per_s_per_gpu
        eta *= run.tokens_per_s_per_gpu / predicted
    return eta


@dataclass(frozen=True)
class CalibrationRow:
    """A published run beside autopar's prediction for the plan it used."""

    run: PublishedRun
    tokens_per_s_per_gpu: float
    peak_memory_gib: float

    @property
    def tokens_error(self) -> float:
        return self.tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu - 1

    @property
    def memory_error(self) -> float | None:
        published = self.run.peak_memory_gib
        return self.peak_memory_gib / published - 1 if published else None


def capture_graphs() -> dict[str, autopar.LayerGraph]:
    """Each model of the calibration set, captured once."""
    return {name: autopar.capture(*getattr(llama, name)()) for name in {r.model for r in RUNS}}


def calibration_rows(graphs: dict[str, autopar.LayerGraph] | None = None) -> list[CalibrationRow]:
    """Every published run priced with the presets as they are."""
    graphs = graphs or capture_graphs()
    rows = []
    for run in RUNS:
        plan = price(run, graphs[run.model])
        # torchtitan logs the caching allocator's peak *reserved* memory (``max_reserved_gib`` in its
        # train loop's "memory:" line); autopar predicts the bytes of tensors allocated, which the
        # allocator reserves with the cluster's ``allocator_overhead_fraction`` on top
        reserved = 1.0 + PRESETS[run.cluster].allocator_overhead_fraction
        rows.append(CalibrationRow(run, plan.predicted.tokens_per_s_per_gpu,
                                   reserved * max(plan.predicted.memory_per_rank_bytes) / GiB))
    return rows


def render(rows: list[CalibrationRow]) -> str:
    """The rows as a Markdown table (what this script prints and the suite's report shows)."""
    lines = ["| run | published tok/s/GPU | predicted | error | published peak reserved GiB | predicted | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        run, mem_error = row.run, row.memory_error
        mem_pub = f"{run.peak_memory_gib:.1f}" if run.peak_memory_gib else "—"
        mem_err = f"{mem_error:+.1%}" if mem_error is not None else "—"
        lines.append(f"| {run.name} | {run.tokens_per_s_per_gpu:,.0f} | {row.tokens_per_s_per_gpu:,.0f} | "
                     f"{row.tokens_error:+.1%} | {mem_pub} | {row.peak_memory_gib:.1f} | {mem_err} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit the eager stack's GEMM share (and the 500 W H100's)")
    args = parser.parse_args()
    graphs = capture_graphs()
    print(render(calibration_rows(graphs)))
    if args.fit:
        from autopar.cost_models.presets import device_gemm_efficiency

        fitted: dict[str, list[float]] = {}
        for run in RUNS:
            fitted.setdefault(FAMILY[run.cluster], []).append(fit_efficiency(run, graphs[run.model]))
        mean = {family: math.exp(sum(map(math.log, etas)) / len(etas)) for family, etas in fitted.items()}
        for family, etas in fitted.items():
            print(f"{family}: η_max per run {', '.join(f'{e:.3f}' for e in etas)} → geometric mean {mean[family]:.3f}")
        stack = mean["A100"] / device_gemm_efficiency("A100")
        power = mean["H100"] / (device_gemm_efficiency("H100") * stack)
        print(f"TORCH_EAGER_GEMM_SHARE = {stack:.3f} (A100's {mean['A100']:.3f} over its device efficiency "
              f"{device_gemm_efficiency('A100'):.3f})")
        print(f"H100_500W_GEMM_SHARE = {power:.3f} (the 500 W H100's {mean['H100']:.3f} over the 700 W part's "
              f"{device_gemm_efficiency('H100'):.3f} × the stack's {stack:.3f})")
        # the caching allocator's reserve: published peak reserved over predicted peak allocated, where published
        reserved = [r.run.peak_memory_gib * (1 + PRESETS[r.run.cluster].allocator_overhead_fraction) / r.peak_memory_gib
                    for r in calibration_rows(graphs) if r.run.peak_memory_gib]
        fraction = math.exp(sum(map(math.log, reserved)) / len(reserved)) - 1
        print(f"ALLOCATOR_OVERHEAD_FRACTION = {fraction:.3f} (reserved over allocated per run "
              f"{', '.join(f'{x:.3f}' for x in reserved)}, geometric mean)")

if __name__ == "__main__":
    main()
