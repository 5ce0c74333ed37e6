"""``fusedmoe tune``: search grouped-GEMM launch configs on this GPU and write them as JSON.

For a preset (or shape) and a scheme, each of the layer's two GEMMs (W13: N = 2I,
K = H; W2: N = H, K = I) is tuned separately at each token count: every candidate
``LaunchConfig`` of the search space runs once, its output is checked against the
heuristic config's output (relative error <= 1e-2, so a config that computes
something else is never kept), then timed with ``triton.testing.do_bench`` (median,
L2 flushed). The fastest survivor of each token count is written to
``<dir>/<gpu>/<scheme>/E=..,N=..,K=...json`` (see ``kernels.tuned_configs``), which
``pick_launch_config`` reads at run time.

The token count picks the entry, never the file (STYLE point 6).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from .kernels.align import moe_align
from .kernels.grouped_gemm import grouped_gemm, scheme_key
from .kernels.launch_config import LaunchConfig, default_launch_config
from .kernels.tuned_configs import PACKAGE_DIR, clear_cache, config_path
from .presets import preset_config
from .quant import QuantScheme, quantize
from .testing import random_topk, rel_error

SPACES = {
    # ~48 candidates per token count after the BM filter: minutes per GEMM on an H100
    "quick": dict(
        block_m=(16, 32, 64, 128),
        block_n=(64, 128, 256),
        block_k=(64, 128),
        group_m=(1, 8),
        num_warps=(4, 8),
        num_stages=(3,),
    ),
    "full": dict(
        block_m=(16, 32, 64, 128),
        block_n=(32, 64, 128, 256),
        block_k=(32, 64, 128),
        group_m=(1, 8, 16),
        num_warps=(4, 8),
        num_stages=(2, 3, 4, 5),
    ),
    # for tests under the interpreter: two candidates
    "tiny": dict(block_m=(16,), block_n=(32, 64), block_k=(32,), group_m=(1,), num_warps=(4,), num_stages=(2,)),
}


def candidates(space: str, m_pairs: int, num_experts: int, block_m: int | None = None) -> list[LaunchConfig]:
    """The space's configs whose BM suits the rows per expert (at most 4x the need, at least 16).

    ``block_m`` pins BM: the layer aligns the pairs once, with GEMM1's BM, and GEMM2 runs
    on that alignment, so GEMM2 is tuned under the BM GEMM1 chose (tuning it freely
    picked tiles the layer then ran with another BM: 2x slower fp8-block cells, H200).
    """
    grid = dict(SPACES[space])
    if block_m is not None:
        grid["block_m"] = (block_m,)
    need = max(16, 4 * m_pairs // max(1, num_experts))
    out = []
    for vals in itertools.product(*grid.values()):
        cfg = LaunchConfig(**dict(zip(grid, vals, strict=True)))
        if cfg.block_m <= need or cfg.block_m == 16:
            out.append(cfg)
    return out


def _operands(config, scheme, gemm, t, weights, device, g):
    """A (quantized as the scheme says), its scale, the weight, routing ids/weights and a_div."""
    k = config.top_k
    ids, w = random_topk(t, config.num_experts, k, g)
    if gemm == "w13":
        a = torch.randn(t, config.hidden_size, generator=g, device=device).to(config.dtype)
        tq, wq, a_div = scheme.a1, weights.w13, k
    else:
        a = torch.randn(t * k, config.intermediate_size, generator=g, device=device).to(config.dtype)
        tq, wq, a_div = scheme.a2, weights.w2, 1
    aq = quantize(a, tq) if tq is not None else None
    return (
        (aq.data if aq is not None else a),
        (aq.scale if aq is not None else None),
        (aq.global_scale if aq is not None else None),
        wq,
        ids,
        w,
        a_div,
    )


def tune_gemm(
    config, scheme, weights, gemm: str, tokens, *, space="quick", device="cuda", progress=True, block_m=None
) -> dict:
    """{pairs: (LaunchConfig, ms)} for one GEMM of the layer; ``block_m``: {pairs: BM} to pin."""
    from triton.testing import do_bench

    e = config.num_experts
    wq_t = scheme.w1 if gemm == "w13" else scheme.w2
    aq_t = scheme.a1 if gemm == "w13" else scheme.a2
    n, kd = (config.w13_rows, config.hidden_size) if gemm == "w13" else (config.hidden_size, config.intermediate_size)
    key = scheme_key(wq_t, aq_t)
    g = torch.Generator(device=device).manual_seed(0)
    best = {}
    for t in tokens:
        a, a_scale, a_gs, wq, ids, w, a_div = _operands(config, scheme, gemm, t, weights, device, g)
        pairs = t * config.top_k

        def run(cfg, a=a, a_scale=a_scale, a_gs=a_gs, wq=wq, ids=ids, a_div=a_div):
            routing = moe_align(ids, e, cfg.block_m)
            return grouped_gemm(
                a,
                wq,
                routing,
                w_quant=wq_t,
                a_quant=aq_t,
                a_scale=a_scale,
                a_global_scale=a_gs,
                a_div=a_div,
                config=cfg,
                out_dtype=config.dtype,
            )

        ref = run(default_launch_config(pairs, e, n, kd, key)).float()
        cands = candidates(space, pairs, e, None if block_m is None else block_m[pairs])
        it = cands
        if progress:
            try:
                from tqdm import tqdm

                it = tqdm(cands, desc=f"{gemm} T={t}", leave=False)
            except ImportError:
                pass
        results = []
        for cfg in it:
            try:
                out = run(cfg)
                if rel_error(out, ref) > 1e-2:
                    print(f"  rejected {cfg}: output differs ({rel_error(out, ref):.2e})")
                    continue
                ms = do_bench(partial(run, cfg), warmup=5, rep=25, return_mode="median") if device == "cuda" else 0.0
            except Exception as exc:  # a config the GPU cannot run (shared memory, registers)
                if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc):
                    raise
                continue
            results.append((ms, cfg))
        ms, cfg = min(results, key=lambda r: r[0])  # first of equals: the space's order
        best[pairs] = (cfg, ms)
        print(f"{gemm} E={e} N={n} K={kd} {key} T={t} pairs={pairs}: {cfg} {ms:.4f} ms ({len(results)} ran)")
    return {"key": key, "E": e, "N": n, "K": kd, "best": best}


def write(result: dict, out_dir: Path | str, gpu: str) -> Path:
    import triton

    path = config_path(out_dir, gpu, result["key"], result["E"], result["N"], result["K"])
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "gpu": gpu,
        "scheme": result["key"],
        "E": result["E"],
        "N": result["N"],
        "K": result["K"],
        "triton": triton.__version__,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "configs": {str(m): asdict(c) for m, (c, _) in sorted(result["best"].items())},
        "ms": {str(m): round(ms, 5) for m, (_, ms) in sorted(result["best"].items())},
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    clear_cache()
    return path


def tune(
    preset: str, scheme_name: str, tokens, *, out_dir=None, space="quick", device="cuda", **overrides
) -> list[Path]:
    """Tune both GEMMs of a preset layer for ``scheme_name``; returns the JSON files written."""
    from .bench import bench_weights

    config = preset_config(preset, **overrides)
    scheme = QuantScheme.by_name(scheme_name)
    if device == "cuda":
        weights, gpu = bench_weights(config, scheme, device), torch.cuda.get_device_name()
    else:
        from .weights import ExpertWeights

        g = torch.Generator().manual_seed(0)
        w13 = torch.randn(config.num_experts, config.w13_rows, config.hidden_size, generator=g) * 0.05
        w2 = torch.randn(config.num_experts, config.hidden_size, config.intermediate_size, generator=g) * 0.05
        weights = ExpertWeights.from_float(
            w13.to(config.dtype) if scheme.w1 is None else w13, w2.to(config.dtype) if scheme.w1 is None else w2, scheme
        )
        gpu = "cpu-interpreter"
    out_dir = Path(out_dir) if out_dir else PACKAGE_DIR
    first = tune_gemm(config, scheme, weights, "w13", tokens, space=space, device=device)
    bm = {pairs: cfg.block_m for pairs, (cfg, _) in first["best"].items()}
    second = tune_gemm(config, scheme, weights, "w2", tokens, space=space, device=device, block_m=bm)
    return [write(first, out_dir, gpu), write(second, out_dir, gpu)]


__all__ = ["tune", "tune_gemm", "candidates", "SPACES"]
