"""``triton`` and ``triton_batched``: the fused grouped-GEMM Triton kernels.

Standard layout, per call (T tokens, K top-k, E_l local experts)::

    moe_align          sort the T*K pairs by local expert, pad runs to BM   (1 launch)
    grouped_gemm #1    h = A[pair] @ W13[e]^T (+ b13)      [T*K, 2I]          (1 launch)
    act_and_quantize   a2 = Q_a2(act(h))                   [T*K, I]           (1 launch)
    grouped_gemm #2    y = a2 @ W2[e]^T (+ b2) * w[t,k]    [T*K, H]           (1 launch)
    moe_sum            out[t] = sum_k y[t, k]              [T, H]             (1 launch)

Fused activation (the default wherever a2's scale is known before its values: a2 not
quantized, or static per-tensor fp8/int8): GEMM1 applies the activation (and Q_a2) in
its epilogue and writes a2 [T*K, I] directly (``grouped_gemm(act=ActEpilogue)``), so h
never exists: one launch fewer (two with an expert map or the batched layout, whose h
is zero-filled first), and no write + read of h (T*K x 2I in the model dtype; batched:
E_l*M x 2I). Dynamic a2 scales (per token, group, MX/NV blocks, per-tensor dynamic)
need the whole row or tensor first and keep act_and_quantize.
``FUSEDMOE_FUSE_ACT=0`` (read when the experts are built) or ``experts.fuse_act = False``
turns the fusion off, for comparison. The fused GEMM1 takes the plain GEMM1's launch
config with BN halved (``gated_act_config``), so a program reads the same W13 rows.

Workspace (``workspace``, declared from the shapes): h [T*K, 2I] (unfused only) and y
[T*K, H] in the model dtype, a2 [T*K, I] quantized as scheme.a2 (plus its row scales);
``MoEKernel`` chunking bounds T. Given a workspace (``MoEKernel.allocate``), ``apply``
writes into it and allocates none of these. Batched layout: the same two GEMMs over
[E_l, M, .] with per-expert counts read by the kernel (no align, no sum: combine
weights and scatters); its workspace is h (unfused only) and a2 for E_l * M rows.

Rows that no local pair writes (pairs that contribute nothing: ids outside [0, E), experts
mapped outside [0, E_l), see ``metadata.TopK``; batched rows past the counts) are never
read as outputs: GEMM2 reads the rows of local pairs only and ``moe_sum`` skips the
others. Unfused, they are zero-filled before the activation where a per-tensor dynamic
a2 scale (an abs-max over every row) would see them (batched: always), so it never
sees uninitialised memory (zeros leave an abs-max unchanged); with a reused workspace
such rows hold the previous call's values. Other a2 scales are per row: a stale row
only makes its own, unread, output.

Deterministic mode (``deterministic``; ``FUSEDMOE_DETERMINISTIC=1`` when built): the
launch config does not depend on the token count (``pick_launch_config``), so every
token meets the same tiles and K-loop order whatever batch it is in. Nothing else
here depends on T: no kernel reduces with atomic adds (the sum over top-k is
``moe_sum``, in k order; the only atomic is an order-free ``atomic_max`` for a
per-tensor dynamic scale) and there is no split-K.
"""

from __future__ import annotations

import torch

from .. import env
from ..contract import TokenLayout, WeightedReduce, Workspace, quantized_layout, take
from ..kernels._common import interpreting
from ..kernels.act_quant import act_and_quantize
from ..kernels.align import moe_align
from ..kernels.grouped_gemm import ActEpilogue, grouped_gemm, grouped_gemm_batched, scheme_key
from ..kernels.launch_config import gated_act_config, pick_launch_config
from ..kernels.moe_sum import moe_sum
from ..metadata import int32_ids
from ..quant import Operand, QTensor
from .base import ALL_SCHEMES, Capabilities, Experts

# Under the interpreter the kernels also run on the CPU (CI checks them there).
_PLATFORMS = frozenset({"cuda"} | ({"cpu"} if interpreting() else set()))


def _needs_native_fp8(scheme) -> bool:
    return scheme.a1 is not None and scheme.a1.dtype.value in ("fp8_e4m3", "mxfp8")


def _tensor_dynamic(tq) -> bool:
    return tq is not None and tq.dynamic and tq.granularity.kind == "tensor"


def _a2_out(ws, tq, rows: int, cols: int, device) -> QTensor | torch.Tensor | None:
    """``act_and_quantize``'s output buffers for ``rows`` rows, taken from the workspace
    (None without one: it allocates its own)."""
    if ws is None or "a2" not in ws:
        return None
    buf = ws["a2"]
    data = take(ws, "a2", (rows, *buf.shape[1:]), buf.dtype, device)
    if tq is None:
        return data
    scale = ws.get("a2_scale")
    if scale is not None and not _tensor_dynamic(tq):
        scale = take(ws, "a2_scale", (rows, *scale.shape[1:]), scale.dtype, device)
    return QTensor(data, (rows, cols), scale=scale)


class _TritonBase(Experts):
    # Deterministic mode: launch configs chosen without looking at the token count
    # (see the module docstring). MoEKernel(deterministic=...) sets it too.
    deterministic: bool = False
    # GEMM1 applies the activation in its epilogue where the scheme allows (module docstring).
    fuse_act: bool = True

    def __init__(self, config, scheme) -> None:
        super().__init__(config, scheme)
        self.deterministic = env.deterministic()
        self.fuse_act = env.fuse_act()
        self._epilogue = ActEpilogue.of(config, scheme.a2) if ActEpilogue.supports(scheme.a2) else None

    def act_epilogue(self) -> ActEpilogue | None:
        """GEMM1's fused activation, or None: GEMM1 writes h and act_and_quantize follows."""
        return self._epilogue if self.fuse_act else None

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        if platform.kind == "cuda" and _needs_native_fp8(scheme) and not platform.has_fp8:
            return f"fp8 activations need fp8 tensor cores (sm89+), platform is {platform.label}"
        return None

    def _launch_config(self, rows: int, e_l: int, n: int, k: int, w_quant, a_quant):
        return pick_launch_config(rows, e_l, n, k, scheme_key(w_quant, a_quant), deterministic=self.deterministic)

    def _gemm1_config(self, lc, ep: ActEpilogue | None):
        """GEMM1's launch config: with a gated fused activation BN counts output columns."""
        return gated_act_config(lc) if ep is not None and ep.activation.is_gated else lc

    def _gemm1_act(self, a, weights, ep: ActEpilogue, rows: int, workspace, gemm, **kw) -> QTensor:
        """a2 [rows, I] straight from GEMM1 (``gemm`` is the standard or batched op)."""
        cfg, sch = self.config, self.scheme
        i = cfg.intermediate_size
        scale = weights.act_scales("a2", sch.a2).get("scale") if ep.quant is not None else None
        data = take(workspace, "a2", (rows, i), ep.out_dtype(cfg.dtype), a.data.device)
        out = data if a.data.dim() == 2 else data.view(*a.data.shape[:2], i)  # batched: [E_l, M, I]
        gemm(Operand(a, sch.a1), Operand(weights.w13, sch.w1), bias=weights.b13, out=out, act=ep, act_scale=scale, **kw)
        return QTensor(data, (rows, i), scale=None if scale is None else scale.reshape(1, 1).float())

    def _workspace(self, rows: int) -> Workspace:
        c = self.config
        shapes = {} if self.act_epilogue() is not None else {"h": ((rows, c.w13_rows), c.dtype)}
        shapes.update(quantized_layout("a2", self.scheme.a2, rows, c.intermediate_size, c.dtype))
        return Workspace(shapes)


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
        pairs = num_tokens * self.config.top_k
        ws = self._workspace(pairs)
        ws.shapes["y"] = ((pairs, self.config.hidden_size), self.config.dtype)
        return ws

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        cfg, sch = self.config, self.scheme
        t, k = topk.ids.shape
        if t == 0:
            return
        dev = a.data.device
        e_l = weights.num_experts
        pairs = t * k
        lc = self._launch_config(pairs, e_l, cfg.w13_rows, cfg.hidden_size, sch.w1, sch.a1)
        # the align kernel takes int32; routers may give int64
        ids = int32_ids(topk.ids, e_l if expert_map is None else expert_map.shape[0])
        routing = moe_align(ids, e_l, lc.block_m, expert_map)
        ep = self.act_epilogue()
        if ep is not None:
            lc1 = self._gemm1_config(lc, ep)
            a2 = self._gemm1_act(a, weights, ep, pairs, workspace, grouped_gemm, routing=routing, a_div=k, config=lc1)
        else:
            h = take(workspace, "h", (pairs, cfg.w13_rows), cfg.dtype, dev)
            if _tensor_dynamic(sch.a2):
                h.zero_()
            w13 = Operand(weights.w13, sch.w1)
            grouped_gemm(Operand(a, sch.a1), w13, routing, bias=weights.b13, a_div=k, out=h, config=lc)
            a2_out = _a2_out(workspace, sch.a2, pairs, cfg.intermediate_size, dev)
            a2 = act_and_quantize(h, cfg, sch.a2, out=a2_out, **weights.act_scales("a2", sch.a2))
            a2 = a2 if isinstance(a2, QTensor) else QTensor(a2, tuple(a2.shape))
        y = take(workspace, "y", (pairs, cfg.hidden_size), cfg.dtype, dev)
        lc2 = self._launch_config(pairs, e_l, cfg.hidden_size, cfg.intermediate_size, sch.w2, sch.a2)
        grouped_gemm(
            Operand(a2, sch.a2),
            Operand(weights.w2, sch.w2),
            routing,
            bias=weights.b2,
            topk_weights=None if cfg.apply_router_weight_on_input else topk.weights,
            out=y,
            config=lc2,
        )
        moe_sum(y.view(t, k, -1), out, topk_ids=ids, expert_map=expert_map, num_local_experts=e_l)


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

    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        """Buffers for ``num_tokens`` rows per expert (M of the batched layout)."""
        return self._workspace(num_local_experts * num_tokens)

    def apply_batched(self, a, counts, weights, out, *, workspace=None):
        cfg, sch = self.config, self.scheme
        e_l, m = a.shape[0], a.shape[1]
        dev = a.data.device
        rows = e_l * m
        lc = self._launch_config(rows, e_l, cfg.w13_rows, cfg.hidden_size, sch.w1, sch.a1)
        ep = self.act_epilogue()
        if ep is not None:
            lc1 = self._gemm1_config(lc, ep)
            a2 = self._gemm1_act(a, weights, ep, rows, workspace, grouped_gemm_batched, counts=counts, config=lc1)
        else:
            h = take(workspace, "h", (rows, cfg.w13_rows), cfg.dtype, dev).zero_()
            w13 = Operand(weights.w13, sch.w1)
            grouped_gemm_batched(Operand(a, sch.a1), w13, counts, bias=weights.b13, out=h.view(e_l, m, -1), config=lc)
            a2_out = _a2_out(workspace, sch.a2, rows, cfg.intermediate_size, dev)
            a2 = act_and_quantize(h, cfg, sch.a2, out=a2_out, **weights.act_scales("a2", sch.a2))
        i = cfg.intermediate_size
        if isinstance(a2, QTensor):
            row_scale = a2.scale is not None and a2.scale.shape[0] == rows
            scale = a2.scale.view(e_l, m, -1) if row_scale else a2.scale
            a2 = QTensor(a2.data.view(e_l, m, -1), (e_l, m, i), scale=scale, global_scale=a2.global_scale)
        else:
            a2 = QTensor(a2.view(e_l, m, -1), (e_l, m, i))
        grouped_gemm_batched(
            Operand(a2, sch.a2),
            Operand(weights.w2, sch.w2),
            counts,
            bias=weights.b2,
            out=out,
            config=self._launch_config(rows, e_l, cfg.hidden_size, i, sch.w2, sch.a2),
        )
