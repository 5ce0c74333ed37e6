"""``triton`` and ``triton_batched``: the fused grouped-GEMM Triton kernels.

Standard layout, per call (T tokens, K top-k, E_l local experts)::

    moe_align          sort the T*K pairs by local expert, pad runs to BM   (1 launch)
    grouped_gemm #1    h = A[pair] @ W13[e]^T (+ b13)      [T*K, 2I]          (1 launch)
    act_and_quantize   a2 = Q_a2(act(h))                   [T*K, I]           (1 launch)
    grouped_gemm #2    y = a2 @ W2[e]^T (+ b2) * w[t,k]    [T*K, H]           (1 launch)
    moe_sum            out[t] = sum_k y[t, k]              [T, H]             (1 launch)

Workspace: h and y, 2 * T*K * max(2I, H) elements of the model dtype plus a2;
``MoEKernel`` chunking bounds T. Batched layout: the same two GEMMs over
[E_l, M, .] with per-expert counts read by the kernel (no align, no sum:
combine weights and scatters).

Rows that no local pair writes (pairs of experts mapped to -1, rows past the
counts) are zero-filled before the activation so a per-tensor dynamic a2 scale
never sees uninitialised memory (zeros leave an abs-max unchanged).
"""

from __future__ import annotations

import torch

from ..kernels._common import interpreting
from ..kernels.act_quant import act_and_quantize
from ..kernels.align import moe_align
from ..kernels.grouped_gemm import grouped_gemm, grouped_gemm_batched, scheme_key
from ..kernels.launch_config import pick_launch_config
from ..kernels.moe_sum import moe_sum
from ..quant import QTensor
from .base import ALL_SCHEMES, Capabilities, Experts, TokenLayout, WeightedReduce, Workspace

# Under the interpreter the kernels also run on the CPU (CI checks them there).
_PLATFORMS = frozenset({"cuda"} | ({"cpu"} if interpreting() else set()))


def _a2_static(scheme, weights) -> dict:
    kw = {}
    if scheme.a2 is not None and not scheme.a2.dynamic:
        kw["scale"] = weights.a2_scale
    if weights.a2_global_scale is not None:
        kw["global_scale"] = weights.a2_global_scale
    return kw


def _needs_native_fp8(scheme) -> bool:
    return scheme.a1 is not None and scheme.a1.dtype.value in ("fp8_e4m3", "mxfp8")


class _TritonBase(Experts):
    @classmethod
    def extra_checks(cls, config, scheme, platform):
        if platform.kind == "cuda" and _needs_native_fp8(scheme) and not platform.has_fp8:
            return f"fp8 activations need fp8 tensor cores (sm89+), platform is {platform.label}"
        return None


class TritonExperts(_TritonBase):
    name = "triton"
    layout = TokenLayout.STANDARD
    reduce = WeightedReduce.NONE
    batched_twin = "triton_batched"
    capabilities = Capabilities(
        layouts=frozenset({TokenLayout.STANDARD}),
        schemes=ALL_SCHEMES,
        platforms=_PLATFORMS,
        min_capability=(8, 0),
        note="fused grouped-GEMM Triton kernels, every scheme",
        seed_names=("triton",),
    )

    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        c = self.config
        pairs = num_tokens * c.top_k
        return Workspace(
            {
                "h": ((pairs, c.w13_rows), c.dtype),
                "y": ((pairs, c.hidden_size), c.dtype),
            }
        )

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        cfg, sch = self.config, self.scheme
        t, k = topk.ids.shape
        if t == 0:
            return
        e_l = weights.num_experts
        pairs = t * k
        ws = workspace or self.workspace(t, e_l).allocate(a.data.device)
        lc = pick_launch_config(pairs, e_l, cfg.w13_rows, cfg.hidden_size, scheme_key(sch.w1, sch.a1))
        routing = moe_align(topk.ids, e_l, lc.block_m, expert_map)
        h = ws["h"][:pairs]
        if expert_map is not None:
            h.zero_()
        grouped_gemm(
            a.data,
            weights.w13,
            routing,
            w_quant=sch.w1,
            a_quant=sch.a1,
            a_scale=a.scale,
            a_global_scale=a.global_scale,
            bias=weights.b13,
            a_div=k,
            out=h,
            config=lc,
        )
        a2 = act_and_quantize(h, cfg, sch.a2, **_a2_static(sch, weights))
        a2 = a2 if isinstance(a2, QTensor) else QTensor(a2, tuple(a2.shape))
        y = ws["y"][:pairs]
        lc2 = pick_launch_config(pairs, e_l, cfg.hidden_size, cfg.intermediate_size, scheme_key(sch.w2, sch.a2))
        grouped_gemm(
            a2.data,
            weights.w2,
            routing,
            w_quant=sch.w2,
            a_quant=sch.a2,
            a_scale=a2.scale,
            a_global_scale=a2.global_scale,
            bias=weights.b2,
            topk_weights=None if cfg.apply_router_weight_on_input else topk.weights,
            a_div=1,
            out=y,
            config=lc2,
        )
        moe_sum(y.view(t, k, -1), out, topk_ids=topk.ids, expert_map=expert_map)


class TritonBatchedExperts(_TritonBase):
    name = "triton_batched"
    layout = TokenLayout.BATCHED
    reduce = WeightedReduce.WEIGHT_AND_SUM
    capabilities = Capabilities(
        layouts=frozenset({TokenLayout.BATCHED}),
        schemes=ALL_SCHEMES,
        platforms=_PLATFORMS,
        min_capability=(8, 0),
        note="Triton grouped GEMMs on the batched layout (counts read on the device)",
        seed_names=("triton (batched)",),
    )

    def apply_batched(self, a, counts, weights, out, *, workspace=None):
        cfg, sch = self.config, self.scheme
        e_l, m = a.shape[0], a.shape[1]
        h = torch.zeros(e_l, m, cfg.w13_rows, dtype=cfg.dtype, device=a.data.device)
        grouped_gemm_batched(
            a.data,
            weights.w13,
            counts,
            w_quant=sch.w1,
            a_quant=sch.a1,
            a_scale=a.scale,
            a_global_scale=a.global_scale,
            bias=weights.b13,
            out=h,
        )
        a2 = act_and_quantize(h.view(e_l * m, -1), cfg, sch.a2, **_a2_static(sch, weights))
        if isinstance(a2, QTensor):
            row_scale = a2.scale is not None and a2.scale.shape[0] == e_l * m
            data = a2.data.view(e_l, m, -1)
            scale = a2.scale.view(e_l, m, -1) if row_scale else a2.scale
            a2_scale, a2_g = scale, a2.global_scale
        else:
            data, a2_scale, a2_g = a2.view(e_l, m, -1), None, None
        grouped_gemm_batched(
            data,
            weights.w2,
            counts,
            w_quant=sch.w2,
            a_quant=sch.a2,
            a_scale=a2_scale,
            a_global_scale=a2_g,
            bias=weights.b2,
            out=out,
        )
