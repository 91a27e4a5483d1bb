"""Write a training corpus that needs no download: the sources of this Python's standard library.

    python examples/stdlib_corpus.py corpus.txt                  # the top-level *.py files (4.7 MB on 3.11)
    python examples/stdlib_corpus.py corpus.txt --max-mb 2

The top-level ``*.py`` modules of ``sysconfig.get_paths()["stdlib"]``, in name
order, each after a ``# file: NAME`` line, until ``--max-mb`` is reached:
the same bytes on every machine with the same Python, English prose in the
docstrings and a lot of code, enough for a small GPT's loss to fall for a few
hundred steps (``examples/train_gpt.py --data corpus.txt``).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's top-level modules, concatenated in name order, cut at ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += f"# file: {path.name}\n".encode() + path.read_bytes() + b"\n"
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the text file to write")
    p.add_argument("--max-mb", type=float, default=8.0, help="stop after this many megabytes")
    args = p.parse_args()
    text = stdlib_text(int(args.max_mb * 1e6))
    Path(args.out).write_bytes(text)
    print(f"wrote {len(text):,} bytes of {sysconfig.get_paths()['stdlib']}/*.py to {args.out}")


if __name__ == "__main__":
    main()
