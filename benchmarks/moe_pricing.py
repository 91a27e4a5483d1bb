"""Mixture-of-experts pricing: model FLOPs per token against 6 · N_active + attention, and a Mixtral plan.

    python benchmarks/moe_pricing.py            # Mixtral 8x7B and DeepSeek-V3 671B, then the Mixtral plan
    python benchmarks/moe_pricing.py --no-plan  # the FLOPs table only

Both models are Hugging Face's classes built on the meta device from their
config defaults (``examples/moe.py``; nothing is downloaded), sequence 4096.
The reference is counted from the config numbers (the functions of
``tests/capture/test_moe.py``): 6 × the parameters one token's forward reads
(top-k routed experts, shared experts, router, attention, head; embedding
lookups excluded) plus attention's scores over the full sequence. The plan is
Mixtral 8x7B on 64 × h100-80g, batch 256 — before grouped GEMMs were priced,
the same command printed 113 TFLOP/s per GPU at 7,422 tokens/s per GPU, about
15 GFLOP per token.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def flops_table(seq: int = 4096) -> list[tuple[str, float, float, float]]:
    """(model, captured GFLOP/token for training, reference GFLOP/token, capture seconds)."""
    from autopar.capturing import capture

    examples = _load(ROOT / "examples" / "moe.py", "autopar_examples_moe")
    tests = _load(ROOT / "tests" / "capture" / "test_moe.py", "autopar_test_moe")
    rows = []
    for name, reference in (("mixtral_8x7b", tests._mixtral_reference), ("deepseek_v3", tests._deepseek_reference)):
        model, inputs = getattr(examples, name)(seq)
        start = time.perf_counter()
        graph = capture(model, inputs)
        took = time.perf_counter() - start
        rows.append((name, 3 * graph.total_flops_per_sample / seq / 1e9, reference(model.config, seq) / 1e9, took))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-plan", action="store_true", help="skip the Mixtral 8x7B plan")
    args = parser.parse_args()
    print("model          captured GFLOP/token   6·N_active + attention   ratio   capture s")
    for name, got, ref, took in flops_table():
        print(f"{name:<14} {got:>20.1f}   {ref:>22.1f}   {got / ref:>5.3f}   {took:>9.1f}")
    if not args.no_plan:
        cmd = [sys.executable, "-m", "autopar.tools.cli", "plan", "examples/moe.py:mixtral_8x7b",
               "--world-size", "64", "--cluster", "h100-80g", "--batch-size", "256"]
        print("\n$ autopar plan examples/moe.py:mixtral_8x7b --world-size 64 --cluster h100-80g --batch-size 256")
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False).stdout
        print(out)


if __name__ == "__main__":
    main()
