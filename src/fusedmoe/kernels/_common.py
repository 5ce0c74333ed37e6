"""Helpers shared by the kernel families: where kernels run, jit decode/encode helpers, and the
element-wise activation and linear quantization that the activation kernel and GEMM1's fused
epilogue both apply."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .. import env


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host. ``triton.cdiv`` is a constexpr function in Triton 3.6: called
    from Python it unwraps its arguments first, ~5 us a call on the H100 host, several per launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), for the host (see ``cdiv``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """True under the Triton interpreter (``TRITON_INTERPRET=1``, read when Python starts)."""
    return env.raw("TRITON_INTERPRET") == "1"


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A kernel's first statement where it may run under programmatic dependent launch (PDL:
    ``kernels.launch`` sets ``PDL`` and the launch attribute together, on sm_90+). The kernel may
    then be launched before the one ahead of it in the stream has completed (as that one's
    programs exit: none here lets it in sooner, see below); here it waits until that one has
    completed and its writes are visible: nothing is read from global memory before. Why:
    between two dependent kernels of a CUDA graph the GPU idles ~1.5-2 us (H200, PERF_LOG
    2026-11-28), 3-5 times in a decode layer; this takes 0.3-1.7 us off each layer at T = 1
    (PERF_LOG, thirteenth session).

    No kernel calls ``griddepcontrol.launch_dependents`` (which lets the next kernel launch as
    soon as all of this one's programs have started): measured slower (the Mixtral layer 0.87x at
    T = 1 with it in every kernel, 0.92x at T = 16 with it in all but the GEMMs); likely because
    the next kernel's programs are then placed on whichever SMs are free, so a GEMM that streams
    weights through every SM starts unevenly spread."""
    if PDL:
        gdc_wait()


# ---- jit helpers: decoding stored formats (used by the GEMM and the quantizers) -------------


@triton.jit
def unpack_nibbles(row_ptrs, row_ok, k0, K, stride_k, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """4-bit codes (int32 [R, BLOCK_K]) of columns k0.. of rows packed two per byte along K
    (low nibble = even column). Loads whole bytes, [R, BLOCK_K / 2], so K-contiguous rows
    vectorise; K and k0 are even."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = row_ok[:, None] & (kb < K // 2)[None, :]
    byte = tl.load(row_ptrs[:, None] + kb[None, :] * stride_k, mask=mask, other=0).to(tl.int32)
    return tl.reshape(tl.join(byte & 0xF, (byte >> 4) & 0xF), [R, BLOCK_K])


@triton.jit
def e2m1_to_f32(code):
    """e2m1 code (int32; bit 3 = sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6) -> float32.

    The three magnitude bits, placed as fp16's two low exponent bits and top mantissa
    bit, are the value times 2^-14 (exponent 0 being fp16's subnormal 0.5 * 2^-14): four
    integer ops and one multiply instead of a decode with selects.
    """
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_to_f32(s):
    """e8m0 exponent (uint8) -> 2^(s - 127), exactly, by placing s in the float32 exponent.

    s = 0 (2^-127, below float32's normal range) gives 0, as a GPU flushing subnormals would.
    """
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


# ---- jit helpers: tiles of the element-wise kernels (row movers, moe_sum) -------------------


@triton.jit
def row_col_tile(num_rows, num_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's [BLOCK_R, BLOCK_C] tile of a grid (row blocks, column blocks) over a
    [num_rows, num_cols] array: (rows as int64, so row offsets times strides cannot overflow
    int32; cols; row_ok; col_ok)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows.to(tl.int64), cols, rows < num_rows, cols < num_cols


# ---- jit helpers: element-wise math shared by the activation kernel and GEMM1's epilogue ----

FP8_MAX: tl.constexpr = tl.constexpr(448.0)
INT8_MAX: tl.constexpr = tl.constexpr(127.0)
F32_NORMAL_MIN: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # 2^-126


@triton.jit
def apply_act(gate, up, alpha, limit, ACT: tl.constexpr):
    """fp32 activation (``fusedmoe.activations``) of GEMM1's output: gated ones combine
    ``gate`` and ``up``; "none" and the ``*_no_mul`` ones map ``gate`` alone (``up`` unused)."""
    if ACT == "none":
        return gate
    elif ACT == "silu_no_mul":
        return gate * tl.sigmoid(gate)
    elif ACT == "gelu_no_mul":
        return 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    elif ACT == "relu_no_mul":
        return tl.where(gate < 0.0, 0.0, gate)  # a select keeps NaN (see relu2_no_mul)
    elif ACT == "relu2_no_mul":
        # selects, not tl.maximum/minimum: the GPU's float max returns the other operand for a
        # NaN, and the NaN policy (validation.py) wants a NaN input to stay NaN, as in PyTorch
        h = tl.where(gate < 0.0, 0.0, gate)
        return h * h
    elif ACT == "silu":
        return gate * tl.sigmoid(gate) * up
    elif ACT == "gelu":
        return 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACT == "gelu_tanh":
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        z = tl.minimum(tl.maximum(z, -15.0), 15.0)  # tanh(15) is 1 in fp32; avoids exp overflow
        return 0.5 * gate * (2.0 * tl.sigmoid(2.0 * z)) * up  # 1 + tanh(z) = 2 sigmoid(2z)
    elif ACT == "silu_clamp":
        g = tl.where(gate > limit, limit, gate)
        u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
        return g * tl.sigmoid(g) * u
    elif ACT == "silu_clamp_post":
        s = gate * tl.sigmoid(gate)
        u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
        return tl.where(s > limit, limit, s) * u
    elif ACT == "silu_softcap":  # limit caps gate, alpha caps up: c tanh(v / c) = c (2 sigmoid(2v / c) - 1)
        gc = limit * (2.0 * tl.sigmoid(2.0 * gate / limit) - 1.0)
        uc = alpha * (2.0 * tl.sigmoid(2.0 * up / alpha) - 1.0)
        return gc * tl.sigmoid(gate) * uc
    else:  # swigluoai
        g = tl.where(gate > limit, limit, gate)
        u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
        return (u + 1.0) * g * tl.sigmoid(alpha * g)


@triton.jit
def round_half_even(y):
    """round(y) with ties to even, as torch.round (exact for |y| < 2^22)."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


@triton.jit
def e4m3_bits(y, EXACT_CAST: tl.constexpr):
    """e4m3fn byte (uint8) of y in [-448, 448], rounded to nearest even.

    EXACT_CAST (the interpreter, whose fp32 -> e4m3 cast drops mantissa carries) encodes
    by hand with integer arithmetic; the GPU's conversion gives the same bytes.
    """
    if EXACT_CAST:
        a = tl.abs(y)
        bits = a.to(tl.int32, bitcast=True)
        r = bits + 0x7FFFF + ((bits >> 20) & 1)  # round the fp32 mantissa to 3 bits
        normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)  # rebias exponent 127 -> 7
        sub = round_half_even(a * 512.0).to(tl.int32)  # below 2^-6: multiples of 2^-9
        code = tl.where(a < 0.015625, sub, normal)
        code = tl.where(a != a, 0x7F, code)  # NaN (signed, as torch's cast)
        sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
        return (code | (sign << 7)).to(tl.uint8)
    else:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def quant_linear(v, s, QUANT: tl.constexpr, EXACT_CAST: tl.constexpr):
    """fp8 (as uint8 bytes) or int8 codes of v / s (``quant.linear``: IEEE division, then
    saturate; int8 rounds half to even). NaN stays NaN in fp8 and is 0 in int8, as torch's
    casts give (a plain min/max clamp is maxnum on the GPU: it would give -448 or -128)."""
    return linear_codes(tl.math.div_rn(v, s), QUANT, EXACT_CAST)


@triton.jit
def quotient_rcp(v, s, r, EXACT_CAST: tl.constexpr):
    """v / s rounded as IEEE division rounds it, from ``r`` = div_rn(1, s) made once per scale:
    q0 = v r, then one fma correction (Markstein: with r correctly rounded, q0 + (v - s q0) r is
    the correctly rounded quotient; the fma makes v - s q0 exact). Three instructions where
    div_rn is a range check, a reciprocal, refinements and a slow-path branch per element. Where
    they differ (s = inf: NaN against 0) the code's value, 0 x inf, is NaN either way. The
    interpreter's fma rounds twice, so there (EXACT_CAST) this is div_rn itself."""
    if EXACT_CAST:
        return tl.math.div_rn(v, s)
    q0 = v * r
    return tl.fma(tl.fma(-q0, s, v), r, q0)


@triton.jit
def normal_scales(s):
    """int32 1 where scale ``s`` is a normal finite float (its reciprocal is then finite), else 0:
    ``quant_linear_dyn``'s ``fast`` is the minimum over a tile's scales."""
    return ((s >= F32_NORMAL_MIN) & (s < float("inf"))).to(tl.int32)


@triton.jit
def quant_linear_dyn(v, s, fast, QUANT: tl.constexpr, EXACT_CAST: tl.constexpr):
    """``quant_linear``'s codes for a dynamic scale (|v / s| <= qmax up to the scale's rounding: no
    overflow, and a quotient below the normal range is a zero code either way). Where ``fast``
    (every scale of the tile normal and finite, ``normal_scales``) the quotient is by the scale's
    reciprocal with one fma correction (``quotient_rcp``: the IEEE quotient, ~4 instructions an
    element where ``div_rn`` takes ~20 and a slow-path branch; act_quant's programs spent most of
    their time there); otherwise ``div_rn``, which also gives v / inf and v / NaN as IEEE does."""
    if fast:
        y = quotient_rcp(v, s, tl.math.div_rn(tl.zeros_like(s) + 1.0, s), EXACT_CAST)
        # a quotient that rounds to zero is a zero code of v's sign (as v / s gives it); the fma
        # correction of a subnormal v can return +0 for it (H200: fp8 codes of tiny negative
        # values came out 0x00 where the reference has 0x80)
        y = tl.where(y == 0.0, v * 0.0, y)
    else:
        y = tl.math.div_rn(v, s)
    return linear_codes(y, QUANT, EXACT_CAST)


@triton.jit
def linear_codes(y, QUANT: tl.constexpr, EXACT_CAST: tl.constexpr):
    """fp8 (uint8 bytes) or int8 codes of the quotient y = v / s (``quant_linear``)."""
    if QUANT == "fp8":
        y = tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        return e4m3_bits(tl.minimum(y, FP8_MAX, propagate_nan=tl.PropagateNan.ALL), EXACT_CAST)
    else:
        r = tl.minimum(tl.maximum(round_half_even(y), -INT8_MAX - 1.0), INT8_MAX)
        return tl.where(y != y, 0.0, r).to(tl.int8)
