"""Long sequences on one GPU: a Hugging Face Llama trained at 16K and 64K tokens against its priced plan.

    python benchmarks/gpu_long_sequence.py --json long.json     # on a machine with a GPU
    python benchmarks/gpu_long_sequence.py --dry                # CPU, tiny: checks the script runs

Issue 25 prices attention's memory and time by the kernel the cluster's device runs: on a GPU, SDPA's
fused kernel, whose memory grows with S, not S × S. This trains ``LlamaForCausalLM`` (Hugging Face's
class, grouped-query attention, rotary positions) from a small config — 8 layers of 1,024, 16 query and 4
key/value heads, a 32,000 vocabulary — one sequence a step, in bf16 with fp32 masters and AdamW, with and
without full recompute, and sets the measured peak (``torch.cuda.max_memory_allocated``) and median step
beside the plan's prediction on the device's preset. At 65,536 tokens the math path's score matrix alone
would be 16 heads × S² × 2 B = 128 GiB a layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

CONFIG = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
          "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 131072, "rope_theta": 500000.0}
DRY_CONFIG = {**CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
LENGTHS, DRY_LENGTHS = (16384, 65536), (128,)
PINS = (("none", ("recompute=none", "microbatches=1")), ("full recompute", ("recompute=all", "microbatches=1")))


def build(config: dict[str, Any], seq: int) -> tuple[Any, tuple]:
    """The model on meta (autopar materialises it) and its example input."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(**config, use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return model, (torch.zeros(1, seq, dtype=torch.long),)


def run(config: dict[str, Any], seq: int, pins: tuple[str, ...], device: Any, cluster: Any,
        steps: int) -> dict[str, Any]:
    import torch
    from gpu_check import train_and_time

    import autopar

    net, inputs = build(config, seq)
    graph = autopar.capture(net, inputs)
    plan = autopar.solve(graph, 1, cluster=cluster, dtype="bf16", global_batch=1, pins=list(pins))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, config["vocab_size"], (1, seq), generator=g) for _ in range(2))

    pm, peak, measured = train_and_time(net, inputs, graph, plan, (x, y), device, steps)
    predicted = plan.predicted.memory_per_rank_bytes[0]
    del pm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seq": seq, "pins": list(pins), "attention_notes": [n for n in plan.notes if "attention" in n.lower()],
            "measured_step_s": measured, "predicted_step_s": plan.predicted.step_time_s,
            "step_ratio": measured / plan.predicted.step_time_s, "measured_peak_bytes": peak,
            "predicted_peak_bytes": predicted, "memory_ratio": peak / predicted}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU and a tiny model: check the script runs")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry to check the script on CPU")
    from gpu_check import init_group

    from autopar.cost_models.presets import load_cluster
    from autopar.runtime.launch import local_cluster

    device = init_group(args.dry)
    cluster = load_cluster(local_cluster())
    rows = []
    for seq in DRY_LENGTHS if args.dry else LENGTHS:
        for name, pins in PINS:
            try:
                rows.append(run(DRY_CONFIG if args.dry else CONFIG, seq, pins, device, cluster, args.steps))
            except Exception as exc:  # noqa: BLE001 - one run's failure is reported, the others still run
                rows.append({"seq": seq, "pins": list(pins), "error": f"{type(exc).__name__}: {exc}"[:400]})
            r = rows[-1]
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
            if "error" in r:
                print(f"{seq:7d} {name:15s} FAILED {r['error']}", flush=True)
                continue
            print(f"{seq:7d} {name:15s} step {r['measured_step_s']:.3f} s / predicted {r['predicted_step_s']:.3f} s "
                  f"({r['step_ratio']:.2f})   peak {r['measured_peak_bytes'] / 2**30:.2f} GiB / predicted "
                  f"{r['predicted_peak_bytes'] / 2**30:.2f} GiB ({r['memory_ratio']:.2f})", flush=True)
    dist.destroy_process_group()
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
