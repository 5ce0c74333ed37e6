"""``grouped_mm``: PyTorch's grouped GEMMs with the MoE glue written once.

Standard layout, per call (T tokens, K top-k, E_l local experts, P = T*K pairs)::

    sort      pairs by local expert (stable); offsets by searchsorted  [P], [E_l]
    gather    A = a[pair // K]                                          [P, H]
    GEMM1     h = A @ W13[e]^T (+ b13[e])                               [P, 2I]
    act       a2 = Q_a2(act(h))  (Triton act+quant kernel on a GPU)     [P, I]
    GEMM2     y = a2 @ W2[e]^T (+ b2[e])                                [P, H]
    combine   out[t] = sum_k w[t,k] * y  in fp32 (index_add)            [T, H]

bf16 GEMMs: ``torch._grouped_mm`` (or ``F.grouped_mm``). PyTorch runs them with
CUTLASS only for bf16 on sm90/sm100; other dtypes and GPUs take a per-group
loop that copies the offsets to the host (a sync per call, no CUDA graphs), so
on CUDA this backend claims bf16 on sm90/sm100 only. On the CPU (torch 2.13)
the op works for every float dtype.

fp8 GEMMs (CUDA sm90): ``torch._scaled_grouped_mm`` with row-wise scales, the
only scaling it takes: per-token activation scales (a 1-D [P] vector) and
per-channel weight scales ([E, N]); per-tensor scales are broadcast to those
shapes. It rejects 2-D activation scales ("scale must be a 1D tensor") and has
no block-scaled variant on sm90, so fp8_block is not claimed. Fast
accumulation is on: on H100, 893.8 vs 1071.4 us for E=8 H=4096 2I=28672 M=4096
at the same 1.7e-3 relative error.

Sizes: operand rows must be 16-byte aligned (PyTorch, on the GPU and the CPU
alike: "strides should be multiple of 16 bytes"), so H and I are multiples of
8 for bf16 (4 for fp32); fp8 also needs N divisible by 16, so H and I
multiples of 16. ``why_not`` refuses other sizes.

The sort needs no host synchronisation: offsets come from ``searchsorted`` on
the sorted expert ids, and pairs that contribute nothing (ids outside [0, E), experts
mapped outside [0, E_l): ``metadata.TopK``) sort past the last offset, where no group
reads them; their rows (which the grouped GEMM leaves undefined) are skipped by the
activation kernel (``row_mask``: a per-tensor dynamic a2 scale never sees them) and by
``moe_sum``, which gathers each pair's row back, weights it and sums in k order.

Weight layout ``grouped_mm`` (``prepare_weights``): W13 and W2 as the B
operands of x @ B, [E, H, 2I] and [E, I, H]: the transposed view of the
reference storage (K contiguous, "column-major"), which the fp8 op requires
and the bf16 op runs as fast as a row-major copy (H100, E=128 H=2048 2I=1536
M=16384: 333.6 vs 334.4 us; E=8 H=4096 2I=28672: 1463 vs 1494 us), so no copy
is made; fp8 weight scales become fp32 [E, N]. The reference layout is taken
as well (converted per call: a view and a small scale reshape).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..contract import TokenLayout
from ..errors import expect
from ..kernels.act_quant import act_and_quantize, act_and_quantize_ref
from ..kernels.moe_sum import moe_sum
from ..metadata import local_expert_ids
from ..quant import QTensor
from .base import Capabilities, Experts

# the private op first: the same kernel without F.grouped_mm's Python argument checks
_GROUPED_MM = getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)
_SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)
FP8_ROWWISE = frozenset({"fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_channel"})
LAYOUT = "grouped_mm"


def _schemes() -> frozenset[str]:
    if _GROUPED_MM is None:
        return frozenset({"bf16"})
    return frozenset({"bf16"} | (FP8_ROWWISE if _SCALED_GROUPED_MM is not None else set()))


def row_scales(q: QTensor, tq) -> torch.Tensor:
    """Weight scales [E, N] fp32 (per-channel as is, per-tensor broadcast), as _scaled_grouped_mm takes them."""
    e, n = q.shape[0], q.shape[1]
    return q.scale.float().reshape(e, -1).expand(e, n).contiguous()


def _b_operand(q: QTensor, tq, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B [E, K, N], weight scales [E, N] or None) from either weight layout."""
    if layout == LAYOUT:
        return q.data, q.scale
    expect(layout == "reference", "weights.layout", f"'reference' or '{LAYOUT}'", layout)
    return q.data.transpose(1, 2), None if tq is None else row_scales(q, tq)


class GroupedMMExperts(Experts):
    name = "grouped_mm"
    layout = TokenLayout.STANDARD
    capabilities = Capabilities(
        layouts=frozenset({TokenLayout.STANDARD}),
        schemes=_schemes(),
        platforms=frozenset({"cpu", "cuda"}),
        min_capability=(9, 0),
        implemented=_GROUPED_MM is not None,
        note=(
            "PyTorch grouped GEMMs: bf16 (CUTLASS on sm90/sm100), fp8 row-wise on sm90"
            if _GROUPED_MM is not None
            else f"torch {torch.__version__} has no torch._grouped_mm (PyTorch 2.8+)"
        ),
    )

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        fp8 = scheme.w1 is not None
        if fp8 and platform.kind != "cuda":
            return f"fp8 needs torch._scaled_grouped_mm, which runs on CUDA only; platform is {platform.label}"
        step = 16 if fp8 else 16 // config.dtype.itemsize
        h, i = config.hidden_size, config.intermediate_size
        if h % step or i % step:
            what = "fp8" if fp8 else str(config.dtype).replace("torch.", "")
            return f"{what} operands need H and I multiples of {step} (16-byte aligned rows), got H={h}, I={i}"
        if platform.kind != "cuda":
            return None
        major = (platform.capability or (0, 0))[0]
        if major not in (9, 10):
            return f"PyTorch runs grouped GEMMs with CUTLASS on sm90/sm100 only, platform is {platform.label}"
        if config.dtype != torch.bfloat16:
            return f"PyTorch's CUDA grouped GEMM is bf16 only; {config.dtype} takes a per-group loop with a host sync"
        if fp8 and major != 9:
            return f"PyTorch's fp8 row-wise grouped GEMM is sm90 only (not sm100), platform is {platform.label}"
        return None

    # ---- weights ----------------------------------------------------------
    def prepare_weights(self, weights):
        expect(weights.layout == "reference", "weights.layout", "'reference'", weights.layout)

        def conv(q, tq):
            scale = None if tq is None else row_scales(q, tq)
            return QTensor(q.data.transpose(1, 2), q.shape, scale=scale)

        sch = self.scheme
        return replace(weights, w13=conv(weights.w13, sch.w1), w2=conv(weights.w2, sch.w2), layout=LAYOUT)

    def restore_weights(self, weights):
        expect(weights.layout == LAYOUT, "weights.layout", f"'{LAYOUT}'", weights.layout)

        def back(q, tq):
            if tq is None:
                return QTensor(q.data.transpose(1, 2), q.shape)
            keep = q.scale.shape[1] if tq.granularity.kind == "channel" else 1
            return QTensor(q.data.transpose(1, 2), q.shape, scale=q.scale[:, :keep].unsqueeze(-1).contiguous())

        sch = self.scheme
        return replace(weights, w13=back(weights.w13, sch.w1), w2=back(weights.w2, sch.w2), layout="reference")

    # ---- running ----------------------------------------------------------
    def _gemm(self, x: QTensor, rows: torch.Tensor | None, b, b_scale, offs) -> torch.Tensor:
        """x (gathered by ``rows`` when given) @ B per group -> [P, N] in the model dtype."""
        data = x.data if rows is None else x.data[rows]
        if b_scale is None:
            return _GROUPED_MM(data, b, offs=offs)
        if x.scale.numel() == 1:
            a_scale = x.scale.float().reshape(1).expand(data.shape[0]).contiguous()
        else:
            a_scale = x.scale.float().reshape(-1)
            a_scale = a_scale if rows is None else a_scale[rows]
        return _SCALED_GROUPED_MM(
            data, b, a_scale, b_scale, offs=offs, out_dtype=self.config.dtype, use_fast_accum=True
        )

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        cfg, sch = self.config, self.scheme
        t, k = topk.ids.shape
        if t == 0:
            return
        e_l = weights.num_experts
        w13, s13 = _b_operand(weights.w13, sch.w1, weights.layout)
        w2, s2 = _b_operand(weights.w2, sch.w2, weights.layout)
        local = local_expert_ids(topk.ids.reshape(-1), expert_map, e_l)
        key = torch.where(local >= 0, local, e_l)
        sorted_key, order = torch.sort(key, stable=True)
        offs = torch.searchsorted(sorted_key, torch.arange(e_l, device=key.device), right=True).to(torch.int32)
        tok = order // k
        valid = sorted_key < e_l
        expert = sorted_key.clamp(max=e_l - 1)

        h = self._gemm(a, tok, w13, s13, offs)
        if weights.b13 is not None:
            h = h + weights.b13.to(h.dtype)[expert]
        if h.is_cuda:
            # rows past the last group are neither read nor written: a per-tensor dynamic a2 scale
            # never sees their undefined values (no masked copy of h)
            a2 = act_and_quantize(h, cfg, sch.a2, row_mask=valid, **weights.act_scales("a2", sch.a2))
        else:
            h = h.masked_fill(~valid.unsqueeze(1), 0)
            a2 = act_and_quantize_ref(h, cfg, sch.a2, **weights.act_scales("a2", sch.a2))
        a2 = a2 if isinstance(a2, QTensor) else QTensor(a2, tuple(a2.shape))
        y = self._gemm(a2, None, w2, s2, offs)
        if weights.b2 is not None:
            y = y.float() + weights.b2.float()[expert]
        # back to pairs: the row of pair (t, k) in the sorted order, gathered, weighted and summed
        # by one moe_sum launch (pairs that contribute nothing are skipped there)
        rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        route_w = None if cfg.apply_router_weight_on_input else topk.weights
        moe_sum(
            y,
            out,
            topk_ids=topk.ids,
            expert_map=expert_map,
            num_local_experts=e_l,
            rows=rows.view(t, k),
            weights=route_w,
        )
