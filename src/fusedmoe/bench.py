"""``fusedmoe bench``: the whole layer against PyTorch's grouped GEMM and the roofline floor.

Per (preset, scheme, T) cell, in one run on one GPU:

- providers: ``fusedmoe`` (the oracle's backend through MoEKernel, routing
  given), ``torch_grouped_mm`` (``torch._grouped_mm`` with the same sort,
  activation and weighted scatter; bf16 only), ``loop`` (the per-expert loop);
- the floor: max(bytes / copy bandwidth, FLOPs / matmul rate), with bytes =
  the weights of the experts actually hit + activations in and out, and both
  ceilings measured in the same run;
- times are medians of ``triton.testing.do_bench`` (L2 flushed before each
  call, so weights are read cold; launches included).

Writes ``bench.md`` and ``bench.json`` under ``--out``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .config import MoEConfig
from .presets import PRESETS, preset_config
from .quant import QTensor, QuantScheme
from .testing import random_topk
from .weights import ExpertWeights


@dataclass
class Row:
    preset: str
    scheme: str
    tokens: int
    provider: str
    ms: float
    floor_ms: float
    pct_of_floor: float
    tb_s: float
    tflop_s: float
    experts_hit: int
    command: str


def measure_ceilings(device: str = "cuda") -> dict:
    """Copy bandwidth (bytes read + written) and dense bf16 matmul rate, measured now."""
    from triton.testing import do_bench

    n = 1 << 30  # 1 GiB of bf16 = 2 GiB moved per copy
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = do_bench(partial(dst.copy_, src), return_mode="median")
    bw = 2 * src.numel() * 2 / (ms * 1e-3)
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    ms = do_bench(partial(torch.matmul, a, b), return_mode="median")
    flops = 2 * m**3 / (ms * 1e-3)
    return {"copy_bytes_per_s": bw, "bf16_flop_per_s": flops, "gpu": torch.cuda.get_device_name()}


def bench_weights(config: MoEConfig, scheme: QuantScheme, device: str, chunk: int = 16) -> ExpertWeights:
    """Random weights, quantized a few experts at a time so fp32 copies stay small."""
    e, h, i, r = config.num_experts, config.hidden_size, config.intermediate_size, config.w13_rows
    parts = []
    for s in range(0, e, chunk):
        n = min(chunk, e - s)
        w13 = torch.randn(n, r, h, device=device, dtype=torch.bfloat16) * h**-0.5
        w2 = torch.randn(n, h, i, device=device, dtype=torch.bfloat16) * i**-0.5
        b13 = b2 = None
        if config.has_bias:
            b13 = torch.randn(n, r, device=device, dtype=torch.bfloat16) * 0.1
            b2 = torch.randn(n, h, device=device, dtype=torch.bfloat16) * 0.1
        if scheme.w1 is None:
            parts.append(ExpertWeights.from_float(w13, w2, scheme, b13=b13, b2=b2))
        else:
            calib = torch.randn(64, h, device=device)
            parts.append(ExpertWeights.from_float(w13.float(), w2.float(), scheme, b13=b13, b2=b2, calib_x=calib))
    if len(parts) == 1:
        return parts[0]

    def cat_q(qs: list[QTensor]) -> QTensor:
        def cat(field):
            ts = [getattr(q, field) for q in qs]
            if ts[0] is None:
                return None
            if ts[0].shape[0] != qs[0].shape[0]:  # shared (per-tensor activation) scales
                return ts[0]
            return torch.cat(ts)

        shape = (sum(q.shape[0] for q in qs), *qs[0].shape[1:])
        return QTensor(cat("data"), shape, cat("scale"), cat("zero"), cat("global_scale"), cat("g_idx"))

    def cat_t(name):
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts)

    w = parts[0]
    return ExpertWeights(
        cat_q([p.w13 for p in parts]),
        cat_q([p.w2 for p in parts]),
        cat_t("b13"),
        cat_t("b2"),
        w.a1_scale,
        w.a2_scale,
        w.a1_global_scale,
        w.a2_global_scale,
    )


def _weight_bytes_per_expert(weights: ExpertWeights) -> float:
    return (weights.w13.nbytes + weights.w2.nbytes) / weights.num_experts


def torch_grouped_mm_layer(x, ids, topk_w, w13, w2, config):
    """bf16 layer through torch._grouped_mm with the same glue as ours (sort, act, weighted scatter)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    i = config.intermediate_size
    a = F.silu(h[:, :i]) * h[:, i:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y.float() * topk_w.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, y)
    return out.to(x.dtype)


def run_bench(presets, schemes, tokens, out_dir=None, providers=("fusedmoe", "torch_grouped_mm", "loop")) -> list[Row]:
    from triton.testing import do_bench

    from .dispatch.local import LocalDispatcher
    from .experts.cpu import LoopExperts
    from .kernel import MoEKernel
    from .metadata import TopK
    from .oracle import select_experts
    from .registry import get_experts

    ceil = measure_ceilings()
    bw, fl = ceil["copy_bytes_per_s"] / 1e12, ceil["bf16_flop_per_s"] / 1e12
    print(f"ceilings: copy {bw:.2f} TB/s, bf16 {fl:.0f} TFLOP/s on {ceil['gpu']}")
    rows: list[Row] = []
    for preset in presets:
        config = preset_config(preset)
        for sname in schemes:
            scheme = QuantScheme.by_name(sname)
            weights = bench_weights(config, scheme, "cuda")
            per_expert = _weight_bytes_per_expert(weights)
            backend = select_experts(config, scheme).backend
            kern = MoEKernel(LocalDispatcher(config, scheme), get_experts(backend)(config, scheme))
            loop = MoEKernel(LocalDispatcher(config, scheme), LoopExperts(config, scheme))
            for t in tokens:
                g = torch.Generator(device="cuda").manual_seed(t)
                x = torch.randn(t, config.hidden_size, device="cuda", generator=g).bfloat16()
                ids, w = random_topk(t, config.num_experts, config.top_k, g)
                hit = int(torch.unique(ids).numel())
                nbytes = hit * per_expert + 2 * t * config.hidden_size * 2
                flops = 2 * t * config.top_k * config.hidden_size * (config.w13_rows + config.intermediate_size)
                floor = max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["bf16_flop_per_s"]) * 1e3
                topk = TopK(ids, w)
                fns = {"fusedmoe": partial(kern, x, topk, weights)}
                if sname == "bf16" and config.activation.value == "silu" and hasattr(torch, "_grouped_mm"):
                    w13, w2 = weights.w13.data, weights.w2.data
                    fns["torch_grouped_mm"] = partial(torch_grouped_mm_layer, x, ids, w, w13, w2, config)
                if t <= 64:
                    fns["loop"] = partial(loop, x, topk, weights)
                for name, fn in fns.items():
                    if name not in providers:
                        continue
                    try:
                        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    except Exception as e:  # a provider that cannot run this shape is reported, not hidden
                        print(f"{preset} {sname} T={t} {name}: failed: {e!r}"[:300])
                        continue
                    cmd = f"fusedmoe bench --preset {preset} --scheme {sname} --tokens {t}"
                    row = Row(
                        preset,
                        sname,
                        t,
                        name,
                        ms,
                        floor,
                        100 * floor / ms,
                        nbytes / (ms * 1e-3) / 1e12,
                        flops / (ms * 1e-3) / 1e12,
                        hit,
                        cmd,
                    )
                    rows.append(row)
                    print(
                        f"{preset:14s} {sname:10s} T={t:6d} {name:17s} {ms:9.4f} ms  floor {floor:8.4f} ms  "
                        f"{row.pct_of_floor:5.1f}%  {row.tb_s:5.2f} TB/s {row.tflop_s:6.1f} TFLOP/s",
                        flush=True,
                    )
            del weights
            torch.cuda.empty_cache()
            if out_dir:
                _write(out_dir, rows, ceil)
    return rows


def _write(out_dir: str, rows: list[Row], ceil: dict) -> None:
    """bench.json and bench.md with the rows so far (rewritten after each preset)."""
    import os

    import triton

    os.makedirs(out_dir, exist_ok=True)
    meta = {**ceil, "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(to_markdown(rows, meta))


def to_markdown(rows: list[Row], meta: dict) -> str:
    head = (
        f"# fusedmoe bench on {meta['gpu']} ({meta['date']}; torch {meta['torch']}, triton {meta['triton']})\n\n"
        f"Ceilings measured in the same run: copy {meta['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {meta['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s.\n\n"
        "| preset | scheme | T | provider | ms | floor ms | % of floor | TB/s | TFLOP/s | experts hit |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r.preset} | {r.scheme} | {r.tokens} | {r.provider} | {r.ms:.4f} | {r.floor_ms:.4f} | "
        f"{r.pct_of_floor:.1f} | {r.tb_s:.2f} | {r.tflop_s:.1f} | {r.experts_hit} |\n"
        for r in rows
    )
    return head + body


DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096)
__all__ = ["run_bench", "measure_ceilings", "PRESETS", "DEFAULT_TOKENS"]
