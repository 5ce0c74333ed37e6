"""``cpu``: PyTorch on the CPU in the model dtype, grouped per expert.

The (token, k) pairs are sorted by expert once; each expert that received
tokens runs two dense GEMMs on a contiguous slice of rows, with its weights
dequantized on the fly (one expert at a time, so the float copy of all the
weights never exists). Each GEMM writes its rows of one buffer and the
activation (and a2's quantization) runs once over all rows, so an expert
costs its two GEMMs and a few views. Compared with the per-expert loop that
most model code ships (a boolean mask and a gather per expert, every expert
visited), it visits only the experts hit, gathers once and scatters once.

A single token (decode, T = 1) skips the sort, the gather and the scatter:
its K pairs run in k order, one row each, and the weighted sum over K is one
[1, K] x [K, H] fp32 GEMM (not in deterministic mode: see below).

Numerics: GEMMs in the model dtype (bf16 on CPU accumulates in fp32), the
weighted sum over K in fp32, one rounding to the model dtype at the end. On a
CPU without bf16/fp16 matrix instructions (``platform.cpu_has_half_gemm``),
PyTorch's half GEMM converts W again for every row (~270 us a row for [M, 512]
x [512, 3584] on a 2-core AVX2 EPYC, linear in M). There a GEMM of enough rows
(``upcast``, 8 or 16 by W's size) converts W to fp32 once and runs oneDNN's fp32 GEMM
(``mkldnn::_linear_pointwise``; MKL's ``mm`` where the build lacks it), then
rounds its output to the model dtype: the same products (a half times a half
is exact in fp32), sums in fp32 as the half GEMM's, one rounding, so the
results differ only in the order of the fp32 sums. Measured with each call on
another expert's weights (8 experts, so W comes from memory as in a layer; 2
threads, 2026-11-28), us at M = 1 / 4 / 8 / 16 rows, half GEMM vs converted:
[M, 512] x [512, 3584] 342 / 1,055 / 2,035 / 4,073 vs 552 / 841 / 929 / 1,522;
[M, 1792] x [1792, 512] 151 / 473 / 886 / 1,740 vs 336 / 470 / 583 / 724;
[M, 512] x [512, 384] 43 / 129 / 242 / 461 vs 133 / 199 / 196 / 259. MKL's fp32
``mm`` after the same conversion: 686 / 1,080 / 1,257 / 4,984 on the first.
Keeping an fp32 copy of the weights instead was measured slower where experts
get 1-16 rows (the GEMMs read W from memory at ~10 GB/s there, and fp32 doubles
its bytes: Mixtral sibling T = 1 1,510 -> 2,839 us, T = 16 13,889 -> 18,631),
so the weights stay in the model dtype.

Deterministic mode (``deterministic``; ``FUSEDMOE_DETERMINISTIC=1`` when built): every
GEMM runs over fixed tiles of 16 rows (``reference.batch_invariant_mm``), the last one
zero-padded, so a token's output
does not depend on how many other rows its expert got. fp32 GEMMs are MKL sgemm,
whose result for a row changes with the number of rows in the call (1 row vs 2+: 5e-7
relative); with every call 16 rows, each row meets the same kernel. bf16/fp16 (oneDNN)
were batch-invariant already; they are tiled too, so the guarantee does not rest on
that. The sum over K is in expert order whatever the batch (``index_add_`` of the
expert-sorted pairs); the T = 1 path, whose sum is in k order, is off.
"""

from __future__ import annotations

from functools import cache
from itertools import accumulate

import torch

from .. import env
from ..activations import apply_activation
from ..contract import TokenLayout
from ..metadata import local_expert_ids
from ..platform import cpu_has_half_gemm
from ..quant import dequantize, fake_quantize
from ..weights import expert_matrix
from .base import ALL_SCHEMES, Capabilities, Experts
from .reference import batch_invariant_mm

# rows from which a half-precision GEMM runs in fp32 on CPUs without half GEMMs, by the size of
# W (values): through the layer (interleaved medians, 2 threads), Mixtral sibling T = 64 (~8 rows
# an expert, W 0.9-1.8 M values) 50,555 -> 25,485 us from 8 rows on, but the Qwen3 sibling at T =
# 64 (W 0.1-0.2 M values) 38,904 -> 44,535 with 8 and 36,876 with 16; at 4 rows the layer lost
# (Mixtral sibling T = 16, ~4 rows an expert: 14,043 -> 15,414)
UPCAST_ROWS = ((1 << 19, 8), (0, 16))  # (W values at least, rows from): the first that W reaches
_UPCAST_FEWEST = min(r for _, r in UPCAST_ROWS)


def upcast(rows: int, w_t: torch.Tensor) -> bool:
    """Whether a half GEMM of ``rows`` rows on weights ``w_t`` runs in fp32 (module docstring).
    Most GEMMs of a decode call have fewer rows than any bar: that test first, ~0.1 us."""
    if rows < _UPCAST_FEWEST or rows < next(r for size, r in UPCAST_ROWS if w_t.numel() >= size):
        return False
    half = w_t.dtype in (torch.bfloat16, torch.float16)
    return half and w_t.device.type == "cpu" and not cpu_has_half_gemm()


@cache
def _dnn_linear():
    """oneDNN's linear (x @ W.T for W [N, K]) where this PyTorch build has it, else None."""
    try:
        return torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


def sgemm(a: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ w_t [K, N] in fp32 (both converted), by oneDNN where it is there: 1.3-3.3x
    MKL's ``mm`` at 1-16 rows (module docstring)."""
    dnn = _dnn_linear()
    if dnn is None or a.shape[0] == 0:
        return a.float() @ w_t.float()
    return dnn(a.float(), w_t.T.float().contiguous(), None, "none", [], "")


class CpuExperts(Experts):
    name = "cpu"
    layout = TokenLayout.STANDARD
    capabilities = Capabilities(
        layouts=frozenset({TokenLayout.STANDARD}),
        schemes=ALL_SCHEMES,
        platforms=frozenset({"cpu"}),
        note="PyTorch grouped per expert in the model dtype; weights dequantized per expert",
        seed_names=("cpu_fused_moe",),
    )
    # batch-invariant GEMMs (see the module docstring); MoEKernel(deterministic=...) sets it too
    deterministic: bool = False

    def __init__(self, config, scheme) -> None:
        super().__init__(config, scheme)
        self.deterministic = env.deterministic()

    def _mm(self, a: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """a @ w_t, written into ``out`` (rows of a model-dtype buffer) when given."""
        if self.deterministic:
            return batch_invariant_mm(a, w_t) if out is None else out.copy_(batch_invariant_mm(a, w_t))
        # the CPU's own GEMM only: the loop baseline (a subclass) also runs on GPUs
        if upcast(a.shape[0], w_t):
            y = sgemm(a, w_t)
            return y.to(a.dtype) if out is None else out.copy_(y)
        return torch.mm(a, w_t, out=out)

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        t, k = topk.ids.shape
        if t == 0:
            return
        dt = self.config.dtype
        x = a.data.to(dt) if self.scheme.a1 is None else dequantize(a, self.scheme.a1, dt)
        local = local_expert_ids(topk.ids.reshape(-1), expert_map, weights.num_experts)
        if t == 1 and not self.deterministic:
            self._one_token(x, local.tolist(), topk.weights, weights, out)
        else:
            self._grouped(x, local, k, topk.weights, weights, out)

    def _grouped(self, x, local, k, router_w, weights, out) -> None:
        """The (token, k) pairs sorted by expert: one gather, a slice of rows per expert hit, one scatter."""
        acc = torch.zeros(x.shape[0], self.config.hidden_size, dtype=torch.float32)
        # the pairs that contribute nothing (-1) sort first; bin 0 counts them
        expert, order = torch.sort(local, stable=True)
        skip, *counts = torch.bincount(expert + 1, minlength=weights.num_experts + 1).tolist()
        if skip < order.numel():
            order = order[skip:]
            spans = [(e, end - c, end) for e, (c, end) in enumerate(zip(counts, accumulate(counts), strict=True)) if c]
            tok = order // k
            y = self._ffn(x[tok], spans, weights).float()
            if not self.config.apply_router_weight_on_input:
                y *= router_w.reshape(-1)[order].float().unsqueeze(1)
            acc.index_add_(0, tok, y)
        out.copy_(acc)

    def _one_token(self, x, local: list[int], router_w, weights, out) -> None:
        """T = 1 (decode): the token's pairs in k order, one row each; no sort, gather or scatter.
        The weighted sum over K is one [1, K] x [K, H] fp32 GEMM. ~15 fewer small ops than the
        grouped path: through MoEKernel, 686 -> 485 us (small), 1,674 -> 1,165 (Qwen3 sibling),
        1,534 -> 1,265 (Mixtral sibling; the four GEMMs alone take ~970) on the 2-core AVX2 EPYC,
        2026-11-28, interleaved medians (``scripts/bench_cpu_backend.py`` shapes)."""
        kept = [j for j, e in enumerate(local) if e >= 0]
        if not kept:
            out.zero_()
            return
        spans = [(local[j], n, n + 1) for n, j in enumerate(kept)]
        # one copy of the row per pair: a GEMM given a stride-0 (expanded) row copies it itself
        y = self._ffn(x.repeat(len(kept), 1), spans, weights).float()
        if self.config.apply_router_weight_on_input:
            out.copy_(y.sum(0, keepdim=True))
        else:
            w = router_w if len(kept) == len(local) else router_w[:, kept]
            out.copy_(torch.mm(w.float(), y))

    def _ffn(self, xs, spans, weights) -> torch.Tensor:
        """GEMM1, activation, Q_a2, GEMM2 of rows ``xs`` [n, H], rows s0:s1 by expert e for each
        (e, s0, s1) of ``spans``: [n, H] in the model dtype. Each GEMM writes its rows of one
        buffer and the activation runs once over all rows: ~6 ops an expert fewer than an
        activation and two copies per expert (Qwen3 sibling, ~80 of 128 experts hit at T = 16:
        16,785 -> 13,415 us with the one sort of ``_grouped``)."""
        cfg, sch, dt = self.config, self.scheme, self.config.dtype
        h = torch.empty(xs.shape[0], weights.w13.shape[1], dtype=dt)
        for e, s0, s1 in spans:
            self._mm(xs[s0:s1], expert_matrix(weights.w13, sch.w1, e, dt).T, h[s0:s1])
            if weights.b13 is not None:
                h[s0:s1] += weights.b13[e].to(dt)
        inter = fake_quantize(apply_activation(h, cfg), sch.a2, dt, **weights.act_scales("a2", sch.a2))
        y = torch.empty(xs.shape[0], cfg.hidden_size, dtype=dt)
        for e, s0, s1 in spans:
            self._mm(inter[s0:s1], expert_matrix(weights.w2, sch.w2, e, dt).T, y[s0:s1])
            if weights.b2 is not None:
                y[s0:s1] += weights.b2[e].to(dt)
        return y


class LoopExperts(CpuExperts):
    """The per-expert loop most model code ships: every expert visited, a mask per expert.

    Kept as the baseline the cpu backend is measured against, and as the
    'iterative' row of the reference tables.
    """

    name = "loop"
    # a per-tensor dynamic a2 scale would be taken per expert here, not over all rows
    capabilities = Capabilities(
        layouts=frozenset({TokenLayout.STANDARD}),
        schemes=ALL_SCHEMES - {"fp8_tensor", "int8_w8a8_tensor"},
        platforms=frozenset({"cpu", "cuda", "rocm", "xpu"}),
        note="per-expert loop in the model dtype (baseline)",
        seed_names=("iterative",),
    )

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        cfg, sch = self.config, self.scheme
        dt = cfg.dtype
        x = a.data.to(dt) if sch.a1 is None else dequantize(a, sch.a1, dt)
        acc = torch.zeros(x.shape[0], cfg.hidden_size, dtype=torch.float32, device=x.device)
        local = local_expert_ids(topk.ids, expert_map, weights.num_experts)
        for e in range(weights.num_experts):
            tok, kk = torch.where(local == e)
            h = self._mm(x[tok], expert_matrix(weights.w13, sch.w1, e, dt).T)
            if weights.b13 is not None:
                h = h + weights.b13[e].to(dt)
            inter = fake_quantize(apply_activation(h, cfg), sch.a2, dt, **weights.act_scales("a2", sch.a2))
            y = self._mm(inter, expert_matrix(weights.w2, sch.w2, e, dt).T)
            if weights.b2 is not None:
                y = y + weights.b2[e].to(dt)
            y = y.float()
            if not cfg.apply_router_weight_on_input:
                y = y * topk.weights[tok, kk].float().unsqueeze(1)
            acc.index_add_(0, tok, y)
        out.copy_(acc)
