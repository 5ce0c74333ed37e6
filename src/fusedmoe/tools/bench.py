"""``fusedmoe bench``: the whole layer against PyTorch's grouped GEMM and the roofline floor.

Per (preset, scheme, T) cell, in one run on one GPU:

- providers:
  ``fusedmoe``            the oracle's backend through MoEKernel, from logits as the ``FusedMoE``
                          layer runs it (``route_and_run``: routing and experts in one launch plan;
                          ``triton`` and ``grouped_mm`` too);
  ``triton``              our ``triton`` experts backend, whatever the shape rule picks (the
                          other side of the triton/grouped_mm crossover, measured together);
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
  eager, no flush): where the time goes;
- eager figures, for ``fusedmoe`` (host time per call is part of the product): the host time
  per call (``HOST_CALLS`` calls without synchronisation, wall time / calls), the wall time of
  a call followed by a synchronize (median of ``WALL_CALLS``), and that wall time through the
  functional ``fused_moe()``; a measurement that fails is recorded on its row, the run goes on;
- peers: beside each ``fusedmoe`` cell, the best recorded peer time, who, and ours / best,
  with a geometric mean per scheme (``peers``; ``--peers``).

Writes ``bench.md`` (tables, the bar per cell, eager figures and peers, kernel breakdown),
``bench.json`` and ``bench.png`` (% of the floor against T; needs matplotlib) under ``--out``
(``bench_results``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from ..activations import apply_activation
from ..config import Activation, MoEConfig
from ..experts.grouped_mm import FP8_ROWWISE, row_scales
from ..quant import QTensor, QuantScheme
from ..quant.scheme import QDtype, shape_supported
from ..weights import ExpertWeights
from .bench_results import (
    COMPUTE_BAR,
    DECODE_BAR,
    MEMORY_BAR,
    W4_SPEEDUP_BAR,
    Row,
    bar_verdicts,
    plot,
    to_markdown,
    w4a16_speedups,
    write_results,
)
from .peers import PeerTimes, attach_peers, differs_from_peers
from .presets import PRESETS, preset_config, preset_router
from .timing import FlushTimer

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
# eager figures: calls per host-time span, calls per wall-time median (as the peers' eager table)
HOST_CALLS, WALL_CALLS, EAGER_WARMUP = 100, 25, 3
DEFAULT_SCHEMES = ("bf16", "fp8_tensor", "fp8_block")
PROVIDERS = ("fusedmoe", "grouped_mm", "torch_grouped_mm", "loop")
KNOWN_PROVIDERS = (*PROVIDERS, "triton")  # triton on request: it doubles the prefill cells' time


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


def _warm_up(fns: list[Callable[[], object]], warmup: int, sync: Callable[[], object]) -> None:
    for _ in range(warmup):
        for f in fns:
            f()
    sync()


def eager_host_us(
    fns: list[Callable[[], object]], calls: int = HOST_CALLS, warmup: int = EAGER_WARMUP, sync=None,
    clock=time.perf_counter,
) -> float:  # fmt: skip
    """Host time per eager call: ``calls`` calls rotating through ``fns`` (one per input set) with
    no synchronisation between them, wall time / calls; warmed up and synchronised before, the
    queue drained after the span. Where a call's GPU work outlasts its host work the launch queue
    fills and the host waits: the figure then tends to the GPU time per call."""
    sync = sync or torch.cuda.synchronize
    _warm_up(fns, warmup, sync)
    t0 = clock()
    for i in range(calls):
        fns[i % len(fns)]()
    span = clock() - t0
    sync()
    return span / calls * 1e6


def eager_wall_us(
    fns: list[Callable[[], object]], calls: int = WALL_CALLS, warmup: int = EAGER_WARMUP, sync=None,
    clock=time.perf_counter,
) -> float:  # fmt: skip
    """Median wall time of one eager call followed by a synchronize, over ``calls`` calls rotating
    through ``fns`` (the peers' eager figures are taken the same way)."""
    sync = sync or torch.cuda.synchronize
    _warm_up(fns, warmup, sync)
    times = []
    for i in range(calls):
        t0 = clock()
        fns[i % len(fns)]()
        sync()
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


def _measured(row: Row, what: str, fn: Callable[[], float]) -> float | None:
    """``fn()``; on failure None, with the failure on ``row.errors`` (the run goes on)."""
    try:
        return fn()
    except Exception as e:
        row.errors.append(f"{what}: {type(e).__name__}: {e}"[:300])
        print(f"  {row.preset} {row.scheme} T={row.tokens} {what} failed: {e!r}"[:300], flush=True)
        with contextlib.suppress(Exception):  # a failed launch may leave work queued
            torch.cuda.synchronize()
        return None


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

    def cat_t(name):
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts)

    w = parts[0]
    return ExpertWeights(
        QTensor.cat([p.w13 for p in parts]),
        QTensor.cat([p.w2 for p in parts]),
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
        return _KernelLayer(kern, kern.experts.prepare_weights(weights))

    out = {}
    for name in providers:
        try:
            if name == "fusedmoe":
                out[name] = (kernel("auto", max_tokens), True, max_tokens)
            elif name in ("triton", "grouped_mm"):
                out[name] = (kernel(name, max_tokens), True, max_tokens)
            elif name == "torch_grouped_mm":
                out[name] = (TorchGroupedMM(config, scheme, weights), True, max_tokens)
            elif name == "loop":
                out[name] = (kernel("loop", 64), False, 64)
        except (UnsupportedError, NotImplementedError) as e:
            print(f"{config.num_experts}x{scheme.name}: provider {name} not run: {e}"[:300])
    return out


@dataclass(frozen=True)
class _KernelLayer:
    """A built ``MoEKernel`` with its weights: ``(x, topk) -> out``, and ``from_logits`` as the
    ``FusedMoE`` layer runs it (``MoEKernel.route_and_run``: routing and experts in one launch plan)."""

    kernel: object
    weights: object

    def __call__(self, x, topk):
        return self.kernel(x, topk, self.weights)

    def from_logits(self, router, x, logits, bias):
        plain = partial(self._plain, router, x, logits, bias)
        return self.kernel.route_and_run(x, logits, router, bias, self.weights, plain)

    def _plain(self, router, x, logits, bias):
        return self(x, router.route(logits, bias))


def _layer(impl, router, x, logits, bias):
    from_logits = getattr(impl, "from_logits", None)
    if from_logits is not None:
        return from_logits(router, x, logits, bias)
    return impl(x, router.route(logits, bias))


def _fused_moe_layer(config, scheme, weights, router):
    """``(x, logits, bias) -> out`` through ``api.fused_moe`` (backend auto) with the weights as a
    user holds them (reference layout: fused_moe converts them once for its backend and keeps the
    copy), or the reason it cannot run. DeepSeek-V3's cells pass the correction bias, so both
    paths route alike (before the thirteenth session fused_moe took none: its DeepSeek-V3 cells at
    T >= 16 chose other experts and read up to 1.37x the weight bytes of the kernel's)."""
    from ..api import cached_kernel

    try:
        cached_kernel(config, scheme)
    except Exception as e:  # e.g. a backend that needs padded H and I: fused_moe refuses it
        return None, f"fused_moe(): {type(e).__name__}: {e}"[:300]
    return partial(_call_fused_moe, weights, config, scheme, router), None


def _call_fused_moe(weights, config, scheme, router, x, logits, bias):
    from ..api import fused_moe

    return fused_moe(x, logits, weights, config, scheme, router=router, correction_bias=bias)


@dataclass
class _Cell:
    """One (preset, scheme, T): the input sets every provider runs and the floor it is held to."""

    preset: str
    scheme: str
    t: int
    router: object
    sets: list  # [(x, logits, correction bias or None)], rotated between calls
    hit: float  # experts hit, mean over the sets
    floor: float
    bound: str
    nbytes: float
    flops: float

    def calls(self, layer) -> list[Callable[[], object]]:
        """One call of ``layer(x, logits, bias)`` per input set."""
        return [partial(layer, *s) for s in self.sets]

    def row(self, provider: str, mode: str, ms: float) -> Row:
        cmd = f"fusedmoe bench --preset {self.preset} --scheme {self.scheme} --tokens {self.t} --providers {provider}"
        s = ms * 1e-3
        return Row(
            self.preset, self.scheme, self.t, provider, mode, ms, self.floor, 100 * self.floor / ms, self.bound,
            self.nbytes / s / 1e12, self.flops / s / 1e12, self.hit, cmd + (" --eager" if mode == "eager" else ""),
        )  # fmt: skip


@dataclass
class _Bench:
    """One ``run_bench`` call: what every cell shares (ceilings, timer, options) and what went wrong."""

    ceil: dict
    providers: tuple
    graph: bool
    parts: bool
    input_sets: int
    timer: FlushTimer = field(default_factory=FlushTimer)
    failed: list = field(default_factory=list)  # "<pair or cell> [provider]: why" of what failed

    def cell(self, preset, scheme, config, router, biased, t, per_expert, rate) -> _Cell:
        g = torch.Generator(device="cuda").manual_seed(t)
        n_sets = self.input_sets if t <= 4096 else max(1, self.input_sets // 2)
        sets = []
        for _ in range(n_sets):
            x = torch.randn(t, config.hidden_size, device="cuda", generator=g).to(config.dtype)
            logits = torch.randn(t, config.num_experts, device="cuda", generator=g)
            bias = 0.1 * torch.randn(config.num_experts, device="cuda", generator=g) if biased else None
            sets.append((x, logits, bias))
        hit = statistics.mean(int(torch.unique(router.route(s[1], s[2]).ids).numel()) for s in sets)
        floor, bound, nbytes, flops = roofline(config, t, hit, per_expert, rate, self.ceil["copy_bytes_per_s"])
        return _Cell(preset, scheme.name, t, router, sets, hit, floor, bound, nbytes, flops)

    def scheme(self, preset: str, scheme: QuantScheme, tokens) -> list[Row]:
        """Every provider's rows for one (preset, scheme) at each T."""
        config = preset_config(preset)
        router, biased = preset_router(preset)
        weights = bench_weights(config, scheme, "cuda")
        per_expert, rate = _weight_bytes_per_expert(weights), matmul_rate(scheme, self.ceil)
        impls = _implementations(config, scheme, weights, self.providers, max(tokens))
        fm = _fused_moe_layer(config, scheme, weights, router) if "fusedmoe" in impls else (None, None)
        rows: list[Row] = []
        for t in tokens:
            cell = self.cell(preset, scheme, config, router, biased, t, per_expert, rate)
            for name, (impl, capturable, t_max) in impls.items():
                if t <= t_max:
                    rows += self.provider(cell, name, partial(_layer, impl, router), capturable, fm)
            del cell
        del weights, impls, fm
        torch.cuda.empty_cache()
        return rows

    def provider(self, cell: _Cell, name: str, layer, capturable: bool, fm) -> list[Row]:
        """One provider's rows in one cell: its graph (else eager) timing; for ``fusedmoe`` also
        an eager timing at T <= 64, the kernel breakdown and the eager figures."""
        fns = cell.calls(layer)
        modes = [self.graph and capturable]
        if name == "fusedmoe" and self.graph and cell.t <= 64:
            modes.append(False)
        rows = []
        for use_graph in modes:
            try:
                ms, mode = self.timer.median_ms(fns, graph=use_graph)
            except Exception as e:  # a provider that cannot run this shape is reported
                self.failed.append(f"{cell.preset} {cell.scheme} T={cell.t} {name}: {e!r}"[:300])
                print(f"{self.failed[-1]} (failed)")
                continue
            row = cell.row(name, mode, ms)
            if name == "fusedmoe" and mode == "graph" and self.parts:
                row.kernels = _measured(row, "kernel breakdown", partial(kernel_breakdown, fns[0])) or []
                row.launches = sum(c for _, c, _ in row.kernels) if row.kernels else None
            rows.append(row)
            _print_row(row)
        if name == "fusedmoe" and rows:
            _eager_figures(rows[0], fns, *fm, cell)
        return rows


def _eager_figures(row: Row, fns, fm_layer, fm_error: str | None, cell: _Cell) -> None:
    """The eager figures of a ``fusedmoe`` cell on its first row: host time per call, wall time
    per call, and the wall time through ``fused_moe()``; each failure is recorded on the row."""
    row.eager_host_us = _measured(row, "eager host time", partial(eager_host_us, fns))
    row.eager_wall_us = _measured(row, "eager wall time", partial(eager_wall_us, fns))
    if fm_layer is not None:
        row.fused_moe_us = _measured(row, "fused_moe() wall time", partial(eager_wall_us, cell.calls(fm_layer)))
    elif fm_error:
        row.errors.append(fm_error)

    def us(v):
        return "-" if v is None else f"{v:.1f}"

    print(f"{'':47s} eager: host {us(row.eager_host_us)} us, wall {us(row.eager_wall_us)} us, "
          f"fused_moe() {us(row.fused_moe_us)} us", flush=True)  # fmt: skip


def _print_row(row: Row) -> None:
    print(
        f"{row.preset:14s} {row.scheme:11s} T={row.tokens:6d} {row.provider:17s} {row.mode:5s} {row.ms:9.4f} ms  "
        f"floor {row.floor_ms:8.4f} ms ({row.bound})  {row.pct_of_floor:5.1f}%  {row.tb_s:5.2f} TB/s "
        f"{row.tflop_s:6.1f} TFLOP/s" + (f"  {row.launches:.0f} launches" if row.launches else ""),
        flush=True,
    )


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
    peers: PeerTimes | None = None,
) -> list[Row]:
    """Time every provider at every (preset, scheme, T) cell; results under ``out_dir`` after
    each (preset, scheme). ``peers``: recorded peer times to put beside our ``fusedmoe`` cells."""
    unknown = [p for p in providers if p not in KNOWN_PROVIDERS]
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; expected a subset of {list(KNOWN_PROVIDERS)}")
    ceil = measure_ceilings()
    print(
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flop_per_s'] / 1e12:.0f} "
        f"TFLOP/s, fp8 {ceil['fp8_flop_per_s'] / 1e12:.0f} TFLOP/s on {ceil['gpu']}"
    )
    bench = _Bench(ceil, tuple(providers), graph, parts, input_sets)
    rows: list[Row] = []
    not_run: list[str] = []  # (preset, scheme) pairs the scheme cannot store, with the reason
    meta = {**ceil, "not_run": not_run, "failed": bench.failed, "eager_calls": {"host": HOST_CALLS, "wall": WALL_CALLS}}
    meta.update(peers_meta(peers, presets))
    for preset in presets:
        config = preset_config(preset)
        for sname in schemes:
            scheme = QuantScheme.by_name(sname)
            why = shape_supported(scheme, config.hidden_size, config.intermediate_size)
            if why:  # e.g. gpt-oss-20b's H = 2880 is no whole number of int4 groups of 128
                not_run.append(f"{preset} {sname}: {why}")
                print(f"{preset} {sname}: not run: {why}", flush=True)
                continue
            try:
                rows += bench.scheme(preset, scheme, tokens)
            except Exception as e:  # weights or a kernel build (e.g. out of memory): the next pair goes on
                bench.failed.append(f"{preset} {sname}: {type(e).__name__}: {e}"[:300])
                print(f"{bench.failed[-1]} (failed)", flush=True)
                traceback.print_exc()
                torch.cuda.empty_cache()
            attach_peers(rows, peers)
            if out_dir:
                write_results(out_dir, rows, meta)
    if out_dir and (not_run or bench.failed):  # the last pairs may have been the ones not run
        write_results(out_dir, rows, meta)
    return rows


def peers_meta(peers: PeerTimes | None, presets) -> dict:
    """What the results say about the peer times: where they came from, and the presets whose
    bench layer is not the one the peers ran (their ratios compare slightly different layers)."""
    if peers is None:
        return {}
    differs = {}
    for p in presets:
        router, biased = preset_router(p)
        why = differs_from_peers(preset_config(p), router, biased)
        if why:
            differs[p] = why
    return {"peers": {"path": peers.path, **peers.source}, "peer_layer_differs": differs}


__all__ = [
    "run_bench",
    "measure_ceilings",
    "roofline",
    "eager_host_us",
    "eager_wall_us",
    "bar_verdicts",
    "w4a16_speedups",
    "to_markdown",
    "write_results",
    "plot",
    "PRESETS",
    "DEFAULT_TOKENS",
    "DEFAULT_SCHEMES",
    "PROVIDERS",
    "MEMORY_BAR",
    "COMPUTE_BAR",
    "DECODE_BAR",
    "W4_SPEEDUP_BAR",
]
