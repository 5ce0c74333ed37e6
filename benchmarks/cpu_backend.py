"""The cpu backend against the per-expert loop, on this machine's CPU.

    python benchmarks/cpu_backend.py [--out benchmarks/results/cpu_backend.md]

Both run the same layer (bf16, silu) from the same routing; runs alternate so
background load hits both alike; the median of 7 runs is reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.experts.cpu import CpuExperts, LoopExperts
from fusedmoe.kernel import MoEKernel
from fusedmoe.metadata import TopK
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem

SHAPES = [  # E, K, H, I
    (8, 2, 512, 256),
    (64, 8, 512, 128),
    (128, 8, 256, 64),
]
TOKENS = (1, 16, 128, 512)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--scheme", default="bf16")
    args = p.parse_args()
    scheme = QuantScheme.by_name(args.scheme)
    lines = [
        f"# cpu backend vs per-expert loop ({args.scheme}), {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
        "",
        "| E | K | H | I | T | loop ms | cpu ms | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e, k, h, i in SHAPES:
        cfg = MoEConfig(e, k, h, i)
        kern = {c.name: MoEKernel(LocalDispatcher(cfg, scheme), c(cfg, scheme)) for c in (CpuExperts, LoopExperts)}
        for t in TOKENS:
            prob = make_problem(cfg, scheme, t, seed=t)
            topk = TopK(prob.topk_ids, prob.topk_weights)
            times = {"cpu": [], "loop": []}
            for _ in range(7):
                for name, kr in kern.items():
                    t0 = time.perf_counter()
                    kr(prob.x, topk, prob.weights)
                    times[name].append(time.perf_counter() - t0)
            lo, cp = (statistics.median(times[n]) * 1e3 for n in ("loop", "cpu"))
            lines.append(f"| {e} | {k} | {h} | {i} | {t} | {lo:.2f} | {cp:.2f} | {lo / cp:.2f}x |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
