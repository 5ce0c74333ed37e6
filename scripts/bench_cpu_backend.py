"""The ``cpu`` backend against a transformers-style per-expert loop, on the CPU, bf16.

    python scripts/bench_cpu_backend.py [--tokens 1,16,64,256] [--rounds 7] [--out FILE]

The loop is the one transformers' MoE blocks ship (a one-hot mask, the experts hit, a gather, gate/up
linear, SiLU x up, down linear times the router weight, ``index_add_``); both run on the same weights
and routing. Shapes: the ``small`` preset and two small siblings of the shipped presets (Qwen3-30B-A3B's
128 experts of top-8 and Mixtral's 8 wide experts, H cut to 512). Prints the median over ``--rounds``
rounds of the mean time per call (us), the two sides alternating round by round, so a load that comes
and goes on a shared machine falls on both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fusedmoe import MoEConfig, QuantScheme
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.experts.cpu import CpuExperts
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.weights import ExpertWeights

SHAPES = {"small": (8, 2, 512, 256), "qwen3-30b-a3b/4": (128, 8, 512, 192), "mixtral-8x7b/8": (8, 2, 512, 1792)}


def hf_loop(x, ids, tw, w13, w2, num_experts):
    out = torch.zeros_like(x)
    mask = F.one_hot(ids.long(), num_experts).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = e[0]
        kk, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * tw[tok, kk, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def per_call_us(fns: dict, calls: int, rounds: int) -> dict:
    """The median over ``rounds`` of each function's mean time per call (us), alternating."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,16,64,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    lines = ["| shape | T | cpu backend us | transformers-style loop us | loop / cpu |", "|---|---|---|---|---|"]
    for name, (e, k, h, i) in SHAPES.items():
        config = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i)
        scheme = QuantScheme.unquantized()
        w13 = (torch.randn(e, 2 * i, h) / h**0.5).bfloat16()
        w2 = (torch.randn(e, h, i) / i**0.5).bfloat16()
        weights = ExpertWeights.from_float(w13, w2, scheme)
        kernel = MoEKernel(LocalDispatcher(config, scheme), CpuExperts(config, scheme))
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, h).bfloat16()
            tw, ids = torch.randn(t, e).softmax(-1).topk(k)
            topk = TopK(ids.int(), tw)
            calls = max(2, 40 // t)
            fns = {
                "ours": lambda: kernel(x, topk, weights),  # noqa: B023
                "loop": lambda: hf_loop(x, ids, tw, w13, w2, e),  # noqa: B023
            }
            us = per_call_us(fns, calls, args.rounds)
            ours, loop = us["ours"], us["loop"]
            lines.append(f"| {name} | {t} | {ours:.0f} | {loop:.0f} | {loop / ours:.2f} |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
