#!/usr/bin/env python3
"""The rows per expert from which 4-bit weights pay to be written out, from bench runs of both paths.

    PYTHONPATH=src python3 scripts/w4_threshold.py OFF.json DEQ.json [OFF2.json DEQ2.json ...]

Each pair is one ``scripts/lab_ab.sh`` call's ``FUSEDMOE_W4_DEQUANT=0`` and ``=1`` runs of
``fusedmoe bench`` (the same cells, one machine). Prints, per 4-bit format, the layer's time ratio
(4-bit GEMM / written out) per preset at each measured rows per expert (T x top-k / E), and the
row for ``experts/thresholds.py`` ``W4_DEQUANT_FROM``: the smallest measured count from which every
preset measured there and at every larger count gains (ratio above 1), or None where none does.
A GPU's run (what ``layer_h200_w4_dequant_2026-11-29.md`` records for the H200):

    V="deq:FUSEDMOE_W4_DEQUANT=1 off:FUSEDMOE_W4_DEQUANT=0"
    PRESETS=mixtral-8x7b,gpt-oss-20b SCHEMES=mxfp4,nvfp4_w4a16 TOKENS=1024,2048,4096 VARIANTS="$V" \\
      bash scripts/lab_ab.sh
    PRESETS=qwen3-30b-a3b SCHEMES=int4_g128,mxfp4,nvfp4_w4a16 TOKENS=4096,8192,16384 VARIANTS="$V" ...
    PRESETS=mixtral-8x7b SCHEMES=int4_g128 TOKENS=512,1024,2048,4096 VARIANTS="$V" ...
"""

from __future__ import annotations

import sys
from collections import defaultdict

from ab_ratios import graph_ms

from fusedmoe.quant import QuantScheme
from fusedmoe.quant.w4_layout import W4_FORMATS
from fusedmoe.tools.presets import preset_config


def w4_format(scheme: str) -> str | None:
    """The 4-bit kernel format of a bench scheme name, or None (not a 4-bit weight scheme)."""
    s = QuantScheme.by_name(scheme)
    if s.w1 is None or s.a1 is not None or s.w1.dtype not in W4_FORMATS:
        return None
    return W4_FORMATS[s.w1.dtype]


def ratios(pairs: list[tuple[dict, dict]]) -> dict[str, dict[int, dict[str, float]]]:
    """format -> rows per expert -> preset -> 4-bit GEMM ms / written-out ms."""
    out: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for off, deq in pairs:
        for (preset, scheme, t), ms in deq.items():
            fmt = w4_format(scheme)
            if fmt is None or (preset, scheme, t) not in off:
                continue
            c = preset_config(preset)
            rows = t * c.top_k // c.num_experts
            out[fmt][rows][preset] = off[(preset, scheme, t)] / ms
    return out


def threshold(by_rows: dict[int, dict[str, float]]) -> int | None:
    """The smallest count from which every measured cell, there and above, gains."""
    start = None
    for rows in sorted(by_rows, reverse=True):
        if all(x > 1.0 for x in by_rows[rows].values()):
            start = rows
        else:
            break
    return start


def main(paths: list[str]) -> None:
    if len(paths) < 2 or len(paths) % 2:
        raise SystemExit(__doc__)
    pairs = [(graph_ms(paths[i]), graph_ms(paths[i + 1])) for i in range(0, len(paths), 2)]
    for fmt, by_rows in sorted(ratios(pairs).items()):
        print(f"{fmt}:")
        for rows in sorted(by_rows):
            cells = ", ".join(f"{p} {x:.2f}" for p, x in sorted(by_rows[rows].items()))
            print(f"  {rows:6d} rows per expert: {cells}")
        print(f"  W4_DEQUANT_FROM row: {threshold(by_rows)}")


if __name__ == "__main__":
    main(sys.argv[1:])
