"""Issue 41's done-when matrix: outside families × {ZeRO-3 dp=2, pp=2 at each cut, tp=2, ep=2}, each against
one process (``verify``'s reference), on 2 gloo ranks.

    python benchmarks/outside_matrix.py [--families nanogpt,jamba,...]

Cases in tests/outside_matrix_cases.py (one per family: every cell of its row in one spawn). Prints one
line per cell: ✓ with the worst relative difference (bar 1e-5), ✗ with the difference or the error, or
"refused" with the planner's one line; then the blocks' tp refusals capture recorded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
EXACT = 1e-5


def cell(result: dict) -> str:
    if "refused" in result:
        return "refused: " + result["refused"][:220]
    if "error" in result:
        return "✗ " + result["error"][:220]
    mark = "✓" if result["rel"] < EXACT else "✗"
    shown = ", ".join(result["tp_layers"][:6]) + (" …" if len(result["tp_layers"]) > 6 else "")
    tp = f", tp on {len(result['tp_layers'])} layers ({shown})" if result["mesh"][3] > 1 else ""
    return f"{mark} {result['rel']:.1e} ({result['worst']}), mesh pp,dp,ep,tp={result['mesh']}{tp}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="names (prefixes) separated by commas; default all")
    args = parser.parse_args()
    from distributed import run_cases
    from outside_matrix_cases import FAMILIES

    wanted = [f for f in FAMILIES if not args.families or any(f.startswith(p) for p in args.families.split(","))]
    results = run_cases(2, wanted, module="outside_matrix_cases")
    for name in wanted:
        r = results[name]
        print(f"## {name}")
        if "error" in r and "tp_refusals" not in r:
            print(f"  ✗ case failed: {r['error'][:300]}")
            continue
        for kind, got in r.items():
            if kind not in ("tp_refusals", "ranks", "case") and isinstance(got, dict):
                print(f"  {kind}: {cell(got)}")
        for line in r.get("tp_refusals", []):
            print(f"  no tp: {line[:220]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
