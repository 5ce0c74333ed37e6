"""Run one MoE layer call per case under a profiler window, for Nsight Compute (``scripts/ncu_suite.sh``).

    python3 scripts/profile_kernels.py --case mixtral-8x7b:mxfp4:16 [--case ...] [--warmup 3]

Per case (preset:scheme:T): the weights the bench uses (``tools.bench.bench_weights``), the kernel
the oracle builds, ``--warmup`` calls (compiles, autotuned caches), then one call between
``cudaProfilerStart`` / ``cudaProfilerStop``: run under ``ncu --profile-from-start off`` only that
call's kernels are profiled. Each case prints the experts backend it ran and the call's time
(CUDA events around it, eager), to read the report's kernels against.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402


def run_case(spec: str, warmup: int) -> None:
    from fusedmoe import QuantScheme
    from fusedmoe.oracle.build import build_kernel
    from fusedmoe.routing import RouterConfig
    from fusedmoe.tools.bench import bench_weights
    from fusedmoe.tools.presets import preset_config

    preset, scheme_name, tokens = spec.split(":")
    config, scheme = preset_config(preset), QuantScheme.by_name(scheme_name)
    weights = bench_weights(config, scheme, "cuda")
    kernel = build_kernel(config, scheme)
    kweights = kernel.experts.prepare_weights(weights)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(int(tokens), config.hidden_size, generator=g, device="cuda").to(config.dtype)
    logits = torch.randn(int(tokens), config.num_experts, generator=g, device="cuda")
    topk = RouterConfig(config.num_experts, config.top_k, renormalize=True).route(logits)
    for _ in range(warmup):
        kernel(x, topk, kweights)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.profiler.start()
    start.record()
    kernel(x, topk, kweights)
    end.record()
    torch.cuda.profiler.stop()
    torch.cuda.synchronize()
    print(f"case {spec}: experts {type(kernel.experts).__name__}; "
          f"call {start.elapsed_time(end) * 1e3:.1f} us (profiler window, eager)", flush=True)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", required=True, help="preset:scheme:T")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    for spec in args.case:
        run_case(spec, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
