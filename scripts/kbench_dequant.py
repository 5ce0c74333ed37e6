"""Time ``kernels.w4_dequant`` alone on real expert shapes, per launch config (GPU).

    PYTHONPATH=src python3 scripts/kbench_dequant.py [--configs "64,256,4,1 32,256,4,1 ..."]

Each config is BN,BK,WARPS (``w4_dequant._CONFIG``). Prints, per format and shape, the median
time of 10 launches (CUDA events; the weights, 0.7-3.5 GB a pass, are far past the L2) and the
bytes moved per second (packed bytes, scales and the output), and checks every config's output
against the first one's, bit for bit.
"""

from __future__ import annotations

import argparse

import torch

from fusedmoe.kernels import w4_dequant
from fusedmoe.quant import QuantScheme, quantize
from fusedmoe.quant.w4_layout import to_w4

SHAPES = {"mixtral W13": (8, 28672, 4096), "mixtral W2": (8, 4096, 14336), "gpt-oss W13": (32, 5760, 2880)}
SCHEMES = {
    "mxfp4": QuantScheme.mxfp4_w4a16(),
    "nvfp4": QuantScheme.nvfp4_w4a16(),
    "int4_g128": QuantScheme.int4_w4a16(128),
}


def _time(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64,256,4 32,256,4 128,256,8 64,512,4 16,512,4 128,128,4")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split()]
    for sname in args.schemes.split(","):
        tq = SCHEMES[sname].w1
        for shape_name in args.shapes.split(","):
            if SHAPES[shape_name][2] % tq.granularity.group_size:
                continue
            _run(sname, tq, shape_name, configs)


def _run(sname: str, tq, shape_name: str, configs) -> None:
    e, n, k = SHAPES[shape_name]
    w = to_w4(quantize(torch.randn(e, n, k, device="cuda") * k**-0.5, tq), tq)
    moved = sum(t.numel() * t.element_size() for t in w.tensors().values()) + e * n * k * 2
    out = torch.empty(e, n, k, dtype=torch.bfloat16, device="cuda")
    first = None
    for bn, bk, warps in configs:
        w4_dequant._CONFIG = {"block_n": bn, "block_k": bk, "num_warps": warps}
        out.fill_(float("nan"))
        ms = _time(lambda: w4_dequant.dequantize_w4(w, torch.bfloat16, out=out))
        same = "ref" if first is None else ("same" if torch.equal(out, first) else "DIFFERENT")
        first = out.clone() if first is None else first
        print(f"{sname:10s} {shape_name:12s} BN {bn:3d} BK {bk:3d} warps {warps}: "
              f"{ms:7.3f} ms {moved / ms / 1e9:6.2f} TB/s {same}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
