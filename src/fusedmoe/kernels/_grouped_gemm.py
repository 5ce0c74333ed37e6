"""The fused MoE grouped GEMM (see ``grouped_gemm.py`` for the contract).

One program computes a BM x BN tile of C = A_rows @ W[e]^T for one expert e:

    standard layout: the tile's rows are the BM slots of one aligned block;
                     expert e = block_expert[b] (-1: nothing to do), A row =
                     sorted_id // a_div, C row = sorted_id (padding slots: none);
                     with PAIR_BLOCKS block b is pair b alone (no sorted_ids)
    batched layout:  rows m0..m0+BM of expert e's [M_max, K] slab, up to counts[e]

Operands meet in one of three ways (constexprs ``NATIVE`` and ``FMA``):

* w8a8 (fp8 x fp8, int8 x int8), BM >= 16: the stored bytes go to ``tl.dot``; scales
  that vary along K (1 x g activation groups, bn x bk weight blocks) multiply each
  K step's partial product (BK divides the group, so one scale per step; where the
  tile's W rows lie in one weight block, one FFMA per element: ``_mac``), the
  others (tensor, token, channel) multiply the accumulator once at the end.
* everything else, BM >= 16: both tiles are dequantized in registers to DOT_DTYPE (the
  model dtype, bf16 for quantized activations, fp32 under the interpreter whose
  bf16 dot is wrong) with per-K scales folded in; e2m1 x e8m0/e4m3 and e4m3 x
  e8m0 products are exact in bf16, so only int4 and folded fp8/int8 group
  scales round there. Tensor/channel/global scales multiply at the end.
  W is dequantized in its stored [BN, BK] orientation (K contiguous) and
  transposed for the dot; 4-bit codes come from whole-byte loads split with
  join/reshape: loading each nibble's byte as a [BK, BN] tile ran 17x slower
  (int4, 16 tokens, E 64, N 1536, K 2048 on an H100: 1411 vs 82 us).
* decode tiles, BM < 16 (``FMA = BLOCK_M < 16``: block_m 1, 2, 4 or 8), every format: no
  tensor cores. Why: ``tl.dot`` needs 16 rows, so at decode (about 1 row per expert) 15 of
  them were padding, and the transpose, the bf16 round trip and the dot-operand layout
  conversions of the dequantized W tile made the 4-bit paths latency/ALU-bound: Mixtral-8x7B
  int4 at T = 1 took 0.230 ms on an H100 against a 0.062 ms memory floor, no faster than
  bf16 (0.289 ms). Here W is dequantized as stored, [BN, BK] with K contiguous, by the same
  ``_w_tile`` code, and kept in fp32 (no cast, no transpose); A is dequantized to fp32; per-K
  scales are folded into both tiles as above (w8a8 too: both sides become fp32, so products
  are exact and sums fp32; the other scales still multiply at the end). Each of the BM A rows
  is then broadcast against the W tile and reduced over K (``_fma_rows``), and BM = 1 drops
  moe_align's padding rows. Measured on an H100 (tuner, 2026-11-22): BM 1, BN 32, BK 256 won
  every 4-bit GEMM at T = 1 by 1.2-1.7x over the BM 16 dot tile (the layer: Mixtral int4 230 ->
  169 us), reaching 1.2-1.4 TB/s of the 4-bit bytes. Everything after the K loop is shared.

Then bias, then the router weight, then one store in C's dtype.

A quantized on load (constexpr ``A_ON_LOAD``, ``grouped_gemm(quantize_a=...)``): A comes in the
model dtype and each tile becomes the codes ``act_quant`` would have written (``_quantize_a``):
per tensor with the scale of an abs-max GEMM1 left (``_amax_scale``), per 1 x BK group with the
tile row's own. Division by a per-scale reciprocal with one fma correction (``quotient_rcp``): a
div_rn per element made a decode K step ~10x longer (Qwen3-30B-A3B's GEMM2 at T = 1 on an H200,
the layer 35.8 -> 49.1 us; 33.8 with the reciprocal). The codes then meet W as stored codes do;
the FMA path takes their values with the scale folded in.

GEMM1 with the activation in its epilogue (constexpr ``ACT``, ``grouped_gemm(act=...)``):
C is the [M, I] activation output and BN counts its columns. For a gated activation
the program multiplies the same A tile by the gate rows and the up rows of W13 that
output columns n feed (n and I + n, or 2n and 2n + 1 when interleaved) into two
accumulators, finishes each (scales, bias), applies the activation in fp32 (the same
``_common.apply_act`` as the activation kernel), then the router weight, then stores C
in the model dtype (its abs-max tracked for a dynamic scale: an atomic max, or one slot per
program, ``ActEpilogue``) or quantized with a static per-tensor scale (``OUT_QUANT``). The
[M, 2I] intermediate never reaches memory, so it is never rounded to the model dtype
either: the unfused path rounds it once, the fused one does not (closer to the float64
reference by that rounding).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._act_quant import _abs_bits, _scale_of, max_abs_bits
from ._common import (
    apply_act,
    e2m1_to_f32,
    e8m0_to_f32,
    linear_codes,
    pdl_wait,
    quant_linear,
    quotient_rcp,
    unpack_nibbles,
)


@triton.jit
def _decode_scale(s, FMT: tl.constexpr):
    """A stored scale as float32: e8m0 codes for MX formats, e4m3 (as uint8) for NVFP4, else fp32."""
    if FMT == "mxfp8" or FMT == "mxfp4":
        return e8m0_to_f32(s)
    elif FMT == "nvfp4":
        return s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return s.to(tl.float32)


@triton.jit
def _k_scales(
    row_ptrs, row_ok, k0, KD, stride_k, FMT: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr
):
    """fp32 scales of an [R, BLOCK_K] tile at column k0 whose columns share one per GROUP.

    Shaped to broadcast against the tile: [R, 1] when a K step lies in one group, else
    [R, BLOCK_K] from BLOCK_K / GROUP loads per row (a gather only for groups that are
    not a power of 2 apart from BLOCK_K).
    """
    if GROUP % BLOCK_K == 0:
        s = tl.load(row_ptrs + (k0 // GROUP) * stride_k, mask=row_ok, other=0)
        return _decode_scale(s, FMT)[:, None]
    elif BLOCK_K % GROUP == 0:
        NG: tl.constexpr = BLOCK_K // GROUP
        g = k0 // GROUP + tl.arange(0, NG)
        s = tl.load(
            row_ptrs[:, None] + g[None, :] * stride_k, mask=row_ok[:, None] & (g * GROUP < KD)[None, :], other=0
        )
        s = _decode_scale(s, FMT)
        return tl.reshape(tl.broadcast_to(s[:, :, None], [R, NG, GROUP]), [R, BLOCK_K])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (offs_k < KD)[None, :]
        return _decode_scale(
            tl.load(row_ptrs[:, None] + (offs_k // GROUP)[None, :] * stride_k, mask=mask, other=0), FMT
        )


@triton.jit
def _w_tile(
    w_base,
    ws_base,
    wz_base,
    g_base,
    cols,
    col_ok,
    k0,
    offs_k,
    k_ok,
    KD,
    num_groups,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_gk,
    W_FMT: tl.constexpr,
    W_BN: tl.constexpr,
    W_BK: tl.constexpr,
    ACT_ORDER: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    NATIVE: tl.constexpr,
    FMA: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W[e] rows ``cols`` (W stored [N, K]) at K step k0 as an operand.

    Dot path: the [BK, BN] dot operand, the stored bytes (NATIVE) or the values dequantized
    to DOT_DTYPE with per-K scales folded in. FMA: the dequantized fp32 values as stored,
    [BN, BK] (every format takes the dequantizing branch; NATIVE is False there)."""
    # 82 lines: one @triton.jit helper with a constexpr branch per weight format (float, fp8/int8, int4, MXFP4, NVFP4,
    # act-order); only one branch is compiled per launch.
    W_PACKED: tl.constexpr = W_FMT == "int4" or W_FMT == "mxfp4" or W_FMT == "nvfp4"
    if (NATIVE or W_FMT == "float") and not FMA:
        b = tl.load(
            w_base + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0,
        )
        if W_FMT == "fp8":
            b = b.to(tl.float8e4nv, bitcast=True)
        if not NATIVE:
            b = b.to(DOT_DTYPE)
    else:
        # Dequantized as stored, [BN, BK] with K contiguous (vector loads of whole bytes),
        # then transposed for the dot (FMA: used as it is, in fp32).
        w_rows = w_base + cols * stride_wn
        if W_PACKED:
            wt = unpack_nibbles(w_rows, col_ok, k0, KD, stride_wk, BLOCK_N, BLOCK_K)
            if W_FMT == "int4":
                wt = wt.to(tl.float32)
            else:
                wt = e2m1_to_f32(wt)
        else:
            wt = tl.load(w_rows[:, None] + offs_k[None, :] * stride_wk, mask=col_ok[:, None] & k_ok[None, :], other=0)
            if W_FMT == "fp8":
                wt = wt.to(tl.float8e4nv, bitcast=True)
            wt = wt.to(tl.float32)
        if W_BK > 0:
            ws_rows = ws_base + (cols // W_BN) * stride_wsn
            wz_rows = wz_base + (cols // W_BN) * stride_wsn
            if ACT_ORDER:
                # a group id outside [0, num_groups) reads no scale (its columns count 0): the
                # weights' checks refuse such a g_idx, this keeps the loads in bounds regardless
                gk = tl.load(g_base + offs_k * stride_gk, mask=k_ok, other=0)
                g_mask = col_ok[:, None] & (k_ok & (gk >= 0) & (gk < num_groups))[None, :]
                s_w = _decode_scale(tl.load(ws_rows[:, None] + gk[None, :] * stride_wsk, mask=g_mask, other=0), W_FMT)
                if HAS_ZERO:
                    wt -= tl.load(wz_rows[:, None] + gk[None, :] * stride_wsk, mask=g_mask, other=0).to(tl.float32)
            else:
                s_w = _k_scales(ws_rows, col_ok, k0, KD, stride_wsk, W_FMT, W_BK, BLOCK_N, BLOCK_K)
                if HAS_ZERO:
                    wt -= _k_scales(wz_rows, col_ok, k0, KD, stride_wsk, "zero", W_BK, BLOCK_N, BLOCK_K)
            if W_FMT == "int4" and not HAS_ZERO:
                wt -= 8.0
            wt = wt * s_w
        if FMA:
            b = wt
        else:
            b = tl.trans(wt.to(DOT_DTYPE))
    return b


@triton.jit
def _fma_rows(acc, acc_u, a, w, w_u, GATED: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc [BM, BN] + a [BM, BK] @ w [BN, BK]^T in fp32 without tensor cores (BM < 16), and
    acc_u + a @ w_u^T (the up rows) under a gated activation.

    One A row at a time: row r (a select-and-sum over the BM rows) is broadcast along W's
    rows, multiplied, reduced over K, and the [BN] result lands in row r of acc. Register
    use, from ptxas for sm_90 on offline compiles of this kernel (4 warps, 3 stages):

    * the dequantized W tile stays in registers for all BM rows, and a broadcast row costs
      each thread only the K values its W elements meet, dying after its row; a 3-D
      [BM, BN, BK] broadcast product instead holds BM products at once: bf16, BN 64, BK 128
      spilled from BM 4 (255 registers + 360 B; BM 8: + 2214 B) where this loop takes 128
      (BM 8: 157);
    * gate and up share one pass over A: a pass each kept every broadcast row live from the
      first to the second (int4 g128 silu, BN 32, BK 128: BM 4 230 vs 132, BM 8 spilled
      3 KB vs 159);
    * BM = 1 takes its row by a 1-D reshape, whose layout the compiler chooses freely: bf16
      BN 64 BK 256 needed 96 registers, 168 with the 2-D row.
    """
    rows = tl.arange(0, BLOCK_M)[:, None]
    for r in tl.static_range(BLOCK_M):
        if BLOCK_M == 1:
            a_r = tl.reshape(a, [a.shape[1]])[None, :]
        else:
            a_r = tl.sum(tl.where(rows == r, a, 0.0), axis=0)[None, :]
        acc = tl.where(rows == r, acc + tl.sum(w * a_r, axis=1)[None, :], acc)
        if GATED:
            acc_u = tl.where(rows == r, acc_u + tl.sum(w_u * a_r, axis=1)[None, :], acc_u)
    return acc, acc_u


@triton.jit
def _mac(
    acc,
    a,
    b,
    as_row_ptr,
    row_ok,
    ws_base,
    cols,
    col_ok,
    col0,
    k0,
    stride_ask,
    stride_wsn,
    stride_wsk,
    W_FMT: tl.constexpr,
    A_GROUP: tl.constexpr,
    W_BN: tl.constexpr,
    W_BK: tl.constexpr,
    W_UNIFORM: tl.constexpr,
    NATIVE: tl.constexpr,
    INT_ACC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    s_a_tile,
    A_ON_LOAD: tl.constexpr,
):
    """acc + a @ b (tl.dot) for W rows ``cols`` (the first: ``col0``), with native w8a8's per-K
    scales on the partial product (A's group scales: loaded, or ``s_a_tile`` [BM] where the
    kernel quantized A as it loaded it, ``_quantize_a``). W_UNIFORM: the rows lie in one W_BN
    block (``block_uniform``), so the step's weight scale is one scalar and the scaled add is one
    FFMA per element, with the row scale times that scalar made once per row; else a [BN] scale
    vector, an FMUL and an FFMA per element (sm_90 SASS of a 128 x 128 fp8-block tile: 64 FMUL +
    64 FFMA per thread a step)."""
    if NATIVE and (A_GROUP > 0 or W_BK > 0):
        if W_FMT == "int8":
            part = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
        else:
            part = tl.dot(a, b)
        if A_GROUP > 0:
            if A_ON_LOAD:
                s_a = s_a_tile
            else:
                s_a = tl.load(as_row_ptr + (k0 // A_GROUP) * stride_ask, mask=row_ok, other=0)
        if W_UNIFORM:
            s = tl.load(ws_base + (col0 // W_BN) * stride_wsn + (k0 // W_BK) * stride_wsk)
            if A_GROUP > 0:
                s = s_a * s
                acc += part * s[:, None]
            else:
                acc += part * s
        else:
            if A_GROUP > 0:
                part *= s_a[:, None]
            if W_BK > 0:
                s_blk = tl.load(ws_base + (cols // W_BN) * stride_wsn + (k0 // W_BK) * stride_wsk, mask=col_ok, other=0)
                part *= s_blk[None, :]
            acc += part
    elif INT_ACC:
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    elif DOT_DTYPE == tl.float32:
        # fp32 operands (fp32 models, the interpreter): full precision, not tf32 (~1e-3).
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _scale_and_bias(
    acc,
    as_row_ptr,
    row_ok,
    ws_base,
    w_gscale_ptr,
    a_gscale_ptr,
    bias_ptr,
    e,
    cols,
    col_ok,
    stride_age,
    stride_wsn,
    stride_be,
    stride_bn,
    A_FMT: tl.constexpr,
    A_GROUP: tl.constexpr,
    W_FMT: tl.constexpr,
    W_BK: tl.constexpr,
    HAS_A_GSCALE: tl.constexpr,
    HAS_W_GSCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """fp32 acc of W rows ``cols`` times the scales not folded per K step, plus the bias."""
    acc = acc.to(tl.float32)
    if (A_FMT == "fp8" or A_FMT == "int8") and A_GROUP == 0:
        acc *= tl.load(as_row_ptr, mask=row_ok, other=0)[:, None]
    if W_FMT != "float" and W_BK == 0:
        acc *= tl.load(ws_base + cols * stride_wsn, mask=col_ok, other=0)[None, :]
    if HAS_W_GSCALE:
        acc *= tl.load(w_gscale_ptr + e)
    if HAS_A_GSCALE:
        acc *= tl.load(a_gscale_ptr + e * stride_age)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + cols * stride_bn, mask=col_ok, other=0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _gate_up_cols(offs_n, N, GATED: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(gate rows, up rows) of W that output columns ``offs_n`` read: under a gated ACT n and
    N + n, or 2n and 2n + 1 when interleaved; else the columns' own rows (and no up rows: the
    second is ``offs_n`` again, never read)."""
    if GATED and INTERLEAVED:
        g_cols = 2 * offs_n
        u_cols = g_cols + 1
    elif GATED:
        g_cols = offs_n
        u_cols = offs_n + N
    else:
        g_cols = offs_n
        u_cols = offs_n
    return g_cols, u_cols


@triton.jit
def _w_step(
    acc, a, cols, n_ok, col0, k0, offs_k, k_ok, KD, num_w_groups, w_base, ws_base, wz_base, g_base, as_row_ptr,
    row_ok, stride_wn, stride_wk, stride_wsn, stride_wsk, stride_gk, stride_ask,
    W_FMT: tl.constexpr, A_GROUP: tl.constexpr, W_BN: tl.constexpr, W_BK: tl.constexpr, W_UNIFORM: tl.constexpr,
    ACT_ORDER: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_DOT: tl.constexpr, INT_ACC: tl.constexpr,
    FMA: tl.constexpr, OP_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, s_a_tile,
    A_ON_LOAD: tl.constexpr,
):  # fmt: skip
    """One K step of the W rows ``cols`` (the gate rows, or the up rows): (their tile, ``acc``).
    The dot path multiplies the tile into ``acc`` here; the FMA path leaves ``acc`` as it is and
    multiplies the gate and up tiles together afterwards (``_fma_rows``)."""
    b = _w_tile(
        w_base, ws_base, wz_base, g_base, cols, n_ok, k0, offs_k, k_ok, KD, num_w_groups,
        stride_wn, stride_wk, stride_wsn, stride_wsk, stride_gk,
        W_FMT, W_BN, W_BK, ACT_ORDER, HAS_ZERO, NATIVE_DOT, FMA, OP_DTYPE, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if not FMA:
        acc = _mac(
            acc, a, b, as_row_ptr, row_ok, ws_base, cols, n_ok, col0, k0, stride_ask, stride_wsn, stride_wsk,
            W_FMT, A_GROUP, W_BN, W_BK, W_UNIFORM, NATIVE_DOT, INT_ACC, OP_DTYPE, s_a_tile, A_ON_LOAD,
        )  # fmt: skip
    return b, acc


@triton.jit
def _act_epilogue(
    acc, acc_u, e, g_cols, u_cols, n_ok, row_ok, rw_rows, as_row_ptr, ws_base, w_gscale_ptr, a_gscale_ptr, bias_ptr,
    route_w_ptr, alpha, limit, stride_age, stride_wsn, stride_be, stride_bn, stride_re, stride_rm,
    A_FMT: tl.constexpr, A_GROUP: tl.constexpr, W_FMT: tl.constexpr, W_BK: tl.constexpr, HAS_A_GSCALE: tl.constexpr,
    HAS_W_GSCALE: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ACT: tl.constexpr,
    GATED: tl.constexpr,
):  # fmt: skip
    """The epilogue before the store, as both grouped-GEMM kernels run it (this one and
    ``_grouped_gemm_persistent``): the remaining scales and the bias of the gate (and up)
    accumulator, the activation, the router weight of rows ``rw_rows``. fp32 [BM, BN]."""
    acc = _scale_and_bias(
        acc, as_row_ptr, row_ok, ws_base, w_gscale_ptr, a_gscale_ptr, bias_ptr, e, g_cols, n_ok,
        stride_age, stride_wsn, stride_be, stride_bn,
        A_FMT, A_GROUP, W_FMT, W_BK, HAS_A_GSCALE, HAS_W_GSCALE, HAS_BIAS,
    )  # fmt: skip
    if GATED:
        up = _scale_and_bias(
            acc_u, as_row_ptr, row_ok, ws_base, w_gscale_ptr, a_gscale_ptr, bias_ptr, e, u_cols, n_ok,
            stride_age, stride_wsn, stride_be, stride_bn,
            A_FMT, A_GROUP, W_FMT, W_BK, HAS_A_GSCALE, HAS_W_GSCALE, HAS_BIAS,
        )  # fmt: skip
        acc = apply_act(acc, up, alpha, limit, ACT)
    else:
        acc = apply_act(acc, acc, alpha, limit, ACT)
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(route_w_ptr + e * stride_re + rw_rows * stride_rm, mask=row_ok, other=0)
        acc *= rw.to(tl.float32)[:, None]  # fp32, bf16 or fp16 router weights (as the router gave them)
    return acc


@triton.jit
def _amax_scale(amax_ptr, n, QUANT: tl.constexpr):
    """A's per-tensor dynamic scale (``A_ON_LOAD``) from its abs-max held as ``n`` int32 |bits|
    values (``max_abs_bits``): the scale ``act_quant``'s codes pass makes of it, NaN kept."""
    return _scale_of(max_abs_bits(amax_ptr, n).to(tl.float32, bitcast=True), QUANT)


@triton.jit
def _quantize_a(a, s_t, r_t, A_FMT: tl.constexpr, A_GROUP: tl.constexpr, EXACT_CAST: tl.constexpr):
    """An A tile [BM, BK] loaded in the model dtype, quantized as ``quant.linear`` (and
    ``act_quant``) quantize it: (its codes, as the dot takes them, e4m3 or int8; the scale of
    each row's codes [BM]). The scale is ``s_t`` (per tensor, ``_amax_scale``; ``r_t`` =
    div_rn(1, s_t)) or, A_GROUP > 0, the row's own 1 x A_GROUP group scale, from the tile
    (BK == A_GROUP: a tile holds one group of each row). Masked elements load as 0: they
    leave a group's abs-max unchanged, and a padding row gets scale 1 and zero codes."""
    v = a.to(tl.float32)
    if A_GROUP > 0:
        s = _scale_of(tl.max(_abs_bits(v), axis=1).to(tl.float32, bitcast=True), A_FMT)
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    else:
        s = tl.zeros([v.shape[0]], dtype=tl.float32) + s_t
        r = tl.zeros([v.shape[0]], dtype=tl.float32) + r_t
    # division by multiplication (quotient_rcp): a div_rn per element made the step ~10x longer
    q = linear_codes(quotient_rcp(v, s[:, None], r[:, None], EXACT_CAST), A_FMT, EXACT_CAST)
    if A_FMT == "fp8":
        q = q.to(tl.float8e4nv, bitcast=True)
    return q, s


@triton.jit
def _tile_abs_max(v, mask):
    """int32 |bits| max (``_abs_bits``) of the stored values ``v`` (cast back to fp32) where ``mask``."""
    return tl.max(tl.max(tl.where(mask, _abs_bits(v.to(tl.float32)), 0), axis=1), axis=0)


@triton.jit
def _store_c(c_ptrs, acc, c_mask, c_scale_ptr, OUT_QUANT: tl.constexpr, EXACT_CAST: tl.constexpr):
    """Store the fp32 tile ``acc`` as C: in C's dtype ("none"); in C's dtype with the abs-max of
    the stored values raised into ``c_scale_ptr`` ("amax", ``ActEpilogue.track_amax``: an integer
    max of |bits|, order-free and NaN-keeping as ``act_quant``'s first pass); or as static fp8 /
    int8 codes of the scale at ``c_scale_ptr``."""
    if OUT_QUANT == "none" or OUT_QUANT == "amax":
        v = acc.to(c_ptrs.dtype.element_ty)
        tl.store(c_ptrs, v, mask=c_mask)
        if OUT_QUANT == "amax":
            tile = _tile_abs_max(v, c_mask)
            # relaxed: nothing in this launch reads the buffer (the next launch does, after the
            # kernel boundary), and the default acq_rel fence would wait for the persistent
            # kernel's loads of its next tile already in flight
            tl.atomic_max(c_scale_ptr.to(tl.pointer_type(tl.int32)), tile, sem="relaxed")
    else:
        tl.store(c_ptrs, quant_linear(acc, tl.load(c_scale_ptr), OUT_QUANT, EXACT_CAST), mask=c_mask)


@triton.jit
def _no_rows(c_scale_ptr, pid, OUT_QUANT: tl.constexpr):
    """A program with no rows to compute: under "amax_slots" its abs-max slot still gets a 0
    (the slots are never zeroed; each launch writes every one of them)."""
    if OUT_QUANT == "amax_slots":
        tl.store(c_scale_ptr.to(tl.pointer_type(tl.int32)) + pid, 0)


# num_experts only bounds pair-block ids: not specialised, so a binary serves any E (the tuner's
# workers compile with 2 experts' weights what the main process runs with E)
@triton.jit(do_not_specialize=["num_experts"])
def _grouped_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    a_gscale_ptr,
    w_ptr,
    w_scale_ptr,
    w_zero_ptr,
    w_gscale_ptr,
    w_gidx_ptr,
    bias_ptr,
    route_w_ptr,
    c_ptr,
    c_scale_ptr,  # OUT_QUANT "fp8"/"int8": C's static fp32 scale [1], read; "amax": C's abs-max [1], raised
    sorted_ids_ptr,
    block_expert_ptr,
    counts_ptr,
    N,  # columns of C (I under a gated ACT, whose W has 2N rows)
    KD,
    num_w_groups,  # ACT_ORDER: scale groups along K (g_idx entries must be below it)
    num_pairs,
    a_div,
    m_max,
    blocks_per_expert,
    num_m_blocks,
    num_experts,  # E_l: PAIR_BLOCKS skips a block whose id is outside [0, E_l)
    num_a_amax,  # A_ON_LOAD per tensor: int32 abs-max values at a_scale_ptr (_amax_scale)
    alpha,
    limit,
    stride_ae,
    stride_am,
    stride_ak,
    stride_ase,
    stride_asm,
    stride_ask,
    stride_age,
    stride_we,
    stride_wn,
    stride_wk,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_ge,
    stride_gk,
    stride_be,
    stride_bn,
    stride_re,
    stride_rm,
    stride_ce,
    stride_cm,
    stride_cn,
    BATCHED: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,  # standard layout: block b is pair b alone (AlignedRouting.pair_blocks)
    A_FMT: tl.constexpr,  # "float" | "fp8" | "int8" | "mxfp8" | "nvfp4"
    A_GROUP: tl.constexpr,  # 0: one scale per row (tensor/token), else 1 x A_GROUP groups
    A_ON_LOAD: tl.constexpr,  # A comes in the model dtype and is quantized as A_FMT / A_GROUP when loaded
    W_FMT: tl.constexpr,  # "float" | "fp8" | "int8" | "int4" | "mxfp4" | "nvfp4"
    W_BN: tl.constexpr,  # 0, 0: one scale per column (tensor/channel); else W_BN x W_BK blocks
    W_BK: tl.constexpr,
    W_UNIFORM: tl.constexpr,  # a tile's W rows lie in one W_BN block: one weight scale per K step (_mac)
    ACT_ORDER: tl.constexpr,  # the group of W column k is g_idx[e, k], not k // W_BK
    HAS_ZERO: tl.constexpr,  # int4 zero points (else the symmetric 8)
    HAS_A_GSCALE: tl.constexpr,
    HAS_W_GSCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    NATIVE: tl.constexpr,  # w8a8: the stored bytes feed tl.dot (BM >= 16)
    DOT_DTYPE: tl.constexpr,
    ACT: tl.constexpr,  # "none" | an Activation value, applied in the epilogue
    GATED: tl.constexpr,  # ACT takes a gate and an up row (Activation.is_gated)
    INTERLEAVED: tl.constexpr,  # gated ACT: gate/up are W rows 2n, 2n+1 (else n, N + n)
    OUT_QUANT: tl.constexpr,  # "none" | "amax" / "amax_slots" (abs-max tracked) | "fp8" | "int8" (c_scale_ptr's scale)
    EXACT_CAST: tl.constexpr,  # the interpreter: encode fp8 by hand (see _common.e4m3_bits)
    BLOCK_M: tl.constexpr,  # < 16: the FMA path (module docstring)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    # Walk GROUP_M row tiles per column tile so consecutive programs share W[e] in L2.
    # 173 lines: one Triton kernel whose signature is the pointers and strides of every operand; address set-up, K
    # loop and epilogue are @triton.jit helpers, what is left is their wiring.
    pdl_wait(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    if BATCHED:
        e = pid_m // blocks_per_expert
        m0 = (pid_m % blocks_per_expert) * BLOCK_M
        count = tl.minimum(tl.load(counts_ptr + e), m_max)
        if m0 >= count:
            _no_rows(c_scale_ptr, pid, OUT_QUANT)
            return
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < count
        a_rows = offs_m.to(tl.int64)
        c_rows = a_rows
    elif PAIR_BLOCKS:
        e = tl.load(block_expert_ptr + pid_m)  # the pair's own expert id, unchecked
        if (e < 0) | (e >= num_experts):
            _no_rows(c_scale_ptr, pid, OUT_QUANT)
            return
        ids = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
        row_ok = ids < num_pairs
        a_rows = (ids // a_div).to(tl.int64)
        c_rows = ids.to(tl.int64)
    else:
        e = tl.load(block_expert_ptr + pid_m)
        if e < 0:
            _no_rows(c_scale_ptr, pid, OUT_QUANT)
            return
        ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = ids < num_pairs
        a_rows = (ids // a_div).to(tl.int64)
        c_rows = ids.to(tl.int64)
    e = e.to(tl.int64)

    # Output columns offs_n; a gated ACT pairs each with a gate and an up row of W, both
    # multiplied by the same A tile into two accumulators.
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    g_cols, u_cols = _gate_up_cols(offs_n, N, GATED, INTERLEAVED)
    g0, u0 = _gate_up_cols(pid_n * BLOCK_N, N, GATED, INTERLEAVED)  # the first of each (W_UNIFORM)
    a_row_ptr = a_ptr + e * stride_ae + a_rows * stride_am
    as_row_ptr = a_scale_ptr + e * stride_ase + a_rows * stride_asm
    w_base = w_ptr + e * stride_we
    ws_base = w_scale_ptr + e * stride_wse
    wz_base = w_zero_ptr + e * stride_wse  # zero points share the scale's shape and strides
    g_base = w_gidx_ptr + e * stride_ge
    A_PACKED: tl.constexpr = A_FMT == "nvfp4"
    A_PER_K: tl.constexpr = A_GROUP > 0
    # Decode tiles multiply in fp32 without tensor cores; w8a8 is dequantized there too.
    FMA: tl.constexpr = BLOCK_M < 16
    NATIVE_DOT: tl.constexpr = NATIVE and not FMA
    OP_DTYPE: tl.constexpr = tl.float32 if FMA else DOT_DTYPE
    INT_ACC: tl.constexpr = NATIVE_DOT and W_FMT == "int8" and not A_PER_K and not W_BK > 0
    if INT_ACC:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = acc  # the up rows' accumulator, carried through the loop only under a gated ACT
    s_t = 1.0  # A_ON_LOAD per tensor: A's scale, from the abs-max GEMM1 left, and its reciprocal
    r_t = 1.0
    if A_ON_LOAD and A_GROUP == 0:
        s_t = _amax_scale(a_scale_ptr.to(tl.pointer_type(tl.int32)), num_a_amax, A_FMT)
        r_t = tl.math.div_rn(1.0, s_t)

    for k0 in range(0, KD, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < KD
        # ---- A tile [BM, BK]
        if A_PACKED:
            a = e2m1_to_f32(unpack_nibbles(a_row_ptr, row_ok, k0, KD, stride_ak, BLOCK_M, BLOCK_K))
        else:
            a = tl.load(a_row_ptr[:, None] + offs_k[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0)
            if (A_FMT == "fp8" or A_FMT == "mxfp8") and not A_ON_LOAD:
                a = a.to(tl.float8e4nv, bitcast=True)  # e4m3 arrives as uint8: masked loads need other=0
        s_a = s_t
        if A_ON_LOAD:
            # codes for the dot (their group scale goes to _mac, a tensor scale to the end);
            # FMA multiplies in fp32: the codes' values, scale folded in
            a, s_a = _quantize_a(a, s_t, r_t, A_FMT, A_GROUP, EXACT_CAST)
            if not NATIVE_DOT:
                a = (a.to(tl.float32) * s_a[:, None]).to(OP_DTYPE)
        elif not NATIVE_DOT:
            if A_PER_K:
                s_a = _k_scales(as_row_ptr, row_ok, k0, KD, stride_ask, A_FMT, A_GROUP, BLOCK_M, BLOCK_K)
                a = (a.to(tl.float32) * s_a).to(OP_DTYPE)
            else:
                a = a.to(OP_DTYPE)
        # ---- W tile(s) and multiply-accumulate: the dot path multiplies each [BK, BN] tile as
        # it comes; FMA dequantizes the [BN, BK] gate (and up) tiles, then makes one pass over
        # A's rows for both accumulators (_fma_rows)
        b, acc = _w_step(
            acc, a, g_cols, n_ok, g0, k0, offs_k, k_ok, KD, num_w_groups, w_base, ws_base, wz_base, g_base,
            as_row_ptr, row_ok, stride_wn, stride_wk, stride_wsn, stride_wsk, stride_gk, stride_ask,
            W_FMT, A_GROUP, W_BN, W_BK, W_UNIFORM, ACT_ORDER, HAS_ZERO, NATIVE_DOT, INT_ACC, FMA, OP_DTYPE, BLOCK_N,
            BLOCK_K, s_a, A_ON_LOAD,
        )  # fmt: skip
        b_u = b
        if GATED:
            b_u, acc_u = _w_step(
                acc_u, a, u_cols, n_ok, u0, k0, offs_k, k_ok, KD, num_w_groups, w_base, ws_base, wz_base, g_base,
                as_row_ptr, row_ok, stride_wn, stride_wk, stride_wsn, stride_wsk, stride_gk, stride_ask,
                W_FMT, A_GROUP, W_BN, W_BK, W_UNIFORM, ACT_ORDER, HAS_ZERO, NATIVE_DOT, INT_ACC, FMA, OP_DTYPE,
                BLOCK_N, BLOCK_K, s_a, A_ON_LOAD,
            )  # fmt: skip
        if FMA:
            acc, acc_u = _fma_rows(acc, acc_u, a, b, b_u, GATED, BLOCK_M)

    # ---- epilogue: remaining scales, bias, activation, router weight, store (quantized)
    A_END_FMT: tl.constexpr = "float" if A_ON_LOAD else A_FMT  # A's scales, if any left, at the end
    if A_ON_LOAD and NATIVE_DOT and A_GROUP == 0:
        acc = acc.to(tl.float32) * s_t
        acc_u = acc_u.to(tl.float32) * s_t
    acc = _act_epilogue(
        acc, acc_u, e, g_cols, u_cols, n_ok, row_ok, c_rows, as_row_ptr, ws_base, w_gscale_ptr, a_gscale_ptr, bias_ptr,
        route_w_ptr, alpha, limit, stride_age, stride_wsn, stride_be, stride_bn, stride_re, stride_rm,
        A_END_FMT, A_GROUP, W_FMT, W_BK, HAS_A_GSCALE, HAS_W_GSCALE, HAS_BIAS, MUL_ROUTED_WEIGHT, ACT, GATED,
    )  # fmt: skip
    c_ptrs = c_ptr + e * stride_ce + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_ok[:, None] & n_ok[None, :]
    STORE: tl.constexpr = "none" if OUT_QUANT == "amax_slots" else OUT_QUANT
    _store_c(c_ptrs, acc, c_mask, c_scale_ptr, STORE, EXACT_CAST)
    if OUT_QUANT == "amax_slots":
        # this program's abs-max in its own slot: no atomic, and no zeroed buffer (every program
        # writes its slot, _no_rows where it has no rows); the next launch reads the slots' max
        tile = _tile_abs_max(acc.to(c_ptrs.dtype.element_ty), c_mask)
        tl.store(c_scale_ptr.to(tl.pointer_type(tl.int32)) + pid, tile)
