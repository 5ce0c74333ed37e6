"""``fusedmoe bench``: the whole layer against PyTorch's grouped GEMM and the roofline floor.

Per (preset, scheme, T) cell, in one run on one GPU:

- providers:
  ``fusedmoe``            the oracle's backend through MoEKernel;
  ``grouped_mm``          our ``grouped_mm`` experts backend (where it serves the scheme);
  ``torch_grouped_mm``    PyTorch only: ``torch._grouped_mm`` (bf16) or ``_scaled_grouped_mm``
                          row-wise (fp8: per-token activations x per-channel weights, the same
                          bytes and FLOPs as our fp8 tensor scheme) with the same routing and
                          glue (sort, gather, activation, weighted scatter);
  ``loop``                the per-expert loop (T <= 64);
  every provider times the whole layer: routing from logits, sorting/alignment, both GEMMs,
  the activation and the weighted reduce;
- timing: the median over CUDA-graph replays, one graph per input set, input sets rotated,
  and a 512 MiB write before each replay (outside the timed span) so weights come from HBM,
  not L2. A provider that cannot be captured (host synchronisation) is timed eagerly and
  its row says ``eager``. ``fusedmoe`` is also timed eagerly at T <= 64 (launch overhead
  shown, not hidden);
- the floor: max(bytes / copy bandwidth, FLOPs / matmul rate), bytes = the weights of the
  experts actually hit (mean over the input sets) + activations in and out; the copy
  bandwidth and the bf16 and fp8 matmul rates are measured in the same run; fp8 w8a8 cells
  use the fp8 rate, the rest the bf16 rate;
- parts: for ``fusedmoe``, the kernels one call launches and each one's time (profiler,
  eager, no flush): where the time goes.

Writes ``bench.md`` (tables, the bar per cell, kernel breakdown), ``bench.json`` and
``bench.png`` (% of the floor against T; needs matplotlib) under ``--out``.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from ..activations import apply_activation
from ..config import Activation, MoEConfig
from ..experts.grouped_mm import FP8_ROWWISE, row_scales
from ..quant import QTensor, QuantScheme
from ..quant.scheme import QDtype, shape_supported
from ..weights import ExpertWeights
from .presets import PRESETS, preset_config, preset_router
from .timing import FlushTimer

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
DEFAULT_SCHEMES = ("bf16", "fp8_tensor", "fp8_block")
PROVIDERS = ("fusedmoe", "grouped_mm", "torch_grouped_mm", "loop")
# the bar of the performance issue
MEMORY_BAR, COMPUTE_BAR, DECODE_BAR, W4_SPEEDUP_BAR = 85.0, 75.0, 100 / 1.2, 3.0


@dataclass
class Row:
    preset: str
    scheme: str
    tokens: int
    provider: str
    mode: str  # 'graph' (CUDA-graph replays) or 'eager'
    ms: float
    floor_ms: float
    pct_of_floor: float
    bound: str  # what sets the floor: 'memory' or 'compute'
    tb_s: float
    tflop_s: float
    experts_hit: float
    command: str
    launches: float | None = None
    kernels: list = field(default_factory=list)  # [(name, calls, us)] per call, fusedmoe only


# ---- ceilings and floors -------------------------------------------------------------------


def measure_ceilings(device: str = "cuda") -> dict:
    """Copy bandwidth (bytes read + written) and dense bf16 / fp8 matmul rates, measured now."""
    from triton.testing import do_bench

    n = 1 << 30  # 1 GiB of bf16 = 2 GiB moved per copy
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = do_bench(partial(dst.copy_, src), return_mode="median")
    bw = 2 * src.numel() * 2 / (ms * 1e-3)
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    ms = do_bench(partial(torch.matmul, a, b), return_mode="median")
    flops = {"bf16_flop_per_s": 2 * m**3 / (ms * 1e-3)}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major
        one = torch.ones((), device=device)
        fn = partial(torch._scaled_mm, a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
        flops["fp8_flop_per_s"] = 2 * m**3 / (do_bench(fn, return_mode="median") * 1e-3)
    except (RuntimeError, AttributeError) as e:  # no fp8 tensor cores: fp8 cells use the bf16 rate
        print(f"fp8 matmul rate not measured: {e!r}"[:200])
        flops["fp8_flop_per_s"] = flops["bf16_flop_per_s"]
    return {"copy_bytes_per_s": bw, **flops, "gpu": torch.cuda.get_device_name()}


def matmul_rate(scheme: QuantScheme, ceil: dict) -> float:
    """The dense matmul rate the scheme's dots run at: fp8 for fp8 w8a8, else bf16."""
    fp8 = scheme.a1 is not None and scheme.w1 is not None and scheme.a1.dtype is QDtype.FP8
    return ceil["fp8_flop_per_s"] if fp8 and scheme.w1.dtype is QDtype.FP8 else ceil["bf16_flop_per_s"]


def roofline(config: MoEConfig, t: int, hit: float, bytes_per_expert: float, rate: float, bw: float):
    """(floor ms, bound, bytes, flops) of a layer call of t tokens hitting ``hit`` experts."""
    elt = torch.tensor([], dtype=config.dtype).element_size()
    nbytes = hit * bytes_per_expert + 2 * t * config.hidden_size * elt
    flops = 2 * t * config.top_k * config.hidden_size * (config.w13_rows + config.intermediate_size)
    mem, comp = nbytes / bw, flops / rate
    return max(mem, comp) * 1e3, ("memory" if mem >= comp else "compute"), nbytes, flops


# ---- timing --------------------------------------------------------------------------------


def kernel_breakdown(fn: Callable[[], object], iters: int = 5) -> list[tuple[str, float, float]]:
    """[(kernel name, calls per call, us per call)] of ``fn``, slowest first (profiler, eager)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        if ev.device_type != DeviceType.CUDA:
            continue
        us = getattr(ev, "device_time_total", None)
        us = ev.cuda_time_total if us is None else us
        if us <= 0:
            continue
        out.append((ev.key[:70], ev.count / iters, us / iters))
    return sorted(out, key=lambda r: -r[2])


# ---- weights and providers -----------------------------------------------------------------


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
        def cat(name):
            ts = [getattr(q, name) for q in qs]
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


def _rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic fp8 e4m3 in PyTorch: (codes, fp32 scales [rows])."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (x.float() / s).to(torch.float8_e4m3fn), s.squeeze(1)


class TorchGroupedMM:
    """The layer in PyTorch ops around ``torch._grouped_mm`` / ``torch._scaled_grouped_mm``."""

    def __init__(self, config: MoEConfig, scheme: QuantScheme, weights: ExpertWeights) -> None:
        self.config = config
        self.fp8 = scheme.w1 is not None
        if self.fp8:
            # the schemes PyTorch's row-wise fp8 grouped GEMM serves, as our grouped_mm backend
            if scheme.name not in FP8_ROWWISE or not hasattr(torch, "_scaled_grouped_mm"):
                raise NotImplementedError(f"PyTorch has no grouped GEMM for {scheme.name}")
            self.s13, self.s2 = row_scales(weights.w13, scheme.w1), row_scales(weights.w2, scheme.w2)
        elif not hasattr(torch, "_grouped_mm"):
            raise NotImplementedError("this PyTorch has no torch._grouped_mm")
        self.w13 = weights.w13.data.transpose(1, 2)  # [E, H, 2I], column-major as the op wants
        self.w2 = weights.w2.data.transpose(1, 2)
        self.b13, self.b2 = weights.b13, weights.b2
        self.experts = torch.arange(config.num_experts, dtype=torch.int32, device=self.w13.device)

    def _mm(self, a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, offs) -> torch.Tensor:
        if not self.fp8:
            return torch._grouped_mm(a, w, offs=offs)
        q, sa = _rowwise_fp8(a)
        return torch._scaled_grouped_mm(q, w, sa, scale, offs=offs, out_dtype=self.config.dtype, use_fast_accum=True)

    def __call__(self, x: torch.Tensor, topk) -> torch.Tensor:
        c = self.config
        t, k = topk.ids.shape
        sorted_ids, order = torch.sort(topk.ids.reshape(-1), stable=True)
        offs = torch.searchsorted(sorted_ids, self.experts, right=True).to(torch.int32)
        tok = order // k
        h = self._mm(x[tok], self.w13, getattr(self, "s13", None), offs)
        if self.b13 is not None:
            h = h + self.b13[sorted_ids.long()]
        if c.activation is Activation.SILU and not c.gate_up_interleaved:
            i = c.intermediate_size
            a = F.silu(h[:, :i]) * h[:, i:]
        else:
            a = apply_activation(h.float(), c).to(c.dtype)
        y = self._mm(a, self.w2, getattr(self, "s2", None), offs)
        if self.b2 is not None:
            y = y + self.b2[sorted_ids.long()]
        y = y.float() * topk.weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(t, c.hidden_size, dtype=torch.float32, device=x.device)
        return out.index_add_(0, tok, y).to(x.dtype)


def _implementations(config, scheme, weights, providers, max_tokens):
    """{provider: (impl(x, topk) -> out, graph-capturable, largest T)}; refusals printed."""
    from ..errors import UnsupportedError
    from ..oracle.build import build_kernel

    def kernel(backend: str, max_t: int):
        kern = build_kernel(config, scheme, backend=backend, num_tokens=max_tokens)
        if max_t == max_tokens:
            kern.allocate(max_tokens, "cuda")  # workspace up front: what CUDA-graph capture needs
        return partial(_call_kernel, kern, kern.experts.prepare_weights(weights))

    out = {}
    for name in providers:
        try:
            if name == "fusedmoe":
                out[name] = (kernel("auto", max_tokens), True, max_tokens)
            elif name == "grouped_mm":
                out[name] = (kernel("grouped_mm", max_tokens), True, max_tokens)
            elif name == "torch_grouped_mm":
                out[name] = (TorchGroupedMM(config, scheme, weights), True, max_tokens)
            elif name == "loop":
                out[name] = (kernel("loop", 64), False, 64)
        except (UnsupportedError, NotImplementedError) as e:
            print(f"{config.num_experts}x{scheme.name}: provider {name} not run: {e}"[:300])
    return out


def _call_kernel(kern, weights, x, topk):
    return kern(x, topk, weights)


def _layer(impl, router, x, logits, bias):
    return impl(x, router.route(logits, bias))


def run_bench(
    presets,
    schemes,
    tokens,
    out_dir=None,
    providers=PROVIDERS,
    *,
    graph: bool = True,
    parts: bool = True,
    input_sets: int = 4,
) -> list[Row]:
    ceil = measure_ceilings()
    bw = ceil["copy_bytes_per_s"]
    print(
        f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s, "
        f"fp8 {ceil['fp8_flop_per_s'] / 1e12:.0f} TFLOP/s on {ceil['gpu']}"
    )
    timer = FlushTimer()
    rows: list[Row] = []
    not_run: list[str] = []  # (preset, scheme) pairs the scheme cannot store, with the reason
    for preset in presets:
        config = preset_config(preset)
        router, biased = preset_router(preset)
        for sname in schemes:
            scheme = QuantScheme.by_name(sname)
            why = shape_supported(scheme, config.hidden_size, config.intermediate_size)
            if why:  # e.g. gpt-oss-20b's H = 2880 is no whole number of int4 groups of 128
                not_run.append(f"{preset} {sname}: {why}")
                print(f"{preset} {sname}: not run: {why}", flush=True)
                continue
            weights = bench_weights(config, scheme, "cuda")
            per_expert, rate = _weight_bytes_per_expert(weights), matmul_rate(scheme, ceil)
            impls = _implementations(config, scheme, weights, providers, max(tokens))
            for t in tokens:
                g = torch.Generator(device="cuda").manual_seed(t)
                n_sets = input_sets if t <= 4096 else max(1, input_sets // 2)
                sets = []
                for _ in range(n_sets):
                    x = torch.randn(t, config.hidden_size, device="cuda", generator=g).to(config.dtype)
                    logits = torch.randn(t, config.num_experts, device="cuda", generator=g)
                    bias = 0.1 * torch.randn(config.num_experts, device="cuda", generator=g) if biased else None
                    sets.append((x, logits, bias))
                hit = statistics.mean(int(torch.unique(router.route(s[1], s[2]).ids).numel()) for s in sets)
                floor, bound, nbytes, flops = roofline(config, t, hit, per_expert, rate, bw)
                for name, (impl, capturable, t_max) in impls.items():
                    if t > t_max:
                        continue
                    fns = [partial(_layer, impl, router, *s) for s in sets]
                    modes = [graph and capturable]
                    if name == "fusedmoe" and graph and t <= 64:
                        modes.append(False)
                    for use_graph in modes:
                        try:
                            ms, mode = timer.median_ms(fns, graph=use_graph)
                        except Exception as e:  # a provider that cannot run this shape is reported
                            print(f"{preset} {sname} T={t} {name}: failed: {e!r}"[:300])
                            continue
                        cmd = f"fusedmoe bench --preset {preset} --scheme {sname} --tokens {t} --providers {name}"
                        row = Row(
                            preset,
                            sname,
                            t,
                            name,
                            mode,
                            ms,
                            floor,
                            100 * floor / ms,
                            bound,
                            nbytes / (ms * 1e-3) / 1e12,
                            flops / (ms * 1e-3) / 1e12,
                            hit,
                            cmd + (" --eager" if mode == "eager" else ""),
                        )
                        if name == "fusedmoe" and mode == "graph" and parts:
                            row.kernels = kernel_breakdown(fns[0])
                            row.launches = sum(c for _, c, _ in row.kernels)
                        rows.append(row)
                        print(
                            f"{preset:14s} {sname:11s} T={t:6d} {name:17s} {mode:5s} {ms:9.4f} ms  "
                            f"floor {floor:8.4f} ms ({bound})  {row.pct_of_floor:5.1f}%  {row.tb_s:5.2f} TB/s "
                            f"{row.tflop_s:6.1f} TFLOP/s" + (f"  {row.launches:.0f} launches" if row.launches else ""),
                            flush=True,
                        )
                del sets
            del weights, impls
            torch.cuda.empty_cache()
            if out_dir:
                write_results(out_dir, rows, {**ceil, "not_run": not_run})
    if out_dir and not_run:  # the last pairs may have been the ones not run
        write_results(out_dir, rows, {**ceil, "not_run": not_run})
    return rows


# ---- results -------------------------------------------------------------------------------


def write_results(out_dir: str, rows: list[Row], ceil: dict) -> None:
    """bench.json, bench.md and bench.png with the rows so far (rewritten after each scheme)."""
    import os

    import triton

    os.makedirs(out_dir, exist_ok=True)
    meta = {**ceil, "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(to_markdown(rows, meta))
    plot(rows, meta, os.path.join(out_dir, "bench.png"))


def bar_verdicts(rows: list[Row]) -> list[dict]:
    """The performance bar per (preset, scheme, T) cell of ``fusedmoe`` (graph timing)."""
    by_cell: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.mode == "graph" or r.provider not in by_cell.get((r.preset, r.scheme, r.tokens), {}):
            by_cell.setdefault((r.preset, r.scheme, r.tokens), {})[r.provider] = r
    out = []
    for (preset, scheme, t), cell in by_cell.items():
        ours = cell.get("fusedmoe")
        if ours is None or ours.mode != "graph":
            continue
        need = DECODE_BAR if t == 1 else (MEMORY_BAR if ours.bound == "memory" else COMPUTE_BAR)
        torch_row = cell.get("torch_grouped_mm")
        misses = []
        if ours.pct_of_floor < need:
            misses.append(f"{ours.pct_of_floor:.0f}% of floor < {need:.0f}%")
        if torch_row is not None and torch_row.ms <= ours.ms:
            misses.append(f"torch {torch_row.ms:.4f} ms <= ours")
        out.append(
            dict(
                preset=preset,
                scheme=scheme,
                tokens=t,
                ms=ours.ms,
                pct=ours.pct_of_floor,
                need=need,
                torch_ms=None if torch_row is None else torch_row.ms,
                misses=misses,
            )
        )
    return out


def w4a16_speedups(rows: list[Row], schemes=("int4_g128", "mxfp4")) -> list[dict]:
    """Our bf16 layer's time over our w4a16 layer's at T = 1, per preset (bar: >= 3x)."""
    ours = {(r.preset, r.scheme, r.tokens): r.ms for r in rows if r.provider == "fusedmoe" and r.mode == "graph"}
    out = []
    for (preset, scheme, t), ms in sorted(ours.items()):
        if t == 1 and scheme in schemes and (preset, "bf16", 1) in ours:
            out.append(
                dict(
                    preset=preset,
                    scheme=scheme,
                    bf16_ms=ours[(preset, "bf16", 1)],
                    ms=ms,
                    speedup=ours[(preset, "bf16", 1)] / ms,
                )
            )
    return out


def to_markdown(rows: list[Row], meta: dict) -> str:
    lines = [
        f"# fusedmoe bench on {meta['gpu']} ({meta['date']}; torch {meta['torch']}, triton {meta['triton']})",
        "",
        f"Ceilings measured in the same run: copy {meta['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {meta['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s, "
        f"fp8 matmul {meta.get('fp8_flop_per_s', 0) / 1e12:.0f} TFLOP/s. Times: median of CUDA-graph "
        "replays (mode graph) or eager calls, inputs rotated, L2 flushed before each; the whole layer "
        "from router logits.",
        "",
        "| preset | scheme | T | provider | mode | ms | floor ms | bound | % of floor | TB/s | TFLOP/s "
        "| experts hit | launches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if meta.get("not_run"):
        lines[-3:-3] = ["Not run (the scheme cannot store the preset's weights): " + "; ".join(meta["not_run"]), ""]
    for r in rows:
        launches = "" if r.launches is None else f"{r.launches:.0f}"
        lines.append(
            f"| {r.preset} | {r.scheme} | {r.tokens} | {r.provider} | {r.mode} | {r.ms:.4f} | {r.floor_ms:.4f} "
            f"| {r.bound} | {r.pct_of_floor:.1f} | {r.tb_s:.2f} | {r.tflop_s:.1f} | {r.experts_hit:g} | {launches} |"
        )
    verdicts = bar_verdicts(rows)
    if verdicts:
        lines += [
            "",
            "## The bar (fusedmoe, graph timing)",
            "",
            f">= {MEMORY_BAR:.0f}% of a memory floor, >= {COMPUTE_BAR:.0f}% of a compute floor, T = 1 within "
            "1.2x of the floor, faster than torch grouped GEMM.",
            "",
            "| preset | scheme | T | ms | % of floor | needed | torch ms | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in verdicts:
            tms = "" if v["torch_ms"] is None else f"{v['torch_ms']:.4f}"
            verdict = "meets" if not v["misses"] else "misses: " + "; ".join(v["misses"])
            lines.append(
                f"| {v['preset']} | {v['scheme']} | {v['tokens']} | {v['ms']:.4f} | {v['pct']:.1f} "
                f"| {v['need']:.0f} | {tms} | {verdict} |"
            )
    speed = w4a16_speedups(rows)
    if speed:
        lines += [
            "",
            "## w4a16 at T = 1 against our bf16 (bar: >= 3x)",
            "",
            "| preset | scheme | bf16 ms | ms | speedup |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {s['preset']} | {s['scheme']} | {s['bf16_ms']:.4f} | {s['ms']:.4f} | {s['speedup']:.2f}x |"
            for s in speed
        ]
    parts = [r for r in rows if r.kernels]
    if parts:
        lines += ["", "## Where the time goes (fusedmoe: kernels per call, profiler, eager, no flush)", ""]
        for r in parts:
            ks = "; ".join(f"{name} x{calls:g} {us:.1f} us" for name, calls, us in r.kernels[:10])
            lines.append(f"- {r.preset} {r.scheme} T={r.tokens}: {r.launches:.0f} launches: {ks}")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], meta: dict, path: str) -> bool:
    """% of the floor against T: a panel per (scheme, preset), a colour per provider, dashed =
    eager. False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install fusedmoe[bench])")
        return False
    presets = list(dict.fromkeys(r.preset for r in rows))
    schemes = list(dict.fromkeys(r.scheme for r in rows))
    if not presets:
        return False
    colours = {p: f"C{i}" for i, p in enumerate(PROVIDERS)}
    fig, axes = plt.subplots(
        len(schemes), len(presets), figsize=(4 * len(presets), 3 * len(schemes)), squeeze=False, sharey=True
    )
    for (si, scheme), (pi, preset) in itertools.product(enumerate(schemes), enumerate(presets)):
        ax = axes[si][pi]
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if r.preset == preset and r.scheme == scheme:
                series.setdefault((r.provider, r.mode), []).append((r.tokens, r.pct_of_floor))
        for (provider, mode), pts in series.items():
            pts.sort()
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                ms=3,
                color=colours.get(provider, "k"),
                ls="--" if mode == "eager" else "-",
                label=f"{provider} ({mode})",
            )
        ax.set_xscale("log", base=2)
        ax.axhline(MEMORY_BAR, color="gray", lw=0.8, ls=":")
        ax.set_title(f"{preset} {scheme}", fontsize=9)
        ax.grid(alpha=0.3)
        if si == len(schemes) - 1:
            ax.set_xlabel("tokens")
        if pi == 0:
            ax.set_ylabel("% of roofline floor")
        if ax.lines:
            ax.legend(fontsize=6, loc="best")
    fig.suptitle(f"fusedmoe bench, {meta['gpu']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


__all__ = [
    "run_bench",
    "measure_ceilings",
    "roofline",
    "bar_verdicts",
    "to_markdown",
    "plot",
    "PRESETS",
    "DEFAULT_TOKENS",
    "DEFAULT_SCHEMES",
    "PROVIDERS",
]
