"""Triton kernels of ``act_quant.py``: activation (optional) + dynamic quantization of rows.

One kernel, ``_act_quant_kernel``; a program owns BM rows and BK output columns
(token scales: all columns, in two sweeps, the first for the row amax). Values
are computed in fp32 from the input and quantized exactly as ``fusedmoe.quant``
does: the same fp32 operations in the same order, IEEE division (``div_rn``; a
plain ``/`` is approximate on NVIDIA GPUs: 30% of 1M random fp32 quotients came out
1 ulp off on an H200), round half to even. A dynamic scale's quotients are taken by the
scale's reciprocal with one fma correction where every scale of the tile is a normal float
(``_common.quant_linear_dyn``: the same IEEE quotient in a fifth of the instructions).

Per-tensor dynamic scales take two launches over the same grid (CUDA-graph safe:
a memset, two kernels, no host sync): PASS 1 folds each tile's amax into one fp32
with ``atomic_max``, PASS 2 reads it and quantizes. A tensor that one tile holds (decode: x
and a2 at T = 1) takes one program instead (PASS 0, ``_tensor_dyn_one``): one load of the
tile, its amax, its codes, in one launch without the memset; same scale, same codes.

NaN policy (``fusedmoe.quant``'s): a NaN makes the fp8/int8 scale it shares NaN (only an
all-zero amax gives 1) and the nvfp4 block scale NaN, so what shares that scale dequantizes
to NaN instead of being quantized with a made-up scale; an mxfp8 NaN stays a NaN element
(scale code 127). So the abs-maxes here are integer maxes of the fp32 bits with the sign
cleared (``_abs_bits``): for |v| integer order is float order and every NaN sorts above
+inf, whereas a float max drops NaN (``tl.max`` is maxnum on the GPU; a float
``atomic_max`` keeps a NaN only as far as its lowering splits on the sign bit, and older
Triton versions split on ``val >= 0``, which a NaN fails).

Under the interpreter (EXACT_CAST) fp32 -> e4m3 and fp32 -> bf16 are encoded by
hand with integer arithmetic, because the interpreter's casts truncate or drop
mantissa carries; on the GPU the hardware conversions (round to nearest even,
saturating) give the same bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The element-wise activation and fp8/int8 encoding live in _common (GEMM1's fused epilogue
# applies the same math); the underscored names are kept for this file's callers.
from ._common import FP8_MAX, INT8_MAX, apply_act, normal_scales, pdl_wait, quant_linear_dyn
from ._common import e4m3_bits as _e4m3_bits
from ._common import quant_linear as _quant_linear


@triton.jit
def _e2m1_code(y):
    """e2m1 code of y: round to nearest, ties to the even code, saturate at 6 (quant.fp4)."""
    m = tl.abs(y)
    c = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
    c += (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
    c += (m > 5.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return c | (sign << 3)


@triton.jit
def _store_float(ptr, v, mask, EXACT_CAST: tl.constexpr):
    if EXACT_CAST and ptr.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(ptr, bits.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _activation(x_ptr, rows, row_ok, k0, stride_xm, I, alpha, limit, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """(fp32 [BM, BK] activation of output columns k0 + [0, BK) (``fusedmoe.activations``), those
    columns, their [BM, BK] in-bounds mask). Interleaved gate/up pairs come in one contiguous
    [BM, 2BK] load, split in registers: two loads of every other element were not vectorised
    (gpt-oss's act_and_quantize at 16,384 pairs took 168 us on an H200, 29% of the bandwidth)."""
    base = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (cols < I)[None, :]
    if ACT == "none" or ACT == "silu_no_mul" or ACT == "gelu_no_mul" or ACT == "relu_no_mul" or ACT == "relu2_no_mul":
        gate = tl.load(base + cols[None, :], mask=mask, other=0).to(tl.float32)
        up = gate
    elif INTERLEAVED:
        c2 = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
        m2 = row_ok[:, None] & (c2 < 2 * I)[None, :]
        gu = tl.load(base + c2[None, :], mask=m2, other=0).to(tl.float32)
        gate, up = tl.split(tl.reshape(gu, [gu.shape[0], BLOCK_K, 2]))
    else:
        gate = tl.load(base + cols[None, :], mask=mask, other=0).to(tl.float32)
        up = tl.load(base + (I + cols)[None, :], mask=mask, other=0).to(tl.float32)
    return apply_act(gate, up, alpha, limit, ACT), cols, mask


@triton.jit
def _abs_bits(v):
    """int32 bits of |v| (fp32): their integer max is the abs-max with NaN kept (module docstring)."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def max_abs_bits(ptr, n):
    """The max of ``n`` int32 abs-max |bits| at ``ptr`` (an int32 pointer): an fp32 [1] running
    abs-max (n = 1; its bits, as ``_abs_bits`` raised them) or per-program slots that GEMM1's
    "amax_slots" epilogue wrote (``ActEpilogue.amax_slots``)."""
    m = tl.zeros([1024], dtype=tl.int32)
    for i in range(0, n, 1024):
        offs = i + tl.arange(0, 1024)
        m = tl.maximum(m, tl.load(ptr + offs, mask=offs < n, other=0))
    return tl.max(m, axis=0)


@triton.jit
def _scale_of(amax, QUANT: tl.constexpr):
    """amax / QMAX with IEEE division (as quant.linear divides): 1 where amax is 0, NaN where it is NaN."""
    qmax = FP8_MAX if QUANT == "fp8" else INT8_MAX
    return tl.where(amax == 0, 1.0, tl.math.div_rn(amax, tl.zeros_like(amax) + qmax))


@triton.jit
def _tensor_dyn_one(
    x_ptr, q_ptr, s_ptr, rmask_ptr, M, I, stride_xm, stride_qm, alpha, limit,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, QUANT: tl.constexpr, ROW_MASK: tl.constexpr,
    EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """PASS 0: one program quantizes all of [M, I] (M <= BLOCK_M, I <= BLOCK_K: one tile) with its
    per-tensor dynamic scale: the tile's amax (integer max of ``_abs_bits``, as PASS 1), then
    its codes (as PASS 2), from one load."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    if ROW_MASK:
        row_ok = row_ok & (tl.load(rmask_ptr + rows, mask=row_ok, other=0) != 0)
    v, cols, mask = _activation(x_ptr, rows, row_ok, 0, stride_xm, I, alpha, limit, ACT, INTERLEAVED, BLOCK_K)
    amax = tl.max(tl.max(tl.where(mask, _abs_bits(v), 0), axis=1), axis=0)
    s = _scale_of(amax.to(tl.float32, bitcast=True), QUANT)
    tl.store(s_ptr, s)
    q_row = q_ptr + rows[:, None].to(tl.int64) * stride_qm
    tl.store(q_row + cols[None, :], quant_linear_dyn(v, s, normal_scales(s), QUANT, EXACT_CAST), mask=mask)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, gs_ptr, amax_ptr, rmask_ptr, M, I, stride_xm, stride_qm, stride_sm, n_amax, alpha, limit,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, QUANT: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr,
    ROW_MASK: tl.constexpr, PASS: tl.constexpr, EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):  # fmt: skip
    """Program (m, k) of the grid is ``act_quant_tile(m, k, ...)``."""
    pdl_wait(PDL)
    act_quant_tile(
        tl.program_id(0), tl.program_id(1), x_ptr, q_ptr, s_ptr, gs_ptr, amax_ptr, rmask_ptr, M, I, stride_xm,
        stride_qm, stride_sm, n_amax, alpha, limit, ACT, INTERLEAVED, QUANT, SCALE, GROUP, ROW_MASK, PASS, EXACT_CAST,
        BLOCK_M, BLOCK_K,
    )  # fmt: skip


@triton.jit
def act_quant_tile(
    pid_m,  # the tile: rows pid_m * BLOCK_M + [0, BLOCK_M), output columns pid_k * BLOCK_K + [0, BLOCK_K)
    pid_k,
    x_ptr,  # [M, I] input (or [M, 2I] gate/up)
    q_ptr,  # [M, I] output: model dtype, fp8 bytes, int8; nvfp4 packed [M, I/2]
    s_ptr,  # scales: [1] tensor, [M, 1] token, [M, G] group (fp32, e8m0 or e4m3 bytes)
    gs_ptr,  # nvfp4 global scale [1]
    amax_ptr,  # [1] fp32, zeroed: the running amax of per-tensor dynamic scales (PASS 2: n_amax int32 |bits|)
    rmask_ptr,  # [M] uint8 (ROW_MASK): rows to compute; the others are neither read nor written
    M,
    I,
    stride_xm,
    stride_qm,
    stride_sm,
    n_amax,  # PASS 2: abs-max values at amax_ptr (1, or GEMM1's per-program slots)
    alpha,
    limit,
    ACT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QUANT: tl.constexpr,  # "none" | "fp8" | "int8" | "mxfp8" | "nvfp4"
    SCALE: tl.constexpr,  # "none" | "tensor_static" | "tensor_dyn" | "token" | "group"
    GROUP: tl.constexpr,
    ROW_MASK: tl.constexpr,
    PASS: tl.constexpr,  # tensor_dyn: 1 amax, 2 quantize; 0 both in one program (grid (1, 1))
    EXACT_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program of ``_act_quant_kernel`` (module docstring); also the x-quantization programs of the
    routing launch (``_route.py``'s ``_route_quant_kernel``)."""
    # 107 lines: one Triton program; each format is a constexpr branch the compiler specialises away, the per-format
    # math is in @triton.jit helpers.
    if PASS == 0:
        _tensor_dyn_one(
            x_ptr, q_ptr, s_ptr, rmask_ptr, M, I, stride_xm, stride_qm, alpha, limit,
            ACT, INTERLEAVED, QUANT, ROW_MASK, EXACT_CAST, BLOCK_M, BLOCK_K,
        )  # fmt: skip
    else:  # (a static if: what follows a return in its branch would still be compiled)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        if ROW_MASK:
            row_ok = row_ok & (tl.load(rmask_ptr + rows, mask=row_ok, other=0) != 0)
        q_row = q_ptr + rows[:, None].to(tl.int64) * stride_qm
        s_row = s_ptr + rows.to(tl.int64) * stride_sm

        if SCALE == "token":
            amax = tl.zeros([BLOCK_M], dtype=tl.int32)  # _abs_bits
            for k0 in range(0, I, BLOCK_K):
                v, cols, mask = _activation(x_ptr, rows, row_ok, k0, stride_xm, I, alpha, limit, ACT, INTERLEAVED,
                                            BLOCK_K)  # fmt: skip
                amax = tl.maximum(amax, tl.max(tl.where(mask, _abs_bits(v), 0), axis=1))
            s = _scale_of(amax.to(tl.float32, bitcast=True), QUANT)
            tl.store(s_row, s, mask=row_ok)
            for k0 in range(0, I, BLOCK_K):
                v, cols, mask = _activation(x_ptr, rows, row_ok, k0, stride_xm, I, alpha, limit, ACT, INTERLEAVED,
                                            BLOCK_K)  # fmt: skip
                fast = tl.min(normal_scales(s), axis=0)
                q = quant_linear_dyn(v, s[:, None], fast, QUANT, EXACT_CAST)
                tl.store(q_row + cols[None, :], q, mask=mask)
        else:
            v, cols, mask = _activation(x_ptr, rows, row_ok, pid_k * BLOCK_K, stride_xm, I, alpha, limit, ACT,
                                        INTERLEAVED, BLOCK_K)  # fmt: skip
            if QUANT == "none":
                _store_float(q_row + cols[None, :], v, mask, EXACT_CAST)
            elif SCALE == "tensor_dyn" and PASS == 1:
                # max is order-independent, so the atomic leaves a deterministic result; an integer
                # one, of _abs_bits, so that a NaN is kept
                tile = tl.max(tl.max(tl.where(mask, _abs_bits(v), 0), axis=1), axis=0)
                tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tile)
            elif SCALE == "tensor_dyn" or SCALE == "tensor_static":
                if SCALE == "tensor_static":
                    s = tl.load(s_ptr)
                else:
                    bits = max_abs_bits(amax_ptr.to(tl.pointer_type(tl.int32)), n_amax)
                    s = _scale_of(bits.to(tl.float32, bitcast=True), QUANT)
                    if (pid_m == 0) & (pid_k == 0):
                        tl.store(s_ptr, s)
                if SCALE == "tensor_static":  # a given scale: v / s may overflow, so IEEE division
                    q = _quant_linear(v, s, QUANT, EXACT_CAST)
                else:
                    q = quant_linear_dyn(v, s, normal_scales(s), QUANT, EXACT_CAST)
                tl.store(q_row + cols[None, :], q, mask=mask)
            else:
                # 1 x GROUP groups; BLOCK_K is a multiple of GROUP, so a tile holds whole groups.
                NG: tl.constexpr = BLOCK_K // GROUP
                v3 = tl.reshape(tl.where(mask, v, 0.0), [BLOCK_M, NG, GROUP])
                amax = tl.max(_abs_bits(v3), axis=2).to(tl.float32, bitcast=True)
                gcols = pid_k * NG + tl.arange(0, NG)
                s_mask = row_ok[:, None] & (gcols < tl.cdiv(I, GROUP))[None, :]
                s_ptrs = s_row[:, None] + gcols[None, :]
                if QUANT == "fp8" or QUANT == "int8":
                    s = _scale_of(amax, QUANT)
                    tl.store(s_ptrs, s, mask=s_mask)
                    fast = tl.min(tl.min(normal_scales(s), axis=1), axis=0)
                    q = quant_linear_dyn(v3, s[:, :, None], fast, QUANT, EXACT_CAST)
                    q = tl.reshape(q, [BLOCK_M, BLOCK_K])
                    tl.store(q_row + cols[None, :], q, mask=mask)
                elif QUANT == "mxfp8":
                    # e8m0 code of 2^(floor(log2 amax) - 8); floor(log2) is amax's exponent field
                    # (a subnormal amax clamps to code 0, as frexp's exponent would); 0 and NaN -> 127.
                    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 8
                    code = tl.where(amax > 0, tl.minimum(tl.maximum(e, -127), 127) + 127, 127)
                    tl.store(s_ptrs, code.to(tl.uint8), mask=s_mask)
                    inv = ((254 - code) << 23).to(tl.float32, bitcast=True)  # 2^(127 - code), exact
                    y = tl.maximum(v3 * inv[:, :, None], -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
                    y = tl.minimum(y, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN
                    q = tl.reshape(_e4m3_bits(y, EXACT_CAST), [BLOCK_M, BLOCK_K])
                    tl.store(q_row + cols[None, :], q, mask=mask)
                else:  # nvfp4: e4m3 block scale over a given fp32 global scale, e2m1 codes
                    gs = tl.load(gs_ptr)
                    sb = tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0 * gs)
                    # a NaN block scale stays NaN (torch's clamp), and its block's codes are 0
                    sb_bits = _e4m3_bits(tl.minimum(sb, 448.0, propagate_nan=tl.PropagateNan.ALL), EXACT_CAST)
                    tl.store(s_ptrs, sb_bits, mask=s_mask)
                    d = sb_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * gs
                    d3 = tl.zeros_like(v3) + d[:, :, None]
                    y = tl.where(d3 > 0, tl.math.div_rn(v3, tl.where(d3 > 0, d3, 1.0)), 0.0)
                    code = tl.reshape(_e2m1_code(y), [BLOCK_M, BLOCK_K // 2, 2])
                    lo, hi = tl.split(code)
                    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
                    p_mask = row_ok[:, None] & (pcols < I // 2)[None, :]
                    tl.store(q_row + pcols[None, :], (lo | (hi << 4)).to(tl.uint8), mask=p_mask)
