"""The fused MoE grouped GEMM: ``grouped_gemm`` (standard layout) and ``grouped_gemm_batched``.

Standard layout (after ``moe_align``)::

    for each BM block b of the aligned pairs with e = block_expert[b] != -1:
        rows   = sorted_ids[b*BM : (b+1)*BM]          (T*K marks a padding slot)
        C[r]   = (A[r // a_div] @ W[e]^T + bias[e]) * topk_weight[r]     for real rows r

    a_div = K when A is the [T, H] input of GEMM1 (each token feeds its K pairs),
            1 when A is the [T*K, I] intermediate of GEMM2.

C has one row per (token, k) pair, [T*K, N]; rows of pairs whose expert is not local
are never written (the caller zero-fills only where it needs to). Batched layout::

    C[e, m] = (A[e, m] @ W[e]^T + bias[e]) * row_weight[e, m]   for m < counts[e]

rows m >= counts[e] untouched. Quantized activations come in already quantized: pass the
stored data as ``a`` and its scale(s).

GEMM1 can end with the layer's activation (``act=ActEpilogue``): then C is act(A @ W13^T
+ b13) [M, I] (times the router weight), in the model dtype or quantized with a static
per-tensor fp8/int8 scale (``act_scale``), and the launch config's BN counts C's columns.
That saves the [M, 2I] round trip through memory and the activation kernel's launch; a
dynamically quantized a2 (its scale depends on the values) still needs that kernel.

Weights W [E, N, K] are a ``QTensor`` in the reference layout (see ``quant.tensor``).
Supported (activation x weight): float x float (bf16/fp16/fp32); fp8 x fp8 and int8 x
int8 with tensor/token activations or 1 x g groups and tensor/channel/block(bn, bk)
weights; float x int8 (w8a16); float x int4 (groups, zero points, act-order); float /
mxfp8 / fp8 x mxfp4; float / nvfp4 x nvfp4. Accumulation is fp32 (int32 for int8 x
int8 without per-K scales on the tensor cores).

The launch config's BM picks how operands meet: BM >= 16 through ``tl.dot`` (tensor
cores), BM in 1, 2, 4, 8 by fp32 multiply-reduce for decode (every scheme, both layouts,
the same epilogue; see ``_grouped_gemm``). BM is also ``moe_align``'s padding unit, so
the standard layout's tile is the routing's block (``routing.block_m``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton.language as tl

from ..activations import apply_activation
from ..errors import expect
from ..metadata import AlignedRouting
from ..quant import Operand, TensorQuant, dequantize, fake_quantize, quantize
from ..quant.w4_layout import is_w4
from . import grouped_gemm_persistent as _persistent
from ._common import cdiv, interpreting
from ._grouped_gemm import _grouped_gemm_kernel
from .act_quant import known_amax, scale_of_amax
from .gemm_format import (
    _TL_DTYPE,
    ActEpilogue,
    GemmCall,
    GemmFormat,
    RowBlocks,
    _strides,
    _u8,
    amax_buffer,
    epilogue_scale,
    on_load_why,
    optional_ptrs,
    out_quant,
    per_expert_scale,
    scheme_key,
    shared_constexprs,
)
from .grouped_gemm_w4 import w4_gemm_launch
from .launch import launch
from .launch_config import LaunchConfig, fit_launch_config, gated_act_config, pick_launch_config

_ROUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # router weights the kernels read as given


def grouped_gemm_launch(
    a: Operand, w: Operand, c: torch.Tensor, fmt: GemmFormat, cfg: LaunchConfig, call: GemmCall
) -> None:
    """Launch the kernel into ``c``: standard layout with ``call.routing``, batched with ``call.counts``.

    Shapes are not re-validated here (``grouped_gemm`` does it); ``cfg.block_m`` must
    equal ``routing.block_m`` in the standard layout. With ``act``, ``cfg.block_n`` counts
    columns of the activation output C. ``cfg.persistent``: the persistent TMA kernel
    (``grouped_gemm_persistent``) where it serves the call, else this one.
    """
    # 105 lines: maps every operand to the kernel's ~70 pointers, strides and constexprs in its argument order; split,
    # that order would be spread over several functions.
    if is_w4(w.q):  # converted at load (quant.w4_layout): the 4-bit kernel
        w4_gemm_launch(a, w, c, fmt, cfg, call)
        return
    routing, counts, a_div, bias, route_weights, act, act_scale = call.unpacked()
    if cfg.persistent:  # (it refuses pair blocks: ``supports``)
        pk = _persistent
        served = pk.supports(fmt, act, a=a.data, w=w.q, c=c, cfg=cfg, routing=routing) is None
        if served or any(pk.sorted_layout(a.data, c, routing)):  # slot-ordered rows: only it reads them
            return pk.persistent_gemm_launch(a, w, c, fmt, cfg, call)
    a_scale, a_global_scale = a.scale, a.global_scale
    a, w = a.data, w.q
    e_l, n_w, kd = w.shape
    n = n_w if act is None else act.out_cols(n_w)
    rows = RowBlocks.of(a, e_l, cfg.block_m, routing)
    if rows.num_m_blocks == 0 or n == 0 or c.numel() == 0:
        return
    if fmt.a_on_load:  # a per-tensor scale from the abs-max GEMM1 left; group scales from the tile
        a_scale = known_amax(call.a_amax, "a_amax") if fmt.a_group == 0 else None
    c_arg = _u8(c)  # fp8 codes are stored as bytes
    dummy = c_arg
    a_scale = _u8(a_scale)
    ag = per_expert_scale(a_global_scale)
    w_scale = _u8(w.scale)
    ws_str = _strides(w_scale, 3)
    if w.zero is not None:
        expect(
            w.zero.shape == w_scale.shape and _strides(w.zero, 3) == ws_str,
            "w.zero",
            "the scale's shape and strides",
            tuple(w.zero.shape),
        )
    wg = per_expert_scale(w.global_scale)
    g_idx = w.g_idx if fmt.act_order else None
    route_weights, rw_str = rows.route_weights(route_weights)
    oq = out_quant(act)
    grid = (rows.num_m_blocks * cdiv(n, cfg.block_n),)
    c_scale = epilogue_scale(oq, act_scale, slots=grid[0])
    # the dot path's operand dtype; the FMA path (BM < 16) always multiplies in fp32
    if interpreting():
        dot_dtype = tl.float32  # the interpreter's bf16/fp16 dot multiplies raw bits
    elif fmt.a_fmt == "float":
        dot_dtype = _TL_DTYPE[a.dtype]
    else:
        dot_dtype = tl.bfloat16  # dequantized e4m3/e2m1 x power-of-2 values are exact in bf16
    batched = rows.batched
    sorted_ids, block_expert = (None, None) if batched else (routing.sorted_ids, routing.block_expert)

    launch(
        _grouped_gemm_kernel,
        grid,
        *optional_ptrs(dummy, _u8(a), a_scale, ag, _u8(w.data), w_scale, w.zero, wg, g_idx, bias, route_weights),
        *optional_ptrs(dummy, c_arg, c_scale, sorted_ids, block_expert, counts if batched else None),
        n,
        kd,
        0 if g_idx is None else w_scale.shape[-1],
        rows.num_pairs,
        a_div,
        rows.m_max,
        rows.blocks_per_expert,
        rows.num_m_blocks,
        e_l,
        a_scale.numel() if fmt.a_on_load and a_scale is not None else 0,
        1.702 if act is None else act.swiglu_alpha,
        7.0 if act is None else act.swiglu_limit,
        *rows.strides(a),
        *rows.scale_strides(a_scale),
        0 if ag is None or ag.numel() == 1 else 1,
        *w.data.stride(),
        *ws_str,
        *(g_idx.stride() if g_idx is not None else (0, 0)),
        *(bias.stride() if bias is not None else (0, 0)),
        *rw_str,
        *rows.strides(c),
        A_ON_LOAD=fmt.a_on_load,
        ACT_ORDER=g_idx is not None,
        HAS_ZERO=w.zero is not None,
        HAS_A_GSCALE=ag is not None,
        HAS_W_GSCALE=wg is not None,
        DOT_DTYPE=dot_dtype,
        PAIR_BLOCKS=routing is not None and routing.pair_blocks,
        **shared_constexprs(fmt, cfg, act, batched, bias, route_weights, oq, n),
    )


def _prepare(
    a: Operand, w: Operand, bias, out_dtype, rows_hint: int, config, act, act_scale, quantize_a=None, a_amax=None
) -> tuple[GemmFormat, LaunchConfig, torch.dtype, int]:
    """Validated operands: (format, fitted launch config, C's dtype, C's columns)."""
    expect(len(w.shape) == 3, "w", "a [E, N, K] weight", w.shape)
    e_l, n, kd = w.shape
    expect(a.shape[-1] == kd, "a", f"K = {kd} columns (W is {tuple(w.shape)})", tuple(a.shape))
    expect((w.quant is None) == (w.scale is None), "w.quant", "given exactly when w has a scale", w.quant)
    on_load = quantize_a is not None
    fmt = GemmFormat.of(w.quant, quantize_a if on_load else a.quant, n, kd, w.q.zero is not None, on_load)
    if on_load:
        why = on_load_why(quantize_a)
        expect(why is None, "quantize_a", f"a scheme the kernel can quantize A with as it loads it ({why})", quantize_a)
        expect(a.quant is None, "a", "values in the model dtype when quantize_a is given", a.quant)
        expect(fmt.native and not is_w4(w.q), "w", f"{quantize_a.short} codes' own weights (native w8a8)", w.quant)
        if fmt.a_group == 0:
            known_amax(a_amax, "a_amax")
    if a.quant is None:
        expect(a.data.dtype in _TL_DTYPE, "a", "bf16/fp16/fp32 when a.quant is None", a.data.dtype)
    else:
        expect(a.scale is not None, "a.scale", f"a scale for {a.quant.short} activations")
    if fmt.act_order:
        expect(w.q.g_idx is not None, "w.g_idx", "an act-order group map [E, K]")
    if bias is not None:
        expect(tuple(bias.shape) == (e_l, n), "bias", f"shape {(e_l, n)}", tuple(bias.shape))
    model_dtype = a.data.dtype if a.quant is None else torch.bfloat16
    n_out = n
    if act is not None:
        if act.activation.is_gated:
            expect(n % 2 == 0, "w", f"an even number of rows [E, 2I, K] for {act.activation.value}", w.shape)
        n_out = act.out_cols(n)
        if act.track_amax and not act.amax_slots:  # (the slots' count is the grid's: checked at launch)
            amax_buffer(act_scale)
        if act.quant is not None:
            ok = act_scale is not None and act_scale.numel() == 1
            expect(ok, "act_scale", f"the static scale of {act.quant.short}")
            want = act.out_dtype(model_dtype)
            expect(out_dtype in (None, want), "out_dtype", f"{want} for {act.quant.short} output", out_dtype)
            out_dtype = want
    if out_dtype is None:
        out_dtype = model_dtype
    if config is None:
        config = pick_launch_config(rows_hint, e_l, n, kd, scheme_key(w.quant, a.quant))
        if act is not None and act.activation.is_gated:
            config = gated_act_config(config)
    if on_load and fmt.a_group:  # a tile holds one group of each row: its scale comes from the tile
        config = replace(config, block_k=fmt.a_group)
    if on_load or (act is not None and act.amax_slots):  # the non-persistent kernel's features
        config = replace(config, persistent=False)
    return fmt, fit_launch_config(config, fmt.k_group, strict=fmt.native), out_dtype, n_out


def _use_kernel(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" or interpreting()


def _fill_from_ref(out: torch.Tensor, ref_fn, act: ActEpilogue | None, act_scale) -> torch.Tensor:
    """The CPU path: ``out``'s rows that the reference writes, from the reference in fp32
    (quantized to C's codes when the epilogue quantizes; the abs-max of the stored values
    raised when it tracks it)."""
    plain = None if act is None else replace(act, quant=None, track_amax=False)
    ref = ref_fn(plain)
    written = ~ref.isnan().all(dim=-1)
    if act is not None and act.quant is not None:
        out[written] = quantize(ref[written], act.quant, scale=act_scale.reshape(1, 1)).data
        return out
    out[written] = ref[written].to(out.dtype)
    if act is not None and act.amax_slots:  # one slot holds the abs-max, the others 0 (a max of slots)
        act_scale.zero_()
        if bool(written.any()):
            act_scale[:1] = out[written].float().abs().amax().reshape(1).view(torch.int32)
    elif act is not None and act.track_amax and bool(written.any()):
        amax = out[written].float().abs().amax().reshape(1)
        act_scale.copy_(torch.where(amax.isnan() | (amax > act_scale), amax, act_scale))
    return out


def grouped_gemm(
    a: Operand,
    w: Operand,
    routing: AlignedRouting,
    *,
    bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    a_div: int = 1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: LaunchConfig | None = None,
    act: ActEpilogue | None = None,
    act_scale: torch.Tensor | None = None,
    quantize_a: TensorQuant | None = None,
    a_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """C [T*K, N] = per-pair A rows @ W[e]^T (+ bias[e]) (* topk weight), standard layout.

    a:   [T, Kd] (a_div = K, GEMM1) or [T*K, Kd] (a_div = 1, GEMM2): the model dtype
         (``a.quant`` None), or the stored codes of ``a.quant`` (fp8/int8 [M, Kd], mxfp8 e4m3
         [M, Kd], nvfp4 uint8 [M, Kd/2] with logical shape [M, Kd]) with their scale ([1, 1],
         [M, 1] or [M, G]) and, for nvfp4, global scale.
    w:   [E_l, N, Kd] quantized as ``w.quant`` (or plain values, ``w.quant`` None).
    topk_weights: [T, K] float32; each row of C is multiplied by its pair's weight.
    act: GEMM1's activation in the epilogue: C [T*K, I] = act(A @ W13^T + b13) (* topk
         weight), stored in the model dtype or as ``act.quant`` codes with the static scale
         ``act_scale`` [1] or [1, 1] (see ``ActEpilogue``). ``config.block_n`` then counts C's
         columns (with ``config`` None the picked GEMM1 config gets ``gated_act_config``).
    quantize_a: A (in the model dtype) is quantized as this dynamic fp8/int8 scheme as each tile
         is loaded (``on_load_why``), with the codes and scales ``quantize_activations`` would
         give: no quantization launch, no codes in memory. Per 1 x g group: from the tile
         (BK becomes g). Per tensor: from ``a_amax``, the abs-max of A's rows that are read,
         as GEMM1's abs-max epilogue leaves it (fp32 [1] or int32 slots, ``ActEpilogue``).
         Native w8a8 weights only.
    config.block_m is replaced by ``routing.block_m`` (the tile is the aligned block).
    Rows of C that belong to no local pair keep their contents (``out``) or are
    uninitialised (a new tensor).
    """
    num_pairs = routing.num_pairs
    fmt, cfg, out_dtype, n = _prepare(a, w, bias, out_dtype, num_pairs, config, act, act_scale, quantize_a, a_amax)
    cfg = replace(cfg, block_m=routing.block_m)
    rows = a.shape[0]
    expect(rows * a_div == num_pairs, "a", f"{num_pairs // max(a_div, 1)} rows for a_div={a_div}", rows)
    if out is None:
        out = torch.empty(num_pairs, n, dtype=out_dtype, device=a.data.device)
    expect(tuple(out.shape) == (num_pairs, n), "out", f"shape {(num_pairs, n)}", tuple(out.shape))
    if act is not None and act.quant is not None:
        expect(out.dtype == out_dtype, "out", f"{out_dtype} codes for {act.quant.short}", out.dtype)
    if topk_weights is not None:
        expect(topk_weights.numel() == num_pairs, "topk_weights", f"{num_pairs} weights", tuple(topk_weights.shape))
        # the kernels read fp32, bf16 or fp16 weights as they are: no conversion launch per call
        topk_weights = topk_weights.reshape(-1)
        topk_weights = topk_weights if topk_weights.dtype in _ROUTE_DTYPES else topk_weights.float()
        topk_weights = topk_weights.contiguous()
    if not _use_kernel(a.data):

        def ref_fn(ep):
            return grouped_gemm_ref(
                a, w, routing, bias=bias, topk_weights=topk_weights, a_div=a_div, act=ep, act_scale=act_scale,
                quantize_a=quantize_a, a_amax=a_amax, dtype=torch.float32,
            )  # fmt: skip

        return _fill_from_ref(out, ref_fn, act, act_scale)
    call = GemmCall(routing, a_div=a_div, bias=bias, route_weights=topk_weights, act=act, act_scale=act_scale,
                    a_amax=a_amax)  # fmt: skip
    grouped_gemm_launch(a, w, out, fmt, cfg, call)
    return out


def grouped_gemm_batched(
    a: Operand,
    w: Operand,
    counts: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: LaunchConfig | None = None,
    act: ActEpilogue | None = None,
    act_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """C [E_l, M_max, N] = A[e] @ W[e]^T (+ bias[e]) (* row_weights[e, m]) for m < counts[e].

    a: [E_l, M_max, Kd] (its stored codes when quantized, packed [.., Kd/2] for nvfp4) with a
    scale [1, 1], [E_l, M_max, 1] or [E_l, M_max, G]; counts int32 [E_l] on the device (read
    by the kernel, never by the host). Rows past counts[e] are untouched.
    ``act``/``act_scale``: GEMM1's activation in the epilogue, as in ``grouped_gemm``.
    """
    e_l, m_max = a.shape[0], a.shape[1]
    fmt, cfg, out_dtype, n = _prepare(a, w, bias, out_dtype, e_l * m_max, config, act, act_scale)
    expect(w.shape[0] == e_l, "w", f"{e_l} experts (a is {tuple(a.shape)})", w.shape)
    expect(tuple(counts.shape) == (e_l,) and counts.dtype == torch.int32, "counts", f"int32 [{e_l}]", counts)
    counts = counts.contiguous()  # the kernel reads counts[e] at counts_ptr + e (a strided view came from EP)
    if out is None:
        out = torch.empty(e_l, m_max, n, dtype=out_dtype, device=a.data.device)
    expect(tuple(out.shape) == (e_l, m_max, n), "out", f"shape {(e_l, m_max, n)}", tuple(out.shape))
    if act is not None and act.quant is not None:
        expect(out.dtype == out_dtype, "out", f"{out_dtype} codes for {act.quant.short}", out.dtype)
    if not _use_kernel(a.data):

        def ref_fn(ep):
            return grouped_gemm_batched_ref(
                a, w, counts, bias=bias, row_weights=row_weights, act=ep, act_scale=act_scale, dtype=torch.float32
            )

        return _fill_from_ref(out, ref_fn, act, act_scale)
    route_weights = None if row_weights is None else row_weights.float()
    call = GemmCall(counts=counts, bias=bias, route_weights=route_weights, act=act, act_scale=act_scale)
    grouped_gemm_launch(a, w, out, fmt, cfg, call)
    return out


# ---- references (PyTorch, any dtype; float64 in tests) ------------------------------


def _values(x: Operand, dtype) -> torch.Tensor:
    """The real values of an operand, in ``dtype``."""
    return x.data.to(dtype) if x.quant is None else dequantize(x.q, x.quant, dtype)


def quantized_on_load_ref(a: torch.Tensor, tq: TensorQuant, a_amax: torch.Tensor | None = None) -> Operand:
    """What a GEMM with ``quantize_a=tq`` multiplies: ``a`` quantized as ``tq`` by ``quantize``,
    a per-tensor scale made from ``a_amax`` (the max of its fp32 [1] value or int32 |bits|
    slots, by the kernels' rule) rather than from every row of ``a`` (rows no pair reads may
    hold anything)."""
    if tq.granularity.kind != "tensor":
        return Operand(quantize(a, tq), tq)
    scale = scale_of_amax(a_amax, tq)
    return Operand(quantize(a, replace(tq, dynamic=False), scale=scale), tq)


def _epilogue_ref(y, bias, weights, act, dtype) -> torch.Tensor:
    """Bias, activation (``apply_activation``), router weight: the kernel's epilogue order."""
    if bias is not None:
        y = y + bias.to(dtype)
    if act is not None:
        y = apply_activation(y, act)
    if weights is not None:
        y = y * weights.to(dtype).unsqueeze(1)
    return y


def _quantize_ref(out: torch.Tensor, act: ActEpilogue | None, act_scale) -> torch.Tensor:
    """Written rows of ``out`` as the values of their static fp8/int8 codes (``act.quant``)."""
    if act is None or act.quant is None:
        return out
    written = ~out.isnan().all(dim=-1)
    out[written] = fake_quantize(out[written], act.quant, out.dtype, scale=act_scale.reshape(1, 1))
    return out


def grouped_gemm_ref(
    a: Operand,
    w: Operand,
    routing: AlignedRouting,
    *,
    bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    a_div: int = 1,
    act: ActEpilogue | None = None,
    act_scale: torch.Tensor | None = None,
    quantize_a: TensorQuant | None = None,
    a_amax: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``grouped_gemm`` from dequantized operands in ``dtype``; rows not written are NaN.

    With ``act.quant``, the values of the codes (``fake_quantize``), not the codes. With
    ``quantize_a``, A's values quantized so (``quantized_on_load_ref``)."""
    if quantize_a is not None:
        a = quantized_on_load_ref(a.data, quantize_a, a_amax)
    n = w.shape[1]
    n_out = n if act is None else act.out_cols(n)
    ad = _values(a, dtype)
    out = torch.full((routing.num_pairs, n_out), float("nan"), dtype=dtype, device=a.data.device)
    slots = routing.slot_ids().long()
    expert = routing.block_expert.long().repeat_interleave(routing.block_m)
    real = (slots < routing.num_pairs) & (expert >= 0) & (expert < w.shape[0])
    rows, ex = slots[real], expert[real]
    for e in torch.unique(ex).tolist():
        r = rows[ex == e]
        weights = None if topk_weights is None else topk_weights.reshape(-1)[r]
        # one expert's weights at a time: all of DeepSeek-V3's W13 in float64 is 60 GB
        wd = _values(Operand(w.q.select(e), w.quant), dtype)[0]
        out[r] = _epilogue_ref(ad[r // a_div] @ wd.T, None if bias is None else bias[e], weights, act, dtype)
    return _quantize_ref(out, act, act_scale)


def grouped_gemm_batched_ref(
    a: Operand,
    w: Operand,
    counts: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    act: ActEpilogue | None = None,
    act_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``grouped_gemm_batched`` from dequantized operands in ``dtype``; rows not written are NaN."""
    e_l, m_max = a.shape[0], a.shape[1]
    n = w.shape[1]
    n_out = n if act is None else act.out_cols(n)
    ad = _values(a, dtype)
    wd = _values(w, dtype)
    out = torch.full((e_l, m_max, n_out), float("nan"), dtype=dtype, device=a.data.device)
    for e, cnt in enumerate(counts.tolist()):
        cnt = min(cnt, m_max)
        weights = None if row_weights is None else row_weights[e, :cnt]
        out[e, :cnt] = _epilogue_ref(ad[e, :cnt] @ wd[e].T, None if bias is None else bias[e], weights, act, dtype)
    return _quantize_ref(out.view(e_l * m_max, n_out), act, act_scale).view(e_l, m_max, n_out)
