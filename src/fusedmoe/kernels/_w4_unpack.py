"""4-bit weights to 16-bit MMA operands in registers, two values per instruction (PTX, GPU only).

The w4 GEMM's tensor-core path dequantizes every weight of its tile once per program; from
~64 rows per expert down that is what bounds it (``scripts/kbench_w4.py``: Qwen3-30B-A3B
MXFP4 GEMM1 at T = 1024 ran at 140 TFLOP/s, ~16% of the bf16 rate). The portable Triton code
(``_w4_operands._w4_raw`` / ``_w4_affine_of``) widens each nibble to an fp32 lane and takes
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
  multiplies by 2^126, one by the scale, or one by 2^126 * scale where that is a bf16 value
  for every scale of the tensor (``W4Tensor.e2m1_one_mul``: MXFP4 scales <= 2, as in the
  checkpoints seen). The products are exact (powers of two; e4m3 scales times e2m1 values
  need 6 of bf16's 8 significant bits), as in the fp32 path.

~2 (int4), 2.5 (split scales) and 2.25-2.75 (e2m1: one or two multiplies) instructions per weight. Each output element
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
_SPREAD_HIGH_23 = "0x3424"  # prmt: byte 2 to bits 8..15, byte 3 to bits 24..31
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


def _e2m1_place(t: str, lo: str, hi: str) -> list[str]:
    """Bit placement of the two bytes in the high bytes of ``t``'s 16-bit lanes (bits 8..15 and
    24..31; the low bytes must be zero): ``lo`` gets the low nibbles and ``hi`` the high ones as
    bf16 pairs of value * 2^-126."""
    return [
        # low nibble at lane bits 8..11: sign 11 -> 15 (t << 4), magnitude 8..10 -> 6..8 (t >> 2).
        # t's zero low bytes put zeros where the other shift's bits go (t << 4 at 6..8, t >> 2 at
        # 15), so one lop3 (a | b) & mask merges and masks both: 7 instructions a byte pair, not 8
        f"shl.b32 b, {t}, 4; shr.u32 a, {t}, 2; lop3.b32 {lo}, a, b, 0x81C081C0, 0xA8;",
        # high nibble at lane bits 12..15: the sign is in place, magnitude 12..14 -> 6..8
        f"shr.u32 a, {t}, 6; and.b32 a, a, 0x01C001C0; lop3.b32 {hi}, {t}, 0x80008000, a, 0xEA;",
    ]


def _e2m1_scale_ptx(r: str, s: str, two_muls: bool) -> str:
    """``r`` (bf16 pairs of value * 2^-126) times 2^126 and the scale ``s``, or times ``s`` alone
    where the caller folded 2^126 into it."""
    mul = f"fma.rn.bf16x2 {r}, {r}, {s}, nz;"
    return f"fma.rn.bf16x2 {r}, {r}, two, nz; {mul}" if two_muls else mul


def e2m1_ptx(out: str = "bf16", two_muls: bool = True) -> str:
    """PTX for the e2m1 unpack. ``out`` "bf16" (``w4_unpack``, the tensor cores), two bytes per
    instance: $0 low nibbles, $1 high nibbles (bf16 pairs), $2 the bytes, the scales lo/hi as
    bf16 pairs ($3, $4). "f32" (``e2m1_word_f32``, the FMA path), one 32-bit word (four bytes
    of one W row, eight weights) per instance: $0..$3 the low nibbles of bytes 0..3 and $4..$7
    the high ones as fp32 (exact: a bf16 value is the top half of its fp32), $8 the word, $9
    and $10 the low and high halves' scale as a bf16 pair (s, s). ``two_muls``: the value * 2^-126
    times 2^126, then times the scale; else times the one factor 2^126 * scale the caller
    passes (``_w4_operands._e2m1_scale``)."""
    head = [
        "{",
        ".reg .b32 t<2>, a, b, r<4>, two, nz;",
        f"mov.b32 two, 0x7E807E80; mov.b32 nz, {_NEG_ZERO};",  # 2^126 x2
    ]
    if out == "bf16":
        lines = head + [f"prmt.b32 t0, $2, 0, {_SPREAD_HIGH};", *_e2m1_place("t0", "r0", "r1")]
        lines += [_e2m1_scale_ptx(f"r{h}", f"${3 + h}", two_muls) for h in range(2)]
        lines.append("mov.b32 $0, r0; mov.b32 $1, r1;")
    else:
        lines = head + [f"prmt.b32 t0, $8, 0, {_SPREAD_HIGH};", f"prmt.b32 t1, $8, 0, {_SPREAD_HIGH_23};"]
        lines += _e2m1_place("t0", "r0", "r1") + _e2m1_place("t1", "r2", "r3")
        # r0: low nibbles of bytes 0, 1; r1: their high nibbles; r2, r3: bytes 2, 3
        lines += [_e2m1_scale_ptx(f"r{r}", f"${s}", two_muls) for r, s in ((0, 9), (1, 10), (2, 9), (3, 10))]
        # outputs last: an output may share a register with an input read above
        for o, r in ((0, 0), (2, 2), (4, 1), (6, 3)):
            lines.append(f"shl.b32 ${o}, r{r}, 16; and.b32 ${o + 1}, r{r}, 0xFFFF0000;")
    lines.append("}")
    return "\n".join(lines)


_INT4_BF16: tl.constexpr = tl.constexpr(int4_ptx("bf16", False))
_INT4_BF16_SPLIT: tl.constexpr = tl.constexpr(int4_ptx("bf16", True))
_INT4_F16: tl.constexpr = tl.constexpr(int4_ptx("f16", False))
_INT4_F16_SPLIT: tl.constexpr = tl.constexpr(int4_ptx("f16", True))
_E2M1_BF16: tl.constexpr = tl.constexpr(e2m1_ptx())
_E2M1_BF16_ONE: tl.constexpr = tl.constexpr(e2m1_ptx(two_muls=False))
_E2M1_F32: tl.constexpr = tl.constexpr(e2m1_ptx("f32"))
_E2M1_F32_ONE: tl.constexpr = tl.constexpr(e2m1_ptx("f32", two_muls=False))
# two outputs (four 16-bit values), the bytes, then one register per 16-bit input
_C_SPLIT: tl.constexpr = tl.constexpr("=r,=r,r" + ",r" * 6)
_C_PLAIN: tl.constexpr = tl.constexpr("=r,=r,r" + ",r" * 4)
_C_E2M1: tl.constexpr = tl.constexpr("=r,=r,r" + ",r" * 2)
# eight fp32 outputs, the word, the two scale pairs
_C_E2M1_F32: tl.constexpr = tl.constexpr("=r," * 8 + "r,r,r")


@triton.jit
def w4_unpack(byte, m_lo, m_hi, s_lo, s_hi, t_lo, t_hi, W_FMT: tl.constexpr, OP: tl.constexpr, SPLIT: tl.constexpr):
    """(W_lo, W_hi) in OP from a uint8 byte tile: low and high nibbles, dequantized. int4:
    (c - zero) * s with m = -(magic + zero) and s = s_hi (+ t = s_lo under SPLIT); e2m1:
    value * s, s = the scale (SPLIT) or 2^126 times it (m and t unused). Per-half arguments
    broadcast against ``byte``."""
    if W_FMT != "int4" and SPLIT:
        lo, hi = tl.inline_asm_elementwise(_E2M1_BF16, _C_E2M1, [byte, s_lo, s_hi], (tl.bfloat16, tl.bfloat16), True, 2)
    elif W_FMT != "int4":
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_BF16_ONE, _C_E2M1, [byte, s_lo, s_hi], (tl.bfloat16, tl.bfloat16), True, 2
        )
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
def e2m1_word_f32(word, s_lo, s_hi, SPLIT: tl.constexpr):
    """The eight fp32 weights of an int32 tile of e2m1 words (four bytes of one W row each):
    (low nibbles of bytes 0..3, high nibbles of bytes 0..3), times the scales (exact). s_lo,
    s_hi: the bf16 scale of each word's low and high half as an int32 pair (s, s), times 2^126
    unless SPLIT (as ``w4_unpack``). The FMA path's weights: whole words arrive as the registers
    they were loaded in. With bytes (two an instance), the loop-carried byte tiles were split
    into a register per byte and re-packed around every instance, ~5 of the ~9.7 SASS
    instructions per weight of the Mixtral-sized K loop (sm_90 build)."""
    if SPLIT:
        return tl.inline_asm_elementwise(_E2M1_F32, _C_E2M1_F32, [word, s_lo, s_hi], (tl.float32,) * 8, True, 1)
    else:
        return tl.inline_asm_elementwise(_E2M1_F32_ONE, _C_E2M1_F32, [word, s_lo, s_hi], (tl.float32,) * 8, True, 1)
