"""4-bit weights in the w4 layout written out in the model dtype: ``dequantize_w4(w) -> [E, N, K]``.

Prefill with many rows per expert is bound by the tensor cores, not by the weight bytes: there
the 4-bit GEMM, which unpacks its W tile in every program, ran Mixtral-8x7B MXFP4 at T = 4096
at ~370 TFLOP/s on an H200 while the bf16 layer's persistent TMA-fed GEMMs ran the same shapes
at ~610 (PERF_LOG, fourteenth session). One pass that writes the weights out in bf16 (Mixtral:
1.41 G weights, 0.7 GB read and 2.8 GB written, ~0.9 ms) then lets the bf16 GEMMs run them;
``experts.triton`` takes this per call from a measured rows-per-expert threshold
(``experts.thresholds.w4_dequant_from``).

Each value is the one the 4-bit GEMM's W operand holds (the same unpack, ``_w4_operands`` and
``_w4_unpack``): e2m1 times an e8m0 or e4m3 scale is exact in bf16; an int4 weight (c - zero)
times its scale takes one rounding to the model dtype, where the 4-bit GEMM keeps the scale's
product in fp32. NVFP4's fp32 global scale is folded in (one more rounding) or, with
``global_scale=False``, left out, so the values stay exact and a GEMM applies it to its fp32
accumulator as the 4-bit GEMM does (``experts.triton`` does, so the written-out path's NVFP4
errors are the 4-bit GEMM's: PERF_LOG, fifteenth session). Act-order weights (their columns
sorted by group in the w4 layout) are written back to the checkpoint's column order through
``perm``; K's padding is dropped.

``dequantize_w4_ref`` is the same from the reference layout in float64, rounded once.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..errors import expect
from ..quant import TensorQuant, dequantize
from ..quant.w4_layout import W4Tensor, from_w4, is_w4
from ._common import cdiv, pdl_wait
from ._grouped_gemm_w4 import _cat_k, _w4_tiles
from ._w4_operands import _w4_step_scales
from .gemm_format import _TL_DTYPE, _strides, _u8, per_expert_scale
from .grouped_gemm_w4 import ptx_16bit_unpack
from .launch import launch

# 64 W rows x 256 columns a program: 8 KB read, 32 KB written (bf16), 4 warps. Mixtral's W13
# (8 x 28672 x 4096) is 57,344 programs, ~430 per SM: a streaming pass, no reuse to tile for.
# Measured on an H200 (scripts/kbench_dequant.py, PERF_LOG fourteenth session): 2.4-2.9 TB/s of
# bytes moved (copy: 4.2); BN 16-128, BK 128-512, 4 or 8 warps all within ~10% of it, each the
# fastest somewhere; each pack block stored as one K-order tile or as its two halves apart, too.
_CONFIG = {"block_n": 64, "block_k": 256, "num_warps": 4}


@triton.jit
def _w4_dequant_kernel(
    w_ptr, ws_ptr, wz_ptr, wg_ptr, perm_ptr, out_ptr,
    N, KD, KP,
    stride_we, stride_wn, stride_wk,
    stride_wse, stride_wsn, stride_wsk,
    stride_pe, stride_pk,
    stride_oe, stride_on, stride_ok,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, PK: tl.constexpr, HAS_ZERO: tl.constexpr,
    HAS_W_GSCALE: tl.constexpr, ACT_ORDER: tl.constexpr, FAST: tl.constexpr, SPLIT: tl.constexpr,
    OP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):  # fmt: skip
    """out[e, n, col] for the BLOCK_N x BLOCK_K tile (program axes: N, K, expert) of the w4
    bytes: each pack block's low and high halves unpacked as the GEMM's W operand is, joined in
    K order, times the global scale, stored at their columns (through ``perm`` under ACT_ORDER)."""
    pdl_wait(PDL)
    e = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    k0 = tl.program_id(1) * BLOCK_K
    HALF: tl.constexpr = PK // 2
    w_base = w_ptr + e * stride_we
    ws_k, wz_k = _w4_step_scales(ws_ptr + e * stride_wse, wz_ptr + e * stride_wse, k0, stride_wsk, GROUP)
    out_rows = out_ptr + e * stride_oe + cols.to(tl.int64)[:, None] * stride_on
    gs = 1.0
    if HAS_W_GSCALE:
        gs = tl.load(wg_ptr + e)
    perm_base = perm_ptr + e * stride_pe
    for j in tl.static_range(BLOCK_K // PK):
        kb = k0 + j * PK
        lo, hi = _w4_tiles(
            w_base, ws_k, wz_k, cols, n_ok & (kb < KP), kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
            W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, BLOCK_N, OP, 1, PK, KP, j * PK, KP - k0,
        )  # fmt: skip
        _store_cols(out_rows, _cat_k(lo, hi), kb, n_ok, gs, perm_base, KD, stride_pk, stride_ok, HAS_W_GSCALE,
                    ACT_ORDER, OP)  # fmt: skip


@triton.jit
def _store_cols(
    out_rows, w, p0, n_ok, gs, perm_base, KD, stride_pk, stride_ok,
    HAS_W_GSCALE: tl.constexpr, ACT_ORDER: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    """Store ``w`` [BN, C] (stored positions p0 .. p0 + C; past KD: K's padding) times the global
    scale at its columns (through ``perm`` under ACT_ORDER)."""
    if HAS_W_GSCALE:
        w = (w.to(tl.float32) * gs).to(OP)
    pos = p0 + tl.arange(0, w.shape[1])
    col = pos
    if ACT_ORDER:
        col = tl.load(perm_base + pos * stride_pk, mask=pos < KD, other=0)
    tl.store(out_rows + col[None, :] * stride_ok, w, mask=n_ok[:, None] & (pos < KD)[None, :])


def dequantize_w4(
    w: W4Tensor, dtype: torch.dtype, *, out: torch.Tensor | None = None, global_scale: bool = True
) -> torch.Tensor:
    """The weights of ``w`` ([E, N, K], w4 layout) in ``dtype`` (bf16, fp16 or fp32), into ``out``
    when given (contiguous [E, N, K] of that dtype on w's device), times NVFP4's global scale
    unless ``global_scale`` is False. One launch (module docstring)."""
    expect(is_w4(w), "w", "a weight in the w4 layout (quant.w4_layout.to_w4)", type(w).__name__)
    expect(dtype in _TL_DTYPE, "dtype", f"one of {list(_TL_DTYPE)}", dtype)
    e, n, k = w.shape
    data = w.bytes_u8()
    if out is None:
        out = torch.empty(e, n, k, dtype=dtype, device=data.device)
    expect(
        out.shape == (e, n, k) and out.dtype == dtype and out.device == data.device and out.is_contiguous(),
        "out", f"a contiguous [{e}, {n}, {k}] {dtype} tensor on {data.device}", (tuple(out.shape), out.dtype),
    )  # fmt: skip
    if out.numel() == 0:
        return out
    wg = per_expert_scale(w.global_scale) if global_scale else None
    n_gs = None if wg is None else wg.numel()
    expect(wg is None or n_gs == e, "w.global_scale", f"one value per expert ({e})", n_gs)
    cfg = _CONFIG
    bk = max(cfg["block_k"], w.pack_block)  # whole pack blocks a program
    grid = (cdiv(n, cfg["block_n"]), cdiv(w.k_padded, bk), e)
    launch(_w4_dequant_kernel, grid,
        data, _u8(w.scale), out if w.zero is None else w.zero, out if wg is None else wg,
        out if w.perm is None else w.perm, out,
        n, k, w.k_padded, *data.stride(), *_strides(w.scale, 3),
        *(w.perm.stride() if w.perm is not None else (0, 0)), *out.stride(),
        W_FMT=w.w_fmt, GROUP=w.group_size, PK=w.pack_block, HAS_ZERO=w.zero is not None,
        HAS_W_GSCALE=wg is not None, ACT_ORDER=w.perm is not None, FAST=ptx_16bit_unpack(w, dtype),
        SPLIT=w.scale.dtype != dtype if w.w_fmt == "int4" else not w.e2m1_one_mul,
        OP=_TL_DTYPE[dtype], BLOCK_N=cfg["block_n"], BLOCK_K=bk, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def dequantize_w4_ref(w: W4Tensor, tq: TensorQuant, dtype: torch.dtype, global_scale: bool = True) -> torch.Tensor:
    """``dequantize_w4``'s values from the reference layout (``from_w4``): float64, rounded once to
    ``dtype``."""
    q = from_w4(w)
    if not global_scale and q.global_scale is not None:
        q = replace(q, global_scale=torch.ones_like(q.global_scale))
    return dequantize(q, tq, torch.float64).to(dtype)
