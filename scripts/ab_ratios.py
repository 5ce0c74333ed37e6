#!/usr/bin/env python3
"""old / new time per cell of ``fusedmoe bench`` JSON files, and their geometric mean.

    python3 scripts/ab_ratios.py OLD.json NEW.json [NEW2.json ...]

Cells are (preset, scheme, T) of the fusedmoe provider under CUDA graphs; a cell missing from
either file is listed as such. ``scripts/lab_ab.sh`` prints this after its runs.
"""

from __future__ import annotations

import json
import sys

from fusedmoe.tools.peers import geomean


def graph_ms(path: str) -> dict:
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {
        (r["preset"], r["scheme"], r["tokens"]): r["ms"]
        for r in rows
        if r["mode"] == "graph" and r["provider"] == "fusedmoe" and r.get("ms")
    }


def ratios(old: dict, new: dict) -> list[str]:
    """A line per cell (old ms, new ms, old / new) and the geometric mean of the ratios."""
    lines, xs = [], []
    for cell in sorted(old.keys() | new.keys()):
        if cell not in old or cell not in new:
            lines.append(f"{' '.join(map(str, cell))}: only in {'old' if cell in old else 'new'}")
            continue
        xs.append(old[cell] / new[cell])
        lines.append(f"{cell[0]} {cell[1]} T={cell[2]}: {old[cell]:.4f} -> {new[cell]:.4f} ms, x {xs[-1]:.3f}")
    if xs:
        lines.append(f"geometric mean x {geomean(xs):.3f} over {len(xs)} cells")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    old = graph_ms(argv[0])
    for path in argv[1:]:
        print(f"{path} against {argv[0]}:")
        print("\n".join(ratios(old, graph_ms(path))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
