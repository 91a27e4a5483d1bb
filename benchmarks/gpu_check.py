"""The GPU check: on one CUDA device, does what runs match what the planner predicts?

    python benchmarks/gpu_check.py --json gpu_check.json          # on a machine with a GPU
    python benchmarks/gpu_check.py --dry --json /tmp/dry.json     # CPU, tiny: the suite runs this

Ready for the day a machine with a GPU is lent (nothing here needs more than one):

1. the NCCL process group at world size 1 (gloo on CPU with ``--dry``), and
   the memory the planner keeps back, as one GPU shows it (``gpu_memory.py``:
   CUDA context, a one-rank NCCL communicator, the caching allocator's reserved
   over allocated under FSDP2, how many FSDP2 units' weights forward holds);
2. ``autopar calibrate``'s compute fit on this device: forward + backward of
   transformer layers at several widths, in bf16, fitted to the compute
   model (``matmul_efficiency``, ``half_efficiency_flops``), with the
   device's bf16 GEMM peak measured beside the preset's, and the per-op terms
   (``benchmarks/gpu_compute.py``: a GEMM-shape sweep, HBM bandwidth, attention);
3. for several single-device plans — two model sizes, recompute on and off,
   1, 2 and 4 microbatches, and one with each block under ``torch.compile``
   (priced compiled; solved but not run with ``--dry``), and two with the blocks' linears in float8
   (eager and compiled; where the device has float8 and torchao is installed, else priced and
   skipped with the reason; ``--dry`` runs the eager one emulated) — ``autopar.compile`` in bf16 (bf16 compute, fp32
   master weights and AdamW state), timed training steps (median after
   warm-up) and peak memory (``torch.cuda.max_memory_allocated``; the
   profiler's allocation events on CPU), each against the plan priced on the
   preset as shipped (the fits of 2. are recorded, not used);
4. the host's terms (``host_overheads.py``: per op, the checkpoint's machinery, the compiled share; GPU only);
5. ring attention's driver with the device's flash kernel at world size 1 (``gpu_ring.py``: the CUDA
   plumbing of ``passes/context_ring.py``, output and gradients against one causal SDPA);
6. one ring step's attention kernels at torchtitan's long-context shapes, every SDPA backend, against
   their priced times (``gpu_attention_steps.py``).

``--models`` picks some of the models; the JSON is rewritten after every plan, so a check stopped at a
time limit still leaves what it measured.

Writes JSON: the device, the fit, and per plan the predicted and measured
step time and peak memory and their ratios. Exits 1 if a plan fails to run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "examples"))
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Model:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq: int


GPU_MODELS = (Model("gpt-125m", 12, 768, 12, 50304, 1024),
              Model("gpt-125m-8k", 12, 768, 12, 50304, 8192),  # 8,192 tokens: attention priced as the kernel runs
              Model("gpt-350m", 24, 1024, 16, 50304, 1024))
DRY_MODELS = (Model("gpt-dry-a", 2, 32, 4, 256, 16), Model("gpt-dry-b", 3, 48, 4, 256, 16))
PLANS = (  # (name, pins): every choice a single-device plan has
    ("m1", ("recompute=none", "microbatches=1")),
    ("m1 recompute", ("recompute=all", "microbatches=1")),
    ("m2", ("recompute=none", "microbatches=2")),
    ("m4 recompute", ("recompute=all", "microbatches=4")),
)
# Each block under torch.compile (issue 24): priced compiled, run compiled. On a GPU only: with --dry the
# plan is solved and priced (the compiled pricing path) but not run, since inductor's C++ compile takes
# minutes on a busy 2-core host (tests/runtime/test_compile.py proves the compiled runtime on CPU).
COMPILED_PLANS = (("m1 compiled", ("recompute=none", "microbatches=1")),)
# float8 linears (torchao, autopar.float8; issue 24): (name, pins, compiled, recipe). Run where the device has
# float8 matmuls (SM 8.9+) and torchao is installed, else skipped with the one-line reason; with --dry the eager
# one runs torchao's CPU emulation for real (no speedup: priced so) and the compiled one is priced only.
FLOAT8_PLANS = (("m1 float8", ("recompute=none", "microbatches=1"), False, "tensorwise"),
                ("m1 compiled float8", ("recompute=none", "microbatches=1"), True, "tensorwise"))


def init_group(dry: bool) -> Any:
    """World size 1: NCCL on the GPU (gloo with ``--dry``), from a file store."""
    import torch
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="autopar-gpu-check-"), "store"), 1)
    if dry:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return torch.device("cpu")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    return torch.device("cuda", 0)


def compute_fit(dry: bool) -> dict[str, Any]:
    """Calibrate's layer probes and GEMM in bf16, fitted as ``autopar calibrate`` fits them."""
    import torch

    from autopar.tools.calibrate.errors import CalibrationError
    from autopar.tools.calibrate.fit import fit_compute
    from autopar.tools.calibrate.probes import ProbeSizes, _Rank, probe_sizes

    backend = "gloo" if dry else "nccl"
    sizes = probe_sizes(backend, quick=True)
    if dry:  # widths far enough apart that their times grow even on a busy 2-core host
        sizes = ProbeSizes(widths=(32, 96, 256), tokens=(2, 16), gemm=128, message_bytes=(4096,),
                           seconds_per_point=0.02, rounds=1)
    for attempt in range(3 if dry else 1):  # dry: the script must run, so a fit spoilt by load is measured again
        probe = _Rank(0, 1, backend, sizes, None)
        torch.set_default_dtype(torch.bfloat16)
        try:
            layers = probe.layers()
        finally:
            torch.set_default_dtype(torch.float32)
        try:
            rate, half = fit_compute(layers)
            break
        except CalibrationError:
            if attempt == (2 if dry else 0):
                raise
            sizes = replace(sizes, seconds_per_point=2 * sizes.seconds_per_point)
    return {"layers": layers, "rate_flops_s": rate, "half_efficiency_flops": half, "gemm_flops_s": probe.gemm()}


def preset_cluster(dry: bool) -> Any:
    """This machine's preset (``cpu`` with ``--dry``), one device: the plans are priced on it as shipped (device
    facts, the stack's fitted share, the host's terms), so the rows check the presets; the fits are recorded
    beside them, not used."""
    from autopar.cost_models.presets import load_cluster
    from autopar.runtime.launch import local_cluster

    base = load_cluster("cpu" if dry else local_cluster())
    return replace(base, gpus_per_node=1, nodes=1)


def host_terms(device: Any) -> dict[str, Any]:
    """The host's priced figures measured on this GPU's host (``benchmarks/host_overheads.py``): per op, each
    recompute policy's machinery, the compiled share, beside ``gpu_figures``'s."""
    import torch
    from host_overheads import summarise

    from autopar.cost_models import gpu_figures

    measured = summarise(device, torch.bfloat16)
    return {"measured": measured, "priced": {"host_op_s": gpu_figures.HOST_OP_S,
                                             "checkpoint_host_ops": gpu_figures.CHECKPOINT_HOST_OPS,
                                             "compiled_host_share": gpu_figures.COMPILED_HOST_SHARE}}


def measure_peak(fn: Any, device: Any) -> tuple[Any, int]:
    """(fn's result, the most bytes of tensors live at once while it ran)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - base
    from fidelity import _profiled, peak_tensor_bytes

    result, (events, started) = _profiled(fn)
    return result, peak_tensor_bytes(events, started)


def solve_plan(model: Model, pins: tuple[str, ...], cluster: Any, batch: int, compiled: bool = False,
               float8: str | None = None) -> Any:
    """The bf16 single-device plan of ``model`` under ``pins`` (``compiled``: blocks priced compiled;
    ``float8``: the blocks' linears priced in float8 with that recipe)."""
    import gpt

    import autopar
    from autopar.float8 import settings_for

    net, inputs = gpt.gpt(n_layer=model.n_layer, d_model=model.d_model, n_head=model.n_head,
                          vocab_size=model.vocab, seq_len=model.seq, device="meta")
    graph = autopar.capture(net, inputs)
    plan = autopar.solve(graph, 1, cluster=cluster, dtype="bf16", global_batch=batch, pins=list(pins),
                         compiled=compiled, float8=settings_for(net, graph, float8) if float8 else None)
    return net, inputs, graph, plan


def float8_refusal(device: Any) -> str | None:
    """Why float8 cannot run here (no torchao; a GPU older than SM 8.9), or None."""
    from autopar.errors import Float8Error
    from autopar.runtime.float8 import check_device

    try:
        import torchao.float8  # noqa: F401 - present or not is the question
    except ImportError:
        return "torchao is not installed (pip install 'autopar[float8]')"
    try:
        check_device(device)
    except Float8Error as exc:
        return str(exc)
    return None


def train_and_time(net: Any, inputs: tuple, graph: Any, plan: Any, batch: tuple, device: Any,
                   steps: int) -> tuple[Any, int, float]:
    """Compile ``plan`` (AdamW at lr 1e-4, gradients clipped at norm 1), train two steps measuring the peak
    (:func:`measure_peak`), then ``steps`` more: (the parallel model, peak bytes, median step seconds)."""
    import torch

    import autopar

    def compile_and_train() -> Any:
        from fidelity import _TRAINING

        pm = autopar.compile(net, example_inputs=inputs, plan=plan, graph=graph, max_grad_norm=1.0,
                             optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
        with torch.profiler.record_function(_TRAINING):
            for _ in range(2):
                pm.train_step(*batch)
        return pm

    pm, peak = measure_peak(compile_and_train, device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        pm.train_step(*batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return pm, peak, statistics.median(times)


def run_plan(model: Model, name: str, pins: tuple[str, ...], cluster: Any, device: Any, steps: int,
             batch: int, compiled: bool = False, float8: str | None = None) -> dict[str, Any]:
    """Compile one bf16 plan of ``model`` (its blocks under torch.compile if ``compiled``, its blocks'
    linears in float8 if ``float8``), train, and set measured against predicted."""
    import torch


    net, inputs, graph, plan = solve_plan(model, pins, cluster, batch, compiled, float8)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.vocab, (batch, model.seq), generator=g)
    y = torch.randint(0, model.vocab, (batch, model.seq), generator=g)

    pm, peak, measured_s = train_and_time(net, inputs, graph, plan, (x, y), device, steps)
    predicted_s = plan.predicted.step_time_s
    predicted_bytes = plan.predicted.memory_per_rank_bytes[0]
    return {"model": model.name, "plan": name, "pins": list(pins), "microbatches": plan.microbatches,
            "compiled": list(pm.compiled), "float8": float8,
            "float8_linears": len(plan.training.float8.linears) if plan.training.float8 is not None else 0,
            "recompute": sum(bool(lp.choice.recompute) for lp in plan.layers), "dtype": plan.training.dtype,
            "masters_fp32": all(p.dtype == torch.float32 for g_ in pm.optimizer.param_groups for p in g_["params"]),
            "predicted_step_s": predicted_s, "measured_step_s": measured_s,
            "step_ratio": measured_s / predicted_s, "predicted_peak_bytes": predicted_bytes,
            "measured_peak_bytes": peak, "memory_ratio": peak / predicted_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU and tiny models: check the script runs")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per plan (default 10; dry 2)")
    parser.add_argument("--models", default=None, metavar="NAMES",
                        help="comma-separated model names to run (default all: " +
                        ", ".join(m.name for m in GPU_MODELS) + "; dry " + ", ".join(m.name for m in DRY_MODELS) + ")")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry to check the script on CPU")
    steps = args.steps or (2 if args.dry else 10)
    device = init_group(args.dry)
    from gpu_memory import memory_terms

    memory = memory_terms(device, args.dry)  # first: before any other collective opens NCCL's buffers
    fit = compute_fit(args.dry)
    cluster = preset_cluster(args.dry)
    from gpu_compute import check as check_ops  # per-op compute terms: GEMM shapes, bandwidth, attention, host

    compute_ops, _ = check_ops(args.dry, cluster)
    host = {} if args.dry else host_terms(device)  # dry: two torch.compile runs on a 2-core host, skipped
    if host:
        print(f"host terms measured: {host['measured']} (priced: {host['priced']})", file=sys.stderr, flush=True)
    rows, failures, skipped = [], [], []
    from gpu_ring import check as check_ring  # ring attention's driver with this device's flash kernel

    try:
        ring = check_ring(device)
        if not ring["ok"]:
            failures.append({"model": "-", "plan": "ring attention", "error": f"off by {ring['errors']}"})
    except Exception as exc:  # noqa: BLE001 - reported, the plans still run
        ring = {"error": f"{type(exc).__name__}: {exc}"}
        failures.append({"model": "-", "plan": "ring attention", "error": ring["error"]})
    from gpu_attention_steps import measure as attention_steps  # one ring step's kernels at torchtitan's shapes

    try:
        steps_at_length = attention_steps(args.dry)
    except Exception as exc:  # noqa: BLE001 - reported, the plans still run
        steps_at_length = {"error": f"{type(exc).__name__}: {exc}"}
        failures.append({"model": "-", "plan": "attention steps", "error": steps_at_length["error"]})

    backend, world_size = dist.get_backend(), dist.get_world_size()

    def result() -> dict[str, Any]:
        return {
            "dry": args.dry, "backend": backend, "world_size": world_size,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else f"cpu ({platform.processor()})",
            "torch": torch.__version__, "cluster": cluster.to_dict(),
            "fit": {k: v for k, v in fit.items() if k != "layers"}, "probes": fit["layers"],
            "plans": rows, "skipped": skipped, "failures": failures, "compute_ops": compute_ops,
            "memory_terms": memory, "ring": ring, "attention_steps": steps_at_length, "host_terms": host,
        }

    def write() -> None:  # after every plan: a check stopped at its time limit still leaves what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(result(), indent=2, default=float) + "\n")

    write()
    models = DRY_MODELS if args.dry else GPU_MODELS
    if args.models:
        wanted = args.models.split(",")
        if unknown := sorted(set(wanted) - {m.name for m in models}):
            parser.error(f"--models: no model named {', '.join(unknown)} (have {', '.join(m.name for m in models)})")
        models = tuple(m for m in models if m.name in wanted)
    for model in models:
        for name, pins in PLANS:
            try:
                rows.append(run_plan(model, name, pins, cluster, device, steps, batch=4 if args.dry else 8))
            except Exception as exc:  # noqa: BLE001 - one plan's failure is reported, the others still run
                failures.append({"model": model.name, "plan": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"gpu_check: {model.name} {name} done", file=sys.stderr, flush=True)
            write()
        for name, pins in COMPILED_PLANS:
            batch = 4 if args.dry else 8
            try:
                if args.dry:  # priced, not run (COMPILED_PLANS)
                    plan = solve_plan(model, pins, cluster, batch, compiled=True)[3]
                    skipped.append({"model": model.name, "plan": name, "compiled": plan.training.compiled,
                                    "predicted_step_s": plan.predicted.step_time_s, "why": "--dry: not run"})
                else:
                    rows.append(run_plan(model, name, pins, cluster, device, steps, batch, compiled=True))
            except Exception as exc:  # noqa: BLE001 - one plan's failure is reported, the others still run
                failures.append({"model": model.name, "plan": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"gpu_check: {model.name} {name} done", file=sys.stderr, flush=True)
            write()
        refusal = float8_refusal(device)
        for name, pins, compiled, recipe in FLOAT8_PLANS:
            batch = 4 if args.dry else 8
            try:
                if refusal is None and not (args.dry and compiled):
                    rows.append(run_plan(model, name, pins, cluster, device, steps, batch, compiled, recipe))
                    continue
                plan = solve_plan(model, pins, cluster, batch, compiled, recipe)[3]  # priced, not run
                skipped.append({"model": model.name, "plan": name, "compiled": compiled, "float8": recipe,
                                "predicted_step_s": plan.predicted.step_time_s,
                                "why": refusal or "--dry: compiled plans are not run"})
            except Exception as exc:  # noqa: BLE001 - one plan's failure is reported, the others still run
                failures.append({"model": model.name, "plan": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"gpu_check: {model.name} {name} done", file=sys.stderr, flush=True)
            write()
    dist.destroy_process_group()
    write()
    print(f"{'model':10s} {'plan':18s} {'float8':10s} step time / predicted, peak memory / predicted")
    for r in rows:
        print(f"{r['model']:10s} {r['plan']:18s} {r['float8'] or '-':10s} step {r['measured_step_s']:.4f} s / "
              f"predicted {r['predicted_step_s']:.4f} s ({r['step_ratio']:.2f})   peak "
              f"{r['measured_peak_bytes'] / 2**20:.1f} MiB / predicted {r['predicted_peak_bytes'] / 2**20:.1f} MiB "
              f"({r['memory_ratio']:.2f})")
    for r in skipped:
        print(f"{r['model']:10s} {r['plan']:18s} {r.get('float8') or '-':10s} predicted "
              f"{r['predicted_step_s']:.4f} s, not run: {r['why']}")
    if "kernels" in steps_at_length:
        from gpu_attention_steps import summary as attention_summary

        print(attention_summary(steps_at_length))
    print("memory terms: " + ", ".join(f"{k} {v}" for k, v in memory.items() if k != "priced"))
    for f in failures:
        print(f"FAILED {f['model']} {f['plan']}: {f['error']}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
