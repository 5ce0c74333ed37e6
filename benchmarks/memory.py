"""Peak workspace of one MoE layer call against the token count T: chunking keeps it flat.

    python benchmarks/memory.py [--tokens 4096,8192,16384,32768,65536] [--chunk-size 8192]
                                [--experts 64 --top-k 8 --hidden 2048 --inter 1024]
                                [--scheme bf16] [--path local+triton | local_batched+triton_batched]

Per T, one row: the declared workspace of a chunk (``MoEKernel.workspace(T).nbytes()``)
and, on a GPU, the measured peak of ``torch.cuda.max_memory_allocated`` over the call
less what was allocated before it (weights, x, routing) and the output [T, H]; plus the
size of x itself for scale. On a CPU only the declared column is filled (the Triton
kernels would run under the interpreter, far too slowly at these sizes).
"""

from __future__ import annotations

import argparse

import torch

import fusedmoe
from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalBatchedDispatcher, LocalDispatcher
from fusedmoe.experts.triton import TritonBatchedExperts, TritonExperts
from fusedmoe.kernel import MoEKernel
from fusedmoe.metadata import TopK
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem, random_topk

MIB = 2**20


def build(path: str, config: MoEConfig, scheme: QuantScheme, chunk_size: int) -> MoEKernel:
    if path == "local+triton":
        return MoEKernel(LocalDispatcher(config, scheme), TritonExperts(config, scheme), chunk_size=chunk_size)
    disp = LocalBatchedDispatcher(config, scheme)
    return MoEKernel(disp, TritonBatchedExperts(config, scheme), chunk_size=chunk_size)


def measure(kernel: MoEKernel, config: MoEConfig, weights, t: int, g: torch.Generator) -> int:
    """Bytes allocated at the peak of one call beyond its inputs and its output."""
    x = torch.randn(t, config.hidden_size, device="cuda", dtype=config.dtype)
    ids, w = random_topk(t, config.num_experts, config.top_k, g)
    kernel(x[:16], TopK(ids[:16], w[:16]), weights)  # compile the kernels outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = kernel(x, TopK(ids, w), weights)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="4096,8192,16384,32768,65536")
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--scheme", default="bf16")
    p.add_argument("--path", default="local+triton", choices=["local+triton", "local_batched+triton_batched"])
    args = p.parse_args()
    config = MoEConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        dtype=torch.bfloat16,
    )
    scheme = QuantScheme.by_name(args.scheme)
    kernel = build(args.path, config, scheme, args.chunk_size)
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "CPU (declared only)"
    print(f"fusedmoe {fusedmoe.__version__}, torch {torch.__version__}, {device}")
    print(f"{args.path} {scheme.name} {config!r}, chunk_size {args.chunk_size}")
    weights = make_problem(config, scheme, 1, seed=0, device="cuda").weights if gpu else None
    g = torch.Generator(device="cuda").manual_seed(0) if gpu else None
    print("| T | x (MiB) | declared workspace (MiB) | measured peak (MiB) |")
    print("|---:|---:|---:|---:|")
    for t in (int(v) for v in args.tokens.split(",")):
        declared = kernel.workspace(t).nbytes() / MIB
        x_mib = t * config.hidden_size * config.dtype.itemsize / MIB
        peak = f"{measure(kernel, config, weights, t, g) / MIB:.1f}" if gpu else "-"
        print(f"| {t} | {x_mib:.1f} | {declared:.1f} | {peak} |")


if __name__ == "__main__":
    main()
