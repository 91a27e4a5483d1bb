"""The chosen plan against every baseline of `autopar compare`, over a matrix of cases.

    python benchmarks/compare_matrix.py

For each case (model × cluster × world size × batch, some memory-tight) it
prints the chosen plan's predicted step time, the best baseline that fits and
their ratio. The chosen plan must never be slower than a baseline under the
same cost model; the script exits 1 if it is. :func:`case_rows` gives every
baseline of every case (``benchmarks/suite.py`` tables and plots them all).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import convnet  # noqa: E402
import gpt  # noqa: E402
import llama  # noqa: E402

import autopar  # noqa: E402

# (label, spec function, cluster, world size, global batch, memory budget GiB or None)
Case = tuple[str, Callable, str, int, int, float | None]
CASES: list[Case] = [
    ("gpt2-small", gpt.gpt2_small, "a100-40g", 8, 64, None),
    ("gpt2-small", gpt.gpt2_small, "v100-16g", 16, 128, None),
    ("gpt2-xl", gpt.gpt2_xl, "v100-16g", 32, 64, None),
    ("gpt2-xl", gpt.gpt2_xl, "a100-40g", 64, 512, 8),
    ("gpt3-6.7b", gpt.gpt3_6_7b, "a100-40g", 64, 256, None),
    ("gpt3-6.7b", gpt.gpt3_6_7b, "v100-16g", 128, 256, None),
    ("gpt3-13b", gpt.gpt3_13b, "a100-80g", 128, 512, None),
    ("gpt3-13b", gpt.gpt3_13b, "h100-80g", 32, 64, 20),
    ("gpt3-175b", gpt.gpt3_175b, "a100-80g", 1024, 1536, None),
    ("gpt3-175b", gpt.gpt3_175b, "h100-80g", 512, 1024, None),
    ("llama3-8b", llama.llama3_8b, "h100-80g", 64, 64, None),
    ("llama3-8b", llama.llama3_8b, "a100-40g", 32, 32, None),
    ("llama3-70b", llama.llama3_70b, "h100-80g", 256, 256, None),
    ("resnet18ish", convnet.resnet18ish, "a100-40g", 8, 256, None),
]


@dataclass(frozen=True)
class BaselineStep:
    """One baseline's predicted step time; ``None`` when it does not fit or does not apply."""

    name: str
    step_s: float | None
    min_memory_bytes: int | None = None  # when memory is why it does not fit
    reason: str = ""  # why there is no step time


@dataclass(frozen=True)
class CaseRow:
    """One case: the chosen plan's predicted step time beside every baseline's."""

    label: str
    cluster: str
    world: int
    batch: int
    memory_gb: float | None
    chosen_s: float | None  # None when nothing fits
    baselines: tuple[BaselineStep, ...]

    @property
    def best(self) -> BaselineStep | None:
        """The fastest baseline that fits."""
        return min((b for b in self.baselines if b.step_s is not None), key=lambda b: b.step_s,
                   default=None)

    @property
    def beaten(self) -> bool:
        """Whether a baseline is faster than the chosen plan (a solver or search-space bug)."""
        chosen = self.chosen_s if self.chosen_s is not None else float("inf")
        best = self.best.step_s if self.best else float("inf")
        return chosen > best * (1 + 1e-9)


def _step(result: autopar.BaselineResult) -> float | None:
    return result.plan.predicted.step_time_s if result.fits else None


def case_rows(cases: Iterable[Case] = CASES) -> Iterator[CaseRow]:
    """Each case's row as soon as it is priced (each model is captured once)."""
    graphs: dict[str, autopar.LayerGraph] = {}
    for label, spec, cluster, world, batch, memory in cases:
        if label not in graphs:
            graphs[label] = autopar.capture(*spec())
        chosen, baselines = autopar.compare(graphs[label], world, cluster=cluster, global_batch=batch,
                                            memory_gb=memory)
        yield CaseRow(label, cluster, world, batch, memory, _step(chosen),
                      tuple(BaselineStep(b.name, _step(b), b.min_memory_bytes, b.reason) for b in baselines))


def main() -> int:
    print("| model | cluster | world | batch | memory GiB | chosen s | best baseline | baseline s | "
          "baseline / chosen |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    failures = 0
    for row in case_rows():
        best = row.best
        failures += row.beaten
        chosen_s = row.chosen_s if row.chosen_s is not None else float("inf")
        best_s = best.step_s if best else float("inf")
        ratio = f"{best_s / chosen_s:.3f}" if best and row.chosen_s is not None else "—"
        mem = f"{row.memory_gb}" if row.memory_gb else "default"
        print(f"| {row.label} | {row.cluster} | {row.world} | {row.batch} | {mem} | {chosen_s:.4g} | "
              f"{best.name if best else 'none fits'} | {best_s:.4g} | {ratio} |", flush=True)
    print(f"\n{len(CASES)} cases, {failures} where a baseline beat the chosen plan")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
