"""4-bit weights to 16-bit MMA operands in registers, two values per instruction (PTX, GPU only).

The w4 GEMM's tensor-core path dequantizes every weight of its tile once per program; from
~64 rows per expert down that is what bounds it (``scripts/kbench_w4.py``: Qwen3-30B-A3B
MXFP4 GEMM1 at T = 1024 ran at 140 TFLOP/s, ~16% of the bf16 rate). The portable Triton code
(``_grouped_gemm_w4._w4_raw`` / ``_w4_affine``) widens each nibble to an fp32 lane and takes
6.6 (int4) and 9.7 (e2m1) SASS instructions per weight in the K loop (sm_90 build of the
Qwen3 GEMM1 tile, BM 64 x 128 W rows). Here four packed bytes (eight weights) are widened in
pairs, two 16-bit values per 32-bit register, and every float step is a paired ``fma``:

* ``prmt`` spreads the four bytes over two registers, one byte per 16-bit lane;
* int4: ``lop3`` puts code c under the exponent of 128 (bf16) or 1024 (fp16), where a unit
  in the last place is 1, so the lane reads 128 + c; one ``fma`` subtracts 128 + zero
  (exact: c - zero is a small integer) and one more multiplies by the group scale. When the
  stored scale is not a 16-bit value of the activations' type (GPTQ's fp16 scales with bf16
  activations, fp32 scales) it is split into s_hi + s_lo, both 16-bit, and the weight is
  fma(d, s_hi, d * s_lo): one rounding of d * s, as the fp32 path makes, not two;
* e2m1 (bf16 only): the sign goes to bit 15 and the three magnitude bits to bits 8..6, the
  bf16 value times 2^-126 (exponent 0 being bf16's subnormal 0.5 * 2^-126); one ``fma``
  multiplies by 2^126, one by the scale. Both products are exact (powers of two; e4m3
  scales times e2m1 values need 6 of bf16's 8 significant bits), as in the fp32 path.

~2 (int4), 2.5 (split scales) and 3 (e2m1) instructions per weight. Each output element
depends only on the byte and scales of the same element, so the lanes Triton packs together
do not matter. The interpreter cannot run PTX: it takes the portable path, and
``tests/kernels/ptx_model.py`` runs these exact instruction strings on the CPU against the
reference dequantization.
"""

from __future__ import annotations

import triton
import triton.language as tl

_SPREAD = "0x4140"  # prmt: byte 0 to bits 0..7, byte 1 to bits 16..23 (one byte per 16-bit lane)
_SPREAD_HIGH = "0x1404"  # prmt: byte 0 to bits 8..15, byte 1 to bits 24..31
_LANE_BITS = {  # (fma suffix, 1.0 x2, magic x2 whose last place is 1)
    "bf16": ("bf16x2", "0x3F803F80", "0x43004300"),  # 128.0
    "f16": ("f16x2", "0x3C003C00", "0x64006400"),  # 1024.0
}
_NEG_ZERO = "0x80008000"  # -0.0 x2: fma(a, b, -0) is the rounded product, sign of zero kept


def int4_ptx(dtype: str, split: bool) -> str:
    """PTX for ``w4_unpack``'s int4 branch, two bytes (four weights) per instance. Operands: $0
    low nibbles out, $1 high nibbles out, $2 the two bytes, then per 16-bit input one register
    (two values): -(magic + zero) lo/hi ($3, $4), s_hi lo/hi ($5, $6), with ``split`` s_lo lo/hi
    ($7, $8)."""
    fma, one, magic = _LANE_BITS[dtype]
    lines = [
        "{",
        ".reg .b32 t, u, d<2>, p<2>, o<2>, one, nz;",  # float operands of fma must be registers
        f"mov.b32 one, {one}; mov.b32 nz, {_NEG_ZERO};",
        f"prmt.b32 t, $2, 0, {_SPREAD};",
        "shr.u32 u, t, 4;",
        # (x & 0x000F000F) | magic: a code under the magic exponent in each lane
        f"lop3.b32 d0, t, 0x000F000F, {magic}, 0xEA;",
        f"lop3.b32 d1, u, 0x000F000F, {magic}, 0xEA;",
        f"fma.rn.{fma} d0, d0, one, $3;",  # c - zero, exact
        f"fma.rn.{fma} d1, d1, one, $4;",
    ]
    for i in range(2):
        if split:
            lines.append(f"fma.rn.{fma} p{i}, d{i}, ${7 + i}, nz; fma.rn.{fma} o{i}, d{i}, ${5 + i}, p{i};")
        else:
            lines.append(f"fma.rn.{fma} o{i}, d{i}, ${5 + i}, nz;")
    # outputs last: an output may share a register with an input read above
    lines += ["mov.b32 $0, o0; mov.b32 $1, o1;", "}"]
    return "\n".join(lines)


def e2m1_ptx(out: str = "bf16") -> str:
    """PTX for ``w4_unpack``'s e2m1 branch, two bytes per instance. ``out`` "bf16": $0 low
    nibbles, $1 high nibbles (bf16 pairs), $2 the bytes, the scales lo/hi as bf16 pairs ($3, $4).
    "f32" (the FMA path): $0, $1 low nibbles and $2, $3 high ones as fp32 (exact: a bf16 value
    is the top half of its fp32), $4 the bytes, scales $5, $6."""
    i = 2 if out == "bf16" else 4  # the first input operand
    lines = [
        "{",
        ".reg .b32 t, a, b, r<2>, o<2>, two, nz;",
        f"mov.b32 two, 0x7E807E80; mov.b32 nz, {_NEG_ZERO};",  # 2^126 x2
        f"prmt.b32 t, ${i}, 0, {_SPREAD_HIGH};",
        # low nibble at lane bits 8..11: sign 11 -> 15, magnitude 8..10 -> 6..8
        "shl.b32 b, t, 4; shr.u32 a, t, 2; and.b32 a, a, 0x01C001C0; lop3.b32 r0, b, 0x80008000, a, 0xEA;",
        # high nibble at lane bits 12..15: the sign is in place, magnitude 12..14 -> 6..8
        "shr.u32 a, t, 6; and.b32 a, a, 0x01C001C0; lop3.b32 r1, t, 0x80008000, a, 0xEA;",
    ]
    for h in range(2):  # times 2^126, then the scale
        lines.append(f"fma.rn.bf16x2 r{h}, r{h}, two, nz; fma.rn.bf16x2 o{h}, r{h}, ${i + 1 + h}, nz;")
    if out == "bf16":
        lines.append("mov.b32 $0, o0; mov.b32 $1, o1;")
    else:
        lines.append("shl.b32 $0, o0, 16; and.b32 $1, o0, 0xFFFF0000; shl.b32 $2, o1, 16; and.b32 $3, o1, 0xFFFF0000;")
    lines.append("}")
    return "\n".join(lines)


_INT4_BF16: tl.constexpr = tl.constexpr(int4_ptx("bf16", False))
_INT4_BF16_SPLIT: tl.constexpr = tl.constexpr(int4_ptx("bf16", True))
_INT4_F16: tl.constexpr = tl.constexpr(int4_ptx("f16", False))
_INT4_F16_SPLIT: tl.constexpr = tl.constexpr(int4_ptx("f16", True))
_E2M1_BF16: tl.constexpr = tl.constexpr(e2m1_ptx())
_E2M1_F32: tl.constexpr = tl.constexpr(e2m1_ptx("f32"))
# two outputs (four 16-bit values), the bytes, then one register per 16-bit input
_C_SPLIT: tl.constexpr = tl.constexpr("=r,=r,r" + ",r" * 6)
_C_PLAIN: tl.constexpr = tl.constexpr("=r,=r,r" + ",r" * 4)
_C_E2M1: tl.constexpr = tl.constexpr("=r,=r,r" + ",r" * 2)
_C_E2M1_F32: tl.constexpr = tl.constexpr("=r,=r,=r,=r,r,r,r")  # fp32 outputs: a register per value


@triton.jit
def w4_unpack(byte, m_lo, m_hi, s_lo, s_hi, t_lo, t_hi, W_FMT: tl.constexpr, OP: tl.constexpr, SPLIT: tl.constexpr):
    """(W_lo, W_hi) in OP from a uint8 byte tile: low and high nibbles, dequantized. int4:
    (c - zero) * s with m = -(magic + zero) and s = s_hi (+ t = s_lo under SPLIT); e2m1:
    value * s (m and t unused). Per-half arguments broadcast against ``byte``."""
    if W_FMT != "int4":
        lo, hi = tl.inline_asm_elementwise(_E2M1_BF16, _C_E2M1, [byte, s_lo, s_hi], (tl.bfloat16, tl.bfloat16), True, 2)
    elif OP == tl.bfloat16 and SPLIT:
        lo, hi = tl.inline_asm_elementwise(
            _INT4_BF16_SPLIT, _C_SPLIT, [byte, m_lo, m_hi, s_lo, s_hi, t_lo, t_hi], (tl.bfloat16, tl.bfloat16), True, 2
        )
    elif OP == tl.bfloat16:
        lo, hi = tl.inline_asm_elementwise(
            _INT4_BF16, _C_PLAIN, [byte, m_lo, m_hi, s_lo, s_hi], (tl.bfloat16, tl.bfloat16), True, 2
        )
    elif SPLIT:
        lo, hi = tl.inline_asm_elementwise(
            _INT4_F16_SPLIT, _C_SPLIT, [byte, m_lo, m_hi, s_lo, s_hi, t_lo, t_hi], (tl.float16, tl.float16), True, 2
        )
    else:
        lo, hi = tl.inline_asm_elementwise(
            _INT4_F16, _C_PLAIN, [byte, m_lo, m_hi, s_lo, s_hi], (tl.float16, tl.float16), True, 2
        )
    return lo, hi


@triton.jit
def e2m1_unpack_f32(byte, s_lo, s_hi):
    """(W_lo, W_hi) in fp32 from a uint8 tile of e2m1 pairs, times the bf16 scales (exact): the
    FMA path's weights, three instructions per weight fewer than the fp32 decode."""
    return tl.inline_asm_elementwise(_E2M1_F32, _C_E2M1_F32, [byte, s_lo, s_hi], (tl.float32, tl.float32), True, 2)
