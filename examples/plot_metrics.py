"""Draw the loss (and tokens/s against the plan's) of a training run's metrics file as a PNG.

    python examples/plot_metrics.py metrics.jsonl loss.png

Reads the JSON lines ``examples/train_gpt.py --metrics-file`` writes
(:mod:`autopar.runtime.metrics`): the loss by step on the left, measured
tokens/s beside the plan's prediction on the right. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="the JSON-lines metrics file")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--title", default=None, help="the figure's title")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in reports]
    fig, (loss, speed) = plt.subplots(1, 2, figsize=(10, 3.6))
    loss.plot(steps, [r["loss"] for r in reports], color="tab:blue")
    loss.set_xlabel("step")
    loss.set_ylabel("loss (cross-entropy, nats)")
    loss.grid(alpha=0.3)
    speed.plot(steps, [r["tokens_per_s"] for r in reports], color="tab:green", label="measured")
    speed.plot(steps, [r["plan"]["tokens_per_s"] for r in reports], color="tab:gray", linestyle="--",
               label="plan's prediction")
    speed.set_xlabel("step")
    speed.set_ylabel("tokens/s")
    speed.set_ylim(bottom=0)
    speed.legend()
    speed.grid(alpha=0.3)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(reports)} reports, loss {reports[0]['loss']:.3f} → {reports[-1]['loss']:.3f})")


if __name__ == "__main__":
    main()
