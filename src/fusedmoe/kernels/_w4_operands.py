"""Operand tiles of the 4-bit weight GEMM (``_grouped_gemm_w4``): W's bytes and their scales and
zero points, decoded by bit placement (the portable path) or prepared for the PTX unpack
(``_w4_unpack``), and A's columns in the K order the weights' pack blocks meet.

A pack block of PK columns (``quant.w4_layout``) holds column j in the low nibble of its byte j
and column PK/2 + j in the high nibble: a "half" is PK/2 columns, one per byte. RUNS > 1 (the
tensor-core tiles, ``grouped_gemm_w4.dot_runs``) takes the halves of RUNS consecutive blocks as
one operand, columns kh + r * PK + c (c < PK/2): their bytes are contiguous, their scales are
the runs' groups broadcast, and runs at or past K's padded end (KP) are masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._grouped_gemm import _decode_scale


@triton.jit
def _w4_group(
    ws_rows, wz_rows, ok, kh, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, R: tl.constexpr,
    RUNS: tl.constexpr = 1, PK: tl.constexpr = 0, KP=0, PER: tl.constexpr = 1, RAW: tl.constexpr = False,
    pre=None,
):  # fmt: skip
    """(scale, zero) of the half block at column ``kh``, counted from the group ``ws_rows`` and
    ``wz_rows`` point at (the tensor-core tiles pass the step's own column: ``_w4_step_scales``),
    fp32 (RAW: the stored scale codes, not decoded; ``_e2m1_bits``): [R, 1] when the half lies in one
    group, else [R, HALF / PER], each group loaded once a row and broadcast over its columns (PER
    1) or its words (PER 4, "fma1": a word's four columns share a group, groups being >= 16).
    zero: the stored zero point, 8 for symmetric int4 (codes are c - 8), 0 for e2m1 (unused).
    RUNS > 1 (``_w4_dot_step``): the half of RUNS consecutive pack blocks, [R, RUNS * HALF]
    (columns kh + r * PK + c, c < HALF), runs at or past KP masked. ``pre``: the step's codes,
    loaded beforehand (``_w4_step_codes``; ``kh`` is then the half's static column in the step),
    used in place of the loads."""
    z = 8.0 if W_FMT == "int4" else 0.0
    zc = z
    if HALF <= GROUP and RUNS == 1:
        if pre is not None:
            s, zc = _pre_codes(pre, kh // GROUP, 1, 0, 1, HAS_ZERO)
        else:
            if RAW:  # "fma1": ~3 SASS a load fewer
                g = udiv(kh, GROUP)
            else:
                g = kh // GROUP
            s = tl.load(ws_rows + g * stride_wsk, mask=ok, other=0)
            if HAS_ZERO:
                zc = tl.load(wz_rows + g * stride_wsk, mask=ok, other=0)
        if not RAW:
            s = _decode_scale(s, W_FMT)
        s = s[:, None]
        if HAS_ZERO:
            z = zc.to(tl.float32)[:, None]
    else:
        NH: tl.constexpr = HALF // GROUP  # groups of one block's half (RUNS > 1 needs HALF >= GROUP)
        if pre is not None:
            s, zc = _pre_codes(pre, kh // GROUP, NH, PK // GROUP, RUNS, HAS_ZERO)
        else:
            idx = tl.arange(0, RUNS * NH)
            run = idx // NH
            g = kh // GROUP + run * (PK // GROUP) + idx % NH
            m = ok[:, None]
            if RUNS > 1:
                m = m & (kh + run * PK < KP)[None, :]
            s = tl.load(ws_rows[:, None] + g[None, :] * stride_wsk, mask=m, other=0)
            if HAS_ZERO:
                zc = tl.load(wz_rows[:, None] + g[None, :] * stride_wsk, mask=m, other=0)
        shape: tl.constexpr = [R, RUNS * NH, GROUP // PER]
        if not RAW:
            s = _decode_scale(s, W_FMT)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], shape), [R, RUNS * HALF // PER])
        if HAS_ZERO:
            z = tl.reshape(tl.broadcast_to(zc.to(tl.float32)[:, :, None], shape), [R, RUNS * HALF // PER])
    return s, z


@triton.jit
def _w4_step_scales(ws_base, wz_base, k0, stride_wsk, GROUP: tl.constexpr):
    """Scale and zero-point pointers advanced to the first group of the K step at ``k0`` (>= 0, a
    multiple of the step and so of GROUP): the step's tiles then index their groups by constants,
    one address a row for all of them instead of a division and an address a load."""
    g = udiv(k0, GROUP)
    return ws_base + g * stride_wsk, wz_base + g * stride_wsk


@triton.jit
def _w4_step_codes(
    ws_base, wz_base, g_cols, u_cols, ok, k0, KP, stride_wsn, stride_wsk,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZERO: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """The stored scale (and zero-point) codes of the K step at ``k0`` (``ws_base``, ``wz_base``:
    the expert's scales and zero points), as (gate rows, up rows): each a tuple of one
    [R] tile per group of the step (NG = BLOCK_K / GROUP, at least 1), then, HAS_ZERO, as many
    zero-point tiles; groups at or past KP, and a step at or past ``k_hi`` (``ok`` false), masked.
    For ``LaunchConfig.scale_loads`` 1 (loaded in the step before, carried) and 2 (all loaded at
    the step's start), in place of each block's own loads just before its unpack: the hardware
    counters (``scripts/ncu_suite.sh``, H200, Mixtral MXFP4 T = 4096) put those loads' latency
    first among the 4-bit GEMM's stalls. Carried tiles keep their load's layout: in the large
    W-major tiles the compiler then lays the unpack out in it and converts the dequantized W
    tile to the MMA's layout through shared memory each step (sm_90 build: 16 STS, 9 barriers,
    the loop 563 -> 796 instructions), 1.9x slower; each choice is the fastest for some tiles."""
    NG: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP
    ws_k, wz_k = _w4_step_scales(ws_base, wz_base, k0, stride_wsk, GROUP)
    gate = ()
    up = ()
    for which in tl.static_range(2 if HAS_ZERO else 1):
        base = ws_k if which == 0 else wz_k
        for gi in tl.static_range(NG):
            m = ok & (k0 + gi * GROUP < KP)
            gate = gate + (tl.load(base + g_cols * stride_wsn + gi * stride_wsk, mask=m, other=0),)
            if GATED:
                up = up + (tl.load(base + u_cols * stride_wsn + gi * stride_wsk, mask=m, other=0),)
    if not GATED:
        up = gate
    return gate, up


@triton.jit
def _pre_codes(pre, g0: tl.constexpr, NH: tl.constexpr, STEP: tl.constexpr, RUNS: tl.constexpr, HAS_ZERO: tl.constexpr):
    """(scale codes, zero codes) of a half from the step's prefetched tiles ``pre``
    (``_w4_step_codes``): group g0's [R] tile where the half lies in one group (NH = RUNS = 1),
    else [R, RUNS * NH] of groups g0 + r * STEP + h (r < RUNS, h < NH) in that order, as
    ``_w4_group`` loads them (2 or 4 groups; joins add a trailing axis: (a, c) joined with
    (b, d) is a, b, c, d). Zero codes 0 without HAS_ZERO (unused)."""
    NG: tl.constexpr = len(pre) // (2 if HAS_ZERO else 1)  # groups of the step
    N: tl.constexpr = RUNS * NH
    tl.static_assert(N == 1 or N == 2 or N == 4, "a half spans 1, 2 or 4 groups")
    i1: tl.constexpr = g0 + (STEP if NH == 1 else 1)
    i2: tl.constexpr = g0 + (2 * STEP if NH == 1 else (STEP if NH == 2 else 2))
    i3: tl.constexpr = g0 + (3 * STEP if NH == 1 else (STEP + 1 if NH == 2 else 3))
    out = ()
    for off in tl.static_range(0, 2 * NG if HAS_ZERO else NG, NG):
        if N == 1:
            t = pre[off + g0]
        elif N == 2:
            t = tl.join(pre[off + g0], pre[off + i1])
        else:
            t = tl.join(tl.join(pre[off + g0], pre[off + i2]), tl.join(pre[off + i1], pre[off + i3]))
            t = tl.reshape(t, [t.shape[0], 4])
        out = out + (t,)
    if not HAS_ZERO:
        out = out + (0,)
    return out[0], out[1]


@triton.jit
def udiv(x, D: tl.constexpr):
    """x // D for x >= 0, divided as unsigned: a shift for a power of two, with none of the sign
    fix-ups of a signed division."""
    return tl.cast(tl.cast(x, tl.uint32) // D, tl.int32)


@triton.jit
def _w4_affine_of(s, z, W_FMT: tl.constexpr):
    """(S, B) of a scale and zero point: the weights are raw * S + B (``_w4_raw``), fp32, shaped as
    the scale. int4: raw = 1 + c/16, so (c - zero) * scale = raw * 16 scale - (16 + zero) * scale;
    e2m1: raw = value * 2^-14, S = scale * 2^14, B = 0."""
    if W_FMT == "int4":
        return s * 16.0, -(16.0 + z) * s
    else:
        return s * 16384.0, 0.0


@triton.jit
def _w4_unpack_args(
    ws_rows, wz_rows, ok, kh, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, SPLIT: tl.constexpr,
    R: tl.constexpr, OP: tl.constexpr, RUNS: tl.constexpr = 1, PK: tl.constexpr = 0, KP=0, pre=None,
):  # fmt: skip
    """(m, s_hi, s_lo) in OP of the half block at ``kh`` for ``_w4_unpack.w4_unpack``: m = -(magic
    + zero) (int4; the magic is 128 in bf16, 1024 in fp16), the scale, and under SPLIT the part
    of the scale that OP does not hold (so s_hi + s_lo carries 16 significant bits). e2m1: the
    scale, times 2^126 unless SPLIT (``_e2m1_scale``). RUNS, PK, KP: as ``_w4_group``."""
    s, z = _w4_group(ws_rows, wz_rows, ok, kh, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, R, RUNS, PK, KP, pre=pre)
    s_hi = s.to(OP)
    if W_FMT != "int4":
        s_hi = _e2m1_scale(s, SPLIT).to(OP)
    s_lo = s_hi
    m = s_hi
    if W_FMT == "int4":
        if OP == tl.bfloat16:
            m = (tl.zeros_like(s) - (z + 128.0)).to(OP)  # z may be a constant: m must be a tensor
        else:
            m = (tl.zeros_like(s) - (z + 1024.0)).to(OP)
        if SPLIT:
            s_lo = (s - s_hi.to(tl.float32)).to(OP)
    return m, s_hi, s_lo


@triton.jit
def _e2m1_bits(s, W_FMT: tl.constexpr, SPLIT: tl.constexpr):
    """The PTX e2m1 unpack's scale operand (``_e2m1_scale``) as the int32 bits of its bf16 value.
    MXFP4: ``s`` is the stored e8m0 code e (``_w4_group``'s RAW), the scale 2^(e - 127), whose bf16
    bits are e << 7, and those of 2^126 times it (e <= 128 where ``e2m1_one_mul``) (e + 126) << 7:
    integer work in place of a decode, a multiply and a conversion (the sm_90 "fma1" K loop, 8
    scale loads a step: 503 -> 469 SASS instructions with the unsigned column division); code 0
    stays 0, as ``e8m0_to_f32`` flushes it. NVFP4: ``s`` is the decoded fp32 scale (its halves
    span two 16-column groups, broadcast before this: decoding after would convert 4x the values)."""
    if W_FMT == "mxfp4":
        e = s.to(tl.int32)
        if SPLIT:
            return e << 7
        else:
            return tl.where(e == 0, 0, (e + 126) << 7)
    else:
        return _e2m1_scale(s, SPLIT).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)


@triton.jit
def _e2m1_scale(s, SPLIT: tl.constexpr):
    """The PTX e2m1 unpack's scale operand: the unpack places a code as its value * 2^-126 (bf16),
    then multiplies by 2^126 and by the scale; where every scale times 2^126 is a bf16 value
    (not SPLIT: ``W4Tensor.e2m1_one_mul``) the two make one factor and one multiply (exact
    either way: powers of two and e4m3 values times e2m1 values)."""
    if SPLIT:
        return s
    else:
        return s * 85070591730234615865843651857942052864.0  # 2^126


@triton.jit
def _w4_raw(byte, HIGH: tl.constexpr, W_FMT: tl.constexpr):
    """fp32 raw values of the low or high nibbles of ``byte`` (int32 0..255), by bit placement.

    int4 code c: the fp32 1 + c/16 (c in the top four mantissa bits of 1.0): a shift and one
    and-or, and ``_w4_affine_of``'s S and B make c - zero times the scale in one FMA, with no
    int -> float conversion. e2m1: sign to fp16's bit 15, the three magnitude bits to bits 9-11
    (value * 2^-14, exact; ``_common.e2m1_to_f32``'s placement), then fp16 -> fp32.
    """
    if W_FMT == "int4":
        if HIGH:
            bits = (byte << 15) & 0x780000
        else:
            bits = (byte << 19) & 0x780000
        return (bits | 0x3F800000).to(tl.float32, bitcast=True)
    else:
        if HIGH:
            bits = ((byte & 0x80) << 8) | ((byte & 0x70) << 5)
        else:
            bits = ((byte & 0x8) << 12) | ((byte & 0x7) << 9)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _w4_bytes(
    w_base, cols, ok, kb, stride_wn, stride_wk, HALF: tl.constexpr, RUNS: tl.constexpr = 1, PK: tl.constexpr = 0, KP=0
):  # fmt: skip
    """The [R, RUNS * HALF] byte tile (uint8) of W rows ``cols`` for the RUNS pack blocks from
    column ``kb`` (contiguous bytes; runs at or past KP masked)."""
    c = tl.arange(0, RUNS * HALF)
    m = ok[:, None]
    if RUNS > 1:
        m = m & (kb + (c // HALF) * PK < KP)[None, :]
    return tl.load(w_base + cols[:, None] * stride_wn + (kb // 2 + c)[None, :] * stride_wk, mask=m, other=0)


@triton.jit
def _w4_decode(
    byte, ws_base, wz_base, cols, ok, kb, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, R: tl.constexpr,
    RUNS: tl.constexpr = 1, PK: tl.constexpr = 0, KP=0, pre=None,
):  # fmt: skip
    """The byte tile of the pack block(s) at ``kb`` as the raw values of its low and high halves
    with their affine maps: (v_lo, S_lo, B_lo, v_hi, S_hi, B_hi), weights = v * S + B. ``pre``:
    as ``_w4_group``."""
    byte = byte.to(tl.int32)
    ws_rows = ws_base + cols * stride_wsn
    wz_rows = wz_base + cols * stride_wsn  # zero points share the scale's shape and strides
    s, z = _w4_group(ws_rows, wz_rows, ok, kb, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, R, RUNS, PK, KP, pre=pre)
    s_lo, b_lo = _w4_affine_of(s, z, W_FMT)
    s_hi, b_hi = s_lo, b_lo
    if 2 * HALF > GROUP:  # the halves lie in different groups
        s, z = _w4_group(
            ws_rows, wz_rows, ok, kb + HALF, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, R, RUNS, PK, KP, pre=pre
        )  # fmt: skip
        s_hi, b_hi = _w4_affine_of(s, z, W_FMT)
    return _w4_raw(byte, False, W_FMT), s_lo, b_lo, _w4_raw(byte, True, W_FMT), s_hi, b_hi


@triton.jit
def _bf16_pair(b):
    """int32 registers holding the bf16 bits ``b`` twice (a paired PTX operand)."""
    return (b & 0xFFFF) * 0x10001


@triton.jit
def _w4_unword(v0, v1, v2, v3, R: tl.constexpr, HALF: tl.constexpr):
    """[R, HALF] from the values of bytes 0..3 of each word ([R, HALF/4] each): column 4q + j is
    v_j[:, q] (joins add a trailing axis: (q, a, b) holds v_{2a + b})."""
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), [R, HALF])


@triton.jit
def _a_half(
    a_row_ptr, row_ok, perm_base, kh, KD, KP, stride_ak, stride_pk,
    ACT_ORDER: tl.constexpr, EVEN_K: tl.constexpr, HALF: tl.constexpr, OUT_DTYPE: tl.constexpr,
    RUNS: tl.constexpr = 1, PK: tl.constexpr = 0,
):  # fmt: skip
    """A [BM, RUNS * HALF] at columns kh + r * PK + c (c < HALF, r < RUNS) of the (act-order:
    permuted) K order, as OUT_DTYPE."""
    c = tl.arange(0, RUNS * HALF)
    offs = kh + c
    if RUNS > 1:
        offs = kh + (c // HALF) * PK + c % HALF
    return _a_cols(a_row_ptr, row_ok, perm_base, offs, KD, KP, stride_ak, stride_pk, ACT_ORDER, EVEN_K, OUT_DTYPE)


@triton.jit
def _a_cols(
    a_row_ptr, row_ok, perm_base, offs, KD, KP, stride_ak, stride_pk,
    ACT_ORDER: tl.constexpr, EVEN_K: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """A [BM, len(offs)] at columns ``offs`` of the (act-order: permuted) K order, as OUT_DTYPE."""
    if EVEN_K:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (offs < KD)[None, :]
    if ACT_ORDER:
        offs = tl.load(perm_base + offs * stride_pk, mask=offs < KP, other=0)
    return tl.load(a_row_ptr[:, None] + offs[None, :] * stride_ak, mask=mask, other=0).to(OUT_DTYPE)
