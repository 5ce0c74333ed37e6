"""Where the host time of an eager MoE call goes: per-call microseconds and a profile.

    python scripts/profile_host.py [--preset qwen3-30b-a3b] [--scheme bf16] [--tokens 1] [--calls 1000]
                                   [--profile fused_moe|route_kernel|kernel] [--sort cumulative|tottime]
                                   [--stub] [--out DIR]

For each of ``fused_moe(x, logits, ...)`` (the functional entry) and ``kernel(x, topk, weights)``
(a built ``MoEKernel``, as the layer calls it) it prints the host time per call: enqueue only (no
synchronisation between calls) and, on a GPU, the wall time with a synchronisation after each
call; then the top of a cProfile of ``--calls`` calls of one of them (``--profile``; ``--sort``
cumulative or own time), which says which Python frames cost what.

``--stub`` (a CPU machine): every Triton launch returns at once (launches are replaced by a no-op
under ``TRITON_INTERPRET=1``), so the numbers are fusedmoe's own Python around the launches, not
Triton's launch path; use the small preset there. On a GPU nothing is stubbed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

# --profile: the name of each call in the table
_PROFILED = {"fused_moe": "fused_moe(x, logits)", "route_kernel": "route + MoEKernel", "kernel": "MoEKernel(x, topk)"}


def _stub_launches() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.__getitem__ = lambda self, grid: lambda *a, **k: None


def _weights(config, scheme, device):
    from fusedmoe.tools.bench import bench_weights
    from fusedmoe.weights import ExpertWeights

    if device == "cuda":
        return bench_weights(config, scheme, device)
    g = torch.Generator().manual_seed(0)
    e, r, h, i = config.num_experts, config.w13_rows, config.hidden_size, config.intermediate_size
    w13, w2 = torch.randn(e, r, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5
    if scheme.w1 is None:
        w13, w2 = w13.to(config.dtype), w2.to(config.dtype)
    return ExpertWeights.from_float(w13, w2, scheme)


def _per_call_us(fn, calls: int, sync: bool) -> float:
    def once():
        fn()
        if sync:
            torch.cuda.synchronize()

    for _ in range(5):
        once()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    spans = []
    for _ in range(max(1, calls // 100)):
        t0 = time.perf_counter()
        for _ in range(100 if not sync else 1):
            once()
        spans.append((time.perf_counter() - t0) / (100 if not sync else 1))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return statistics.median(spans) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None)
    ap.add_argument("--scheme", default="bf16")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--stub", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--profile", choices=list(_PROFILED), default="fused_moe", help="the call cProfile watches")
    ap.add_argument("--sort", choices=["cumulative", "tottime"], default="cumulative")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.stub:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--stub needs TRITON_INTERPRET=1 in the environment (set before Python starts)", file=sys.stderr)
            return 2
        _stub_launches()
    from fusedmoe import QuantScheme, fused_moe
    from fusedmoe.oracle.build import build_kernel
    from fusedmoe.tools.presets import preset_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = args.preset or ("qwen3-30b-a3b" if device == "cuda" else "small")
    config = preset_config(preset)
    scheme = QuantScheme.by_name(args.scheme)
    weights = _weights(config, scheme, device)
    kernel = build_kernel(config, scheme, backend=args.backend)
    kweights = kernel.experts.prepare_weights(weights)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.tokens, config.hidden_size, generator=g, device=device).to(config.dtype)
    logits = torch.randn(args.tokens, config.num_experts, generator=g, device=device)
    from fusedmoe.routing import RouterConfig

    router = RouterConfig(config.num_experts, config.top_k, renormalize=True)
    topk = router.route(logits)
    calls = {
        "fused_moe(x, logits)": lambda: fused_moe(x, logits, weights, config, scheme, backend=args.backend),
        "route + MoEKernel": lambda: kernel(x, router.route(logits), kweights),
        "MoEKernel(x, topk)": lambda: kernel(x, topk, kweights),
    }
    lines = [f"# host time per eager call: {preset} {args.scheme} T={args.tokens} on {device}"
             + (" (Triton launches stubbed)" if args.stub else ""), "",
             "| call | enqueue us/call | synced wall us/call |", "|---|---|---|"]  # fmt: skip
    for plans in ("1", "0"):  # launch plans (modular.replay) on, then off
        os.environ["FUSEDMOE_LAUNCH_PLANS"] = plans
        for name, fn in calls.items():
            enq = _per_call_us(fn, args.calls, sync=False)
            wall = _per_call_us(fn, min(args.calls, 200), sync=True) if device == "cuda" else float("nan")
            lines.append(f"| {name}{'' if plans == '1' else ' (plans off)'} | {enq:.1f} | {wall:.1f} |")
    os.environ["FUSEDMOE_LAUNCH_PLANS"] = "1"
    prof = cProfile.Profile()
    fn = calls[_PROFILED[args.profile]]
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(args.sort).print_stats(args.top)
    text = "\n".join(lines) + "\n\n```\n" + buf.getvalue() + "```\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"host_{preset}_{args.scheme}_T{args.tokens}_{args.profile}.md"
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
