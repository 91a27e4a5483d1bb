"""The model × strategy table: models as their upstream writes them, each plan against one device.

    python benchmarks/zoo_table.py [--strategies tp,zero3,dp2tp2,pp2tp2,3d]
    python benchmarks/zoo_table.py --strategies sp,dp2tp2sp,pp2tp2sp     # sequence parallelism
    python benchmarks/zoo_table.py --strategies pp2cuts                  # pp=2 at every cut offered
    python benchmarks/zoo_table.py --strategies zero3,dp2 --models beyond  # keyword inputs, classifiers, BN, LSTM, SSM

Runs the test suite's zoo (tests/zoo.py: nanoGPT as its author writes it,
a GPT reading its shapes from tensors, Hugging Face GPT-2, Llama, Mistral,
Qwen2, Phi-3, GPT-NeoX, OPT, BERT built from small configs; and beyond one
token tensor in and logits out: T5 fed keyword inputs, Qwen3 fed a padding
mask and its labels, a ResNet with BatchNorm, an MLP-Mixer, an LSTM language
model and Mamba, under data parallelism only) under each
strategy on gloo processes, and prints a Markdown table: ✓ with the worst
relative difference from one device (first-step gradients, parameters after
3 SGD steps), or ✗ with the reason. Bar: 1e-5.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

STRATEGIES = {
    "tp": (2, "TP=2 on the blocks"),
    "zero3": (2, "ZeRO-3, dp=2"),
    "dp2": (2, "dp=2, replicated"),
    "dp2tp2": (4, "dp=2 × tp=2, ZeRO-3"),
    "pp2tp2": (4, "pp=2 × tp=2, 1F1B, recompute"),
    "3d": (8, "pp=2 × dp=2 × tp=2, ZeRO-3"),
    "sp": (2, "TP=2 + SP on the blocks"),
    "dp2tp2sp": (4, "dp=2 × tp=2 + SP, ZeRO-3"),
    "pp2tp2sp": (4, "pp=2 × tp=2 + SP, 1F1B, selective recompute"),
    "pp2cuts": (2, "pp=2 at every cut offered, 1F1B"),
}
SEQUENCE = {"sp", "dp2tp2sp", "pp2tp2sp"}
EXACT = 1e-5


def _cuts_cell(metrics: dict) -> str:
    """Every cut offered at pp=2: how many match one device, the worst difference, the first failure."""
    if "error" in metrics:
        return f"✗ {metrics['error'].splitlines()[0][:120]}"
    cuts = metrics["cuts"]
    bad = {c: v for c, v in cuts.items() if isinstance(v, str) or v >= EXACT}
    if bad:
        cut, why = next(iter(bad.items()))
        why = why if isinstance(why, str) else f"differs by {why:.1e}"
        return f"✗ {len(cuts) - len(bad)}/{len(cuts)} cuts; after {cut}: {why}"
    return f"✓ {len(cuts)}/{len(cuts)} cuts, {max(cuts.values(), default=0.0):.0e}"


def _cell(metrics: dict, blocks: str, sequence: bool) -> str:
    if "cuts" in metrics:
        return _cuts_cell(metrics)
    if "error" in metrics:
        return f"✗ {metrics['error'].splitlines()[0][:120]}"
    worst = max(metrics["grad_rel"], metrics["param_rel"], metrics["loss1_rel"])
    if metrics["mesh"][2] > 1:
        prefix = blocks.removesuffix(".*") + "."
        styles = {(tp, sp) for name, tp, _, _, sp in metrics["layers"] if name.startswith(prefix)}
        if styles != {("megatron", sequence)}:
            return f"✗ blocks ran as {sorted(map(str, styles))}, not as planned"
    if worst >= EXACT:
        return f"✗ differs from one device by {worst:.1e} ({metrics['grad_worst']})"
    return f"✓ {worst:.0e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--models", default="all", help="all, beyond (the models of tests/zoo.py's BEYOND), "
                        "or names separated by commas")
    args = parser.parse_args()
    from distributed import run_cases
    from zoo import BEYOND, MODELS

    models = {**MODELS, **BEYOND}
    if args.models == "beyond":
        models = dict(BEYOND)
    elif args.models != "all":
        unknown_models = sorted(set(args.models.split(",")) - set(models))
        if unknown_models:
            parser.error(f"unknown models {unknown_models}; choose from {sorted(models)}")
        models = {m: models[m] for m in args.models.split(",")}

    chosen = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(chosen) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {sorted(STRATEGIES)}")
    from cut_matrix_cases import MODELS as CUT_MODELS
    from zoo_cases import SPECS

    def key(m: str, s: str) -> str:
        return f"cut_matrix_cases:{m}" if s == "pp2cuts" else f"zoo_cases:{m}/{s}"

    rows = dict(models)
    if "pp2cuts" in chosen and args.models == "all":  # the cut matrix's own models (e.g. an LSTM LM)
        rows.update({m: (None, "") for m in CUT_MODELS if m not in rows})
    results: dict[str, dict] = {}
    for world in sorted({STRATEGIES[s][0] for s in chosen}):
        cases = [key(m, s) for m in rows for s in chosen if STRATEGIES[s][0] == world
                 and (f"{m}/{s}" in SPECS or (s == "pp2cuts" and m in CUT_MODELS))]
        results.update(run_cases(world, cases))
    print("| model | " + " | ".join(STRATEGIES[s][1] for s in chosen) + " |")
    print("| --- |" + " --- |" * len(chosen))
    for model, (_, blocks) in rows.items():
        cells = [_cell(results[key(model, s)], blocks, s in SEQUENCE) if key(model, s) in results
                 else _missing(model, s) for s in chosen]
        print(f"| {model} | " + " | ".join(cells) + " |")


def _missing(model: str, strategy: str) -> str:
    from zoo import BEYOND, MODELS

    if model not in MODELS and model not in BEYOND:
        return "— (a model of the cut matrix only)"
    if model in BEYOND:
        return "— (data parallelism only in this table; pipelines: the cuts' table)"
    return "—" if strategy == "dp2" else f"✗ not offered: {_refusal(model)}"


def _refusal(model: str) -> str:
    """Why capture offers no sequence parallelism on the model's blocks."""
    from zoo import MODELS, build

    from autopar.capturing import capture

    m, inputs = build(model)
    prefix = MODELS[model][1].removesuffix(".*") + "."
    for layer in capture(m, inputs):
        for style in layer.tp_styles:
            if layer.name.startswith(prefix) and style.sequence_refusal:
                return style.sequence_refusal[:120]
    return "no case"


if __name__ == "__main__":
    main()
