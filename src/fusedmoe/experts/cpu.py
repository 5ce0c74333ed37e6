"""``cpu``: PyTorch on the CPU in the model dtype, grouped per expert.

The (token, k) pairs are sorted by expert once; each expert that received
tokens runs two dense GEMMs on a contiguous slice of rows, with its weights
dequantized on the fly (one expert at a time, so the float copy of all the
weights never exists). Compared with the per-expert loop that most model
code ships (a boolean mask and a gather per expert, every expert visited),
it visits only the experts hit, gathers once and scatters once.

Numerics: GEMMs in the model dtype (bf16 on CPU accumulates in fp32), the
weighted sum over K in fp32, one rounding to the model dtype at the end. On a
CPU without bf16/fp16 matrix instructions (``platform.cpu_has_half_gemm``), a
GEMM of at least ``UPCAST_ROWS`` rows converts its operands to fp32 and rounds
its output to the model dtype: the same products and the same rounding of the
output as the half-precision GEMM (which also accumulates in fp32), 1.7-4.6x
faster there from 16 rows on (2-core AVX2 EPYC, 2026-11-28: [M, 512] x [512,
3584], M = 16: 4,452 -> 2,641 us, M = 256: 72,178 -> 15,771 us; at M = 1-8 the
conversion of W costs more than it saves: 290 vs 458 us at M = 1, 2,016 vs
2,266 at M = 8).

Deterministic mode (``deterministic``; ``FUSEDMOE_DETERMINISTIC=1`` when built): every
GEMM runs over fixed tiles of 16 rows (``reference.batch_invariant_mm``), the last one
zero-padded, so a token's output
does not depend on how many other rows its expert got. fp32 GEMMs are MKL sgemm,
whose result for a row changes with the number of rows in the call (1 row vs 2+: 5e-7
relative); with every call 16 rows, each row meets the same kernel. bf16/fp16 (oneDNN)
were batch-invariant already; they are tiled too, so the guarantee does not rest on
that. The sum over K is in expert order whatever the batch (``index_add_`` of the
expert-sorted pairs).
"""

from __future__ import annotations

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

UPCAST_ROWS = 16  # rows from which a half-precision GEMM runs in fp32 on CPUs without half GEMMs (above)


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

    def _mm(self, a: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            return batch_invariant_mm(a, w_t)
        # the CPU's own GEMM only: the loop baseline (a subclass) also runs on GPUs
        half = a.dtype in (torch.bfloat16, torch.float16)
        if half and a.shape[0] >= UPCAST_ROWS and a.device.type == "cpu" and not cpu_has_half_gemm():
            return (a.float() @ w_t.float()).to(a.dtype)
        return a @ w_t

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        cfg, sch = self.config, self.scheme
        dt = cfg.dtype
        t, k = topk.ids.shape
        if t == 0:
            return
        x = a.data.to(dt) if sch.a1 is None else dequantize(a, sch.a1, dt)
        local = local_expert_ids(topk.ids.reshape(-1), expert_map, weights.num_experts)
        keep = (local >= 0).nonzero(as_tuple=True)[0]
        acc = torch.zeros(t, cfg.hidden_size, dtype=torch.float32)
        if keep.numel():
            order = keep[torch.sort(local[keep], stable=True).indices]
            counts = torch.bincount(local[order], minlength=weights.num_experts).tolist()
            xs = x[order // k]
            inter = torch.empty(order.numel(), cfg.intermediate_size, dtype=dt)
            spans = []
            start = 0
            for e, c in enumerate(counts):
                if c:
                    spans.append((e, start, start + c))
                    start += c
            for e, s0, s1 in spans:
                h = self._mm(xs[s0:s1], expert_matrix(weights.w13, sch.w1, e, dt).T)
                if weights.b13 is not None:
                    h = h + weights.b13[e].to(dt)
                inter[s0:s1] = apply_activation(h, cfg)
            inter = fake_quantize(inter, sch.a2, dt, **weights.act_scales("a2", sch.a2))
            y = torch.empty(order.numel(), cfg.hidden_size, dtype=torch.float32)
            for e, s0, s1 in spans:
                ye = self._mm(inter[s0:s1], expert_matrix(weights.w2, sch.w2, e, dt).T)
                if weights.b2 is not None:
                    ye = ye + weights.b2[e].to(dt)
                y[s0:s1] = ye.float()
            if not cfg.apply_router_weight_on_input:
                y *= topk.weights.reshape(-1)[order].float().unsqueeze(1)
            acc.index_add_(0, order // k, y)
        out.copy_(acc)


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
