"""The operands of one tuning step, and the tuner's one ``grouped_gemm`` call.

A step is one GEMM of a (preset, scheme) layer at T tokens (W13: N = 2I, K = H; W2: N = H,
K = I), launched as the layer launches it: bias, router weights on GEMM2, into a preallocated
output. The main process builds the layer's full-size operands (``step_operands``); a compile
worker builds operands with the same Triton specialisation from two experts' weights
(``worker_operands``; why that suffices: ``probe``).

4-bit weights that the triton experts run in the w4 layout (int4, MXFP4, NVFP4 with float
activations) are converted as the experts convert them (``prepare_weights``), and their steps
are the w4 kernel's launches as the layer makes them: GEMM1 with the fused activation (its
config's BN halved for a gated one; the table keeps the unhalved config, as ``w4_launch_config``
returns it), GEMM2 under split-K writing fp32 partials that the layer's ``moe_sum`` adds up
(no reduce launch), and GEMM2's BM free (the layer aligns twice when the BMs differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ...experts.triton import TritonExperts
from ...kernels.align import moe_align, moe_align_ref, pair_blocks
from ...kernels.gemm_format import ActEpilogue, GemmCall, GemmFormat, scheme_key
from ...kernels.grouped_gemm import grouped_gemm
from ...kernels.grouped_gemm_w4 import default_w4_config, fit_w4_config, w4_gemm_launch, w4_scheme_key
from ...kernels.launch_config import LaunchConfig, default_launch_config, fit_launch_config, gated_act_config
from ...quant import Operand, QuantScheme, quantize
from ...quant.scheme import shape_supported
from ...quant.w4_layout import is_w4
from ...weights import ExpertWeights
from ..bench import bench_weights
from ..presets import preset_config


@dataclass(frozen=True)
class Combo:
    """One (preset, scheme) to tune; picklable, so a worker process rebuilds its operands."""

    preset: str
    scheme: str
    overrides: tuple[tuple[str, object], ...] = ()

    def config(self):
        return preset_config(self.preset, **dict(self.overrides))

    @property
    def name(self) -> str:
        return f"{self.preset} {self.scheme}"


def storable(combos: list[Combo]) -> tuple[list[Combo], list[str]]:
    """(combos whose scheme can store the preset's weights, "<combo>: why not" for the others),
    e.g. gpt-oss-20b's H = I = 2880 is no whole number of int4 groups of 128. A typo in a preset
    or scheme name fails here, before any work."""
    kept, refused = [], []
    for c in combos:
        config = c.config()
        why = shape_supported(QuantScheme.by_name(c.scheme), config.hidden_size, config.intermediate_size)
        if why:
            refused.append(f"{c.name}: {why}")
        else:
            kept.append(c)
    return kept, refused


@dataclass
class StepOperands:
    """One GEMM of the layer at T tokens: A (quantized as the scheme says), W, bias, router
    weights (GEMM2), the output buffer, the (token, expert) ids and their alignment per BM."""

    gemm: str
    e: int  # experts the pairs are aligned over (the layer's E_l)
    n: int
    kd: int
    key: str  # scheme_key: the tuned-config folder
    fmt: GemmFormat
    a: Operand
    w: Operand
    bias: torch.Tensor | None
    topk_weights: torch.Tensor | None
    a_div: int
    ids: torch.Tensor
    out: torch.Tensor
    ref_align: bool = False  # workers: moe_align_ref (no align kernels to compile, same shapes)
    routes: dict = field(default_factory=dict)
    act: ActEpilogue | None = None  # w4 GEMM1: the layer's fused activation (module docstring)

    @property
    def w4(self) -> bool:
        """The w4 kernel runs this GEMM (4-bit weights in the w4 layout)."""
        return is_w4(self.w.q)

    @property
    def gated(self) -> bool:
        return self.act is not None and self.act.activation.is_gated

    @property
    def operand_bytes(self) -> int:
        """The wider of A's and W's stored elements (what a pipeline stage holds per value)."""
        return max(self.a.q.data.element_size(), self.w.q.data.element_size())

    @property
    def pairs(self) -> int:
        return self.ids.numel()

    def routing(self, bm: int):
        """The pairs' blocks as the layer makes them: one block per pair where it does
        (``TritonExperts.pair_blocked``), else aligned by expert."""
        if bm not in self.routes:
            t, k = self.ids.shape
            if TritonExperts.pair_blocked(t, k, self.e):
                self.routes[bm] = pair_blocks(self.ids, bm)
            else:  # the reference is bit-identical, and quick on a CPU
                align = moe_align_ref if self.ref_align or self.ids.device.type == "cpu" else moe_align
                self.routes[bm] = align(self.ids, self.e, bm)
        return self.routes[bm]

    def fit(self, cfg: LaunchConfig) -> LaunchConfig:
        """The config as the launcher runs it (BK divides a w8a8 scale group; the w4 kernel's
        ``fit_w4_config``)."""
        if self.w4:
            return fit_w4_config(cfg, self.w.q)
        return fit_launch_config(cfg, self.fmt.k_group, strict=self.fmt.native)

    def heuristic(self) -> LaunchConfig:
        if self.w4:
            return self.fit(default_w4_config(self.pairs, self.e, self.n, self.kd, self.gated, self.w.q.w_fmt))
        return self.fit(default_launch_config(self.pairs, self.e, self.n, self.kd, self.key))

    def value(self, out: torch.Tensor) -> torch.Tensor:
        """The GEMM's result from what ``launch`` returned: split-K partials [S, rows, N] summed."""
        return out.sum(0) if out.dim() == 3 else out


def launch(op: StepOperands, cfg: LaunchConfig, routing) -> torch.Tensor:
    """The tuner's only GEMM call (workers, planning, checks and timings all come here): the GEMM
    as the layer launches it (``experts.triton``); w4 GEMM2 under split-K returns its partials."""
    if op.act is not None:
        lc = gated_act_config(cfg) if op.gated else cfg
        return grouped_gemm(op.a, op.w, routing, bias=op.bias, a_div=op.a_div, out=op.out, config=lc, act=op.act)
    if op.w4 and cfg.split_k > 1:
        call = GemmCall(routing, a_div=op.a_div, bias=op.bias, route_weights=op.topk_weights)
        p = w4_gemm_launch(op.a, op.w, op.out, op.fmt, cfg, call, reduce=False)
        return op.out if p is None else p
    return grouped_gemm(
        op.a, op.w, routing, bias=op.bias, topk_weights=op.topk_weights, a_div=op.a_div, out=op.out, config=cfg
    )


def layer_weights(config, scheme, device) -> ExpertWeights:
    """Random weights of the layer (the benchmark's on a GPU, small fp32-drawn ones on a CPU), in
    the layout the triton experts run them (``prepare_weights``: 4-bit ones in the w4 layout)."""
    return TritonExperts(config, scheme).prepare_weights(_random_weights(config, scheme, device))


def _random_weights(config, scheme, device) -> ExpertWeights:
    if device == "cuda":
        return bench_weights(config, scheme, device)
    g = torch.Generator().manual_seed(0)
    e, r, h, i = config.num_experts, config.w13_rows, config.hidden_size, config.intermediate_size
    w13, w2 = torch.randn(e, r, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05
    b13 = torch.randn(e, r, generator=g).to(config.dtype) if config.has_bias else None
    b2 = torch.randn(e, h, generator=g).to(config.dtype) if config.has_bias else None
    if scheme.w1 is None:
        w13, w2 = w13.to(config.dtype), w2.to(config.dtype)
    return ExpertWeights.from_float(w13, w2, scheme, b13=b13, b2=b2)


def step_operands(config, scheme, weights, gemm: str, t: int, device, ids, route_w) -> StepOperands:
    """GEMM ``gemm`` ('w13' or 'w2') of the layer at ``t`` tokens routed to ``ids``."""
    g = torch.Generator(device=device).manual_seed(t)
    k = config.top_k
    if gemm == "w13":
        rows, kd, a_div, rw = t, config.hidden_size, k, None
        aq_t, wq_t, w, bias = scheme.a1, scheme.w1, weights.w13, weights.b13
    else:
        rows, kd, a_div = t * k, config.intermediate_size, 1
        aq_t, wq_t, w, bias = scheme.a2, scheme.w2, weights.w2, weights.b2
        rw = None if config.apply_router_weight_on_input else route_w
    a = torch.randn(rows, kd, generator=g, device=device).to(config.dtype)
    aq = quantize(a, aq_t) if aq_t is not None else None
    n, w4 = w.shape[1], is_w4(w)
    act = TritonExperts(config, scheme).act_epilogue() if w4 and gemm == "w13" else None
    return StepOperands(
        gemm=gemm,
        e=config.num_experts,
        n=n,
        kd=kd,
        key=w4_scheme_key(w) if w4 else scheme_key(wq_t, aq_t),
        fmt=GemmFormat.of(wq_t, aq_t, n, kd, w.zero is not None),
        a=Operand.of(a if aq is None else aq, aq_t),
        w=Operand(w, wq_t),
        bias=bias,
        topk_weights=rw,
        a_div=a_div,
        ids=ids,
        out=torch.empty(t * k, n if act is None else act.out_cols(n), dtype=config.dtype, device=device),
        act=act,
    )


_WORKER_CACHE: dict = {}  # one combo's small weights and one step's operands per process


def worker_operands(combo: Combo, gemm: str, t: int, device: str) -> StepOperands:
    """Operands with the main process's specialisation and min(E, 2) experts' weights."""
    c = _WORKER_CACHE
    if c.get("combo") != combo:
        c.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
        config, scheme = combo.config(), QuantScheme.by_name(combo.scheme)
        e_w = min(config.num_experts, 2)
        small = layer_weights(config.replace(num_experts=e_w, top_k=min(config.top_k, e_w)), scheme, device)
        c.update(combo=combo, config=config, scheme=scheme, e_w=e_w, weights=small)
    if c.get("step") != (gemm, t):
        c.pop("ops", None)
        k = c["config"].top_k
        ids = (torch.arange(t * k, device=device, dtype=torch.int32) % c["e_w"]).view(t, k)
        rw = torch.ones(t, k, device=device)
        ops = step_operands(c["config"], c["scheme"], c["weights"], gemm, t, device, ids, rw)
        c.update(step=(gemm, t), ops=replace(ops, ref_align=True))
    return c["ops"]
