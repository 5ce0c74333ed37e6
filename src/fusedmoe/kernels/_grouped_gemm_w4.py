"""The 4-bit weight x float activation grouped GEMM (``grouped_gemm_w4.py`` has the contract).

Weights come in the w4 layout (``quant.w4_layout``): along K, blocks of PK columns whose byte j
holds column j (low nibble) and column PK/2 + j (high nibble). One program computes a BM x BN
tile of C = A_rows @ W[e]^T for one expert e (row mapping as in ``_grouped_gemm``: aligned
blocks of ``sorted_ids``, or rows of one expert's batched slab), over its share of K:

    for each K step of BK (a multiple of PK), for each block of PK columns in it:
        bytes  = W[e][cols, block] as uint8                 [BN, PK/2], K contiguous
        lo, hi = bytes & 0xF, bytes >> 4                    two [BN, PK/2] code tiles, no shuffle
        W_lo, W_hi = dequantized with one scale per row each (a half lies inside one group,
                     or covers whole groups: then scales are broadcast per group)
        acc   += W_lo x A[:, lo half] + W_hi x A[:, hi half]

Dequantization is bit placement and one FMA per weight with per-row constants, no table
lookup and no int -> float conversion (``_w4_raw``, ``_w4_affine_of``): an int4 code c becomes
the fp32 1 + c/16 (c shifted into the top mantissa bits of 1.0), and (c - zero) * scale =
raw * 16 scale - (16 + zero) * scale; an e2m1 code becomes fp16 bits equal to value * 2^-14
(``_common.e2m1_to_f32``'s placement) and 2^14 is folded into the per-row scale.

How the two tiles meet (constexpr ``MODE``; H100 numbers from ``scripts/kbench_w4.py``):

* "dot": acc [BM, BN] += A [BM, h] @ W^T [h, BN] (tensor cores; W transposed into the B slot,
  which Hopper's wgmma reads from shared memory: the dequantized tile is stored there).
* "swap": acc [BN, BM] += W [BN, h] @ A^T [h, BM]. The dequantized W tile is the left operand,
  which wgmma can take from registers as produced (K contiguous, no transpose, no store to
  shared memory); A^T goes through shared memory, as loads do anyway. BM becomes the MMA's
  N (16..256), BN its M (64 per warpgroup), so small BM stays efficient. Prefill: Mixtral int4
  GEMM2 at T = 4096, BM 128 x BN 128: 3.18 ms swap vs 3.99 ms dot; BM 256 (swap only, the
  accumulator being [BN, BM]) 2.44 ms. At BM 16 "dot" wins for the e2m1 formats. Dots chained
  inside a K step are waited for one by one (a register-A wgmma is left in flight only when
  its result is the loop-carried accumulator); at BM 32 the 64-column blocks of a step are
  concatenated in K order for one dot a step (``grouped_gemm_w4.dot_cat``).
* "fma" (BM 1..8, decode): fp32 multiply-reduce per A row (``_grouped_gemm._fma_rows``).
  BM 4 and 8 were 5-10x slower than a BM 16 dot tile: kept for correctness only.
* "fma1" (BM 1): acc [BN, h] += W * a: fp32 partial sums kept per K position, reduced over K
  once after the loop instead of a cross-thread reduction per K step (Mixtral int4 GEMM2 at
  T = 1: 102 vs 128 us). W comes as int32 words, four bytes of a row, each unpacked to its
  eight fp32 weights at once (``_w4_word_mac``): loaded as bytes, the loop-carried tiles were
  a register per byte, re-packed around every PTX instance (the K loop 622 -> 488 SASS
  instructions a step with the one-multiply e2m1 unpack; MXFP4 T = 1 on an H200: Mixtral
  167 -> 152 us, gpt-oss 72 -> 62). The FMA modes step one pack block at a time with that
  block's loads issued one step ahead (``_w4_fma_loads``): Triton pipelines only loads that
  feed tl.dot.

Act-order on the tensor cores: A's columns are permuted per expert into the weights' sorted
K order first (``_w4_permute_a_kernel``, a row per aligned slot), so the GEMM reads A rows
with vector loads; the FMA path gathers A's columns through ``perm`` in its tile loads.

Split-K (``SPLIT_K`` > 1, grid axis 1): program s walks K range [s*K_SPLIT, (s+1)*K_SPLIT)
and stores fp32 partial tiles (global scale applied; the bias added by split 0 only; the
router weight applied when there is no activation, since it is linear) into P[s]; the sum
over s is done in a fixed order by ``moe_sum`` (GEMM2) or ``_w4_reduce_kernel`` (which
finishes the epilogue: activation, router weight, output quantization).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import apply_act, pdl_wait, quant_linear
from ._grouped_gemm import _fma_rows
from ._w4_operands import (
    _a_cols,
    _a_half,
    _bf16_pair,
    _e2m1_bits,
    _w4_affine_of,
    _w4_bytes,
    _w4_decode,
    _w4_group,
    _w4_raw,
    _w4_step_codes,
    _w4_step_scales,
    _w4_unpack_args,
    _w4_unword,
)
from ._w4_unpack import e2m1_word_f32, w4_unpack


@triton.jit
def _w4_tile_ids(pid, num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid``: GROUP_M row blocks per column block walked
    together, so consecutive programs share W[e]'s columns in L2."""
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    local = pid % in_group
    return first_m + local % rows, local // rows


@triton.jit
def _w4_rows(
    pid_m, sorted_ids_ptr, block_expert_ptr, counts_ptr, num_pairs, a_div, m_max, blocks_per_expert, num_experts,
    BATCHED: tl.constexpr, PAIR_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, A_SLOT: tl.constexpr = False,
):  # fmt: skip
    """(expert, idle, row_ok, A rows, C rows) of row block ``pid_m``; ``idle``: nothing to do.
    A_SLOT (standard layout): A has a row per aligned slot (``_w4_permute_a_kernel``'s output).
    PAIR_BLOCKS (standard layout): block b is pair b alone, its expert id unchecked
    (``AlignedRouting.pair_blocks``): ids outside [0, num_experts) are idle."""
    if BATCHED:
        e = pid_m // blocks_per_expert
        m0 = (pid_m % blocks_per_expert) * BLOCK_M
        count = tl.minimum(tl.load(counts_ptr + e), m_max)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < count
        a_rows = offs_m.to(tl.int64)
        return e.to(tl.int64), m0 >= count, row_ok, a_rows, a_rows
    else:
        e = tl.load(block_expert_ptr + pid_m)
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if PAIR_BLOCKS:
            ids = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
            idle = (e < 0) | (e >= num_experts)
        else:
            ids = tl.load(sorted_ids_ptr + slots)
            idle = e < 0
        row_ok = ids < num_pairs
        if A_SLOT:
            a_rows = slots.to(tl.int64)
        else:
            a_rows = (ids // a_div).to(tl.int64)
        return e.to(tl.int64), idle, row_ok, a_rows, ids.to(tl.int64)


@triton.jit
def _w4_cols(
    pid_n, N, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr = False
):  # fmt: skip
    """Output columns of block ``pid_n``, which are in range, and the W rows (gate, up) that feed
    them. EVEN_N (BLOCK_N divides N): all of them, a constant, so W's byte and scale loads carry
    no mask."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if EVEN_N:
        n_ok = tl.full([BLOCK_N], True, tl.int1)
    if GATED and INTERLEAVED:
        return offs_n, n_ok, 2 * offs_n, 2 * offs_n + 1
    elif GATED:
        return offs_n, n_ok, offs_n, offs_n + N
    else:
        return offs_n, n_ok, offs_n, offs_n


@triton.jit
def _w4_fma_loads(
    a_row_ptr, row_ok, perm_base, w_base, g_cols, u_cols, n_ok, kb, live,
    KD, KP, stride_ak, stride_pk, stride_wn, stride_wk,
    ACT_ORDER: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, HALF: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """The FMA path's loads for the pack block at ``kb`` (nothing when not ``live``: past this
    program's K range): "fma1" words (``_w4_word_loads``), "fma" (gate bytes, up bytes, A's low
    half, A's high half)."""
    if MODE == "fma1":
        return _w4_word_loads(
            a_row_ptr, row_ok, perm_base, w_base, g_cols, u_cols, n_ok, kb, live,
            KD, KP, stride_ak, stride_pk, stride_wn, ACT_ORDER, EVEN_K, GATED, HALF,
        )  # fmt: skip
    else:
        byte_g = _w4_bytes(w_base, g_cols, n_ok & live, kb, stride_wn, stride_wk, HALF)
        byte_u = byte_g
        if GATED:
            byte_u = _w4_bytes(w_base, u_cols, n_ok & live, kb, stride_wn, stride_wk, HALF)
        r_ok = row_ok & live
        F32: tl.constexpr = tl.float32
        a_lo = _a_half(a_row_ptr, r_ok, perm_base, kb, KD, KP, stride_ak, stride_pk, ACT_ORDER, EVEN_K, HALF, F32)
        kh = kb + HALF
        a_hi = _a_half(a_row_ptr, r_ok, perm_base, kh, KD, KP, stride_ak, stride_pk, ACT_ORDER, EVEN_K, HALF, F32)
        return byte_g, byte_u, a_lo, a_hi


@triton.jit
def _w4_fma_step(
    acc, acc_u, a_lo, a_hi, byte_g, byte_u, ws_base, wz_base, g_cols, u_cols, ok, kb, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One pack block of "fma" (BM 2-8, kept for correctness: module docstring): dequantize the
    gate (and up) byte tiles in fp32 (raw * S + B) and reduce them per A row
    (``_grouped_gemm._fma_rows``)."""
    v_lo, s_lo, b_lo, v_hi, s_hi, b_hi = _w4_decode(
        byte_g, ws_base, wz_base, g_cols, ok, kb, stride_wsn, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, BLOCK_N
    )
    w_lo, w_hi = v_lo * s_lo + b_lo, v_hi * s_hi + b_hi
    u_lo, u_hi = w_lo, w_hi
    if GATED:
        v_lo, s_lo, b_lo, v_hi, s_hi, b_hi = _w4_decode(
            byte_u, ws_base, wz_base, u_cols, ok, kb, stride_wsn, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, BLOCK_N
        )
        u_lo, u_hi = v_lo * s_lo + b_lo, v_hi * s_hi + b_hi
    acc, acc_u = _fma_rows(acc, acc_u, a_lo, w_lo, u_lo, GATED, BLOCK_M)
    return _fma_rows(acc, acc_u, a_hi, w_hi, u_hi, GATED, BLOCK_M)


@triton.jit
def _w4_fma_block(
    acc, acc_u, loads, ws_base, wz_base, g_cols, u_cols, ok, kb, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, GATED: tl.constexpr,
    MODE: tl.constexpr, FAST: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One pack block on the FMA path from what ``_w4_fma_loads`` loaded."""
    if MODE == "fma1":
        w_g, w_u, a_lo, a_hi = loads
        acc = _w4_word_mac(
            acc, w_g, a_lo, a_hi, ws_base, wz_base, g_cols, ok, kb, stride_wsn, stride_wsk,
            W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT,
        )  # fmt: skip
        if GATED:
            acc_u = _w4_word_mac(
                acc_u, w_u, a_lo, a_hi, ws_base, wz_base, u_cols, ok, kb, stride_wsn, stride_wsk,
                W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT,
            )  # fmt: skip
        return acc, acc_u
    else:
        byte_g, byte_u, a_lo, a_hi = loads
        return _w4_fma_step(
            acc, acc_u, a_lo, a_hi, byte_g, byte_u, ws_base, wz_base, g_cols, u_cols, ok, kb, stride_wsn, stride_wsk,
            W_FMT, GROUP, HALF, HAS_ZERO, GATED, BLOCK_M, BLOCK_N,
        )  # fmt: skip


@triton.jit
def _w4_word_loads(
    a_row_ptr, row_ok, perm_base, w_base, g_cols, u_cols, n_ok, kb, live, KD, KP, stride_ak, stride_pk, stride_wn,
    ACT_ORDER: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """The "fma1" loads for the pack block at ``kb`` (nothing when not ``live``): the gate (and up)
    words [BN, HALF/4] (int32, four bytes of a row: byte j of word q is byte 4q + j of the block)
    and A's two halves, as ``_w4_fma_loads``."""
    q = tl.arange(0, HALF // 4)
    wp = w_base.to(tl.pointer_type(tl.int32))  # bytes are contiguous along K (W4Tensor.bytes_u8)
    offs = (kb // 8 + q)[None, :]
    ok = (n_ok & live)[:, None]
    w_g = tl.load(wp + g_cols[:, None] * (stride_wn // 4) + offs, mask=ok, other=0)
    w_u = w_g
    if GATED:
        w_u = tl.load(wp + u_cols[:, None] * (stride_wn // 4) + offs, mask=ok, other=0)
    r_ok = row_ok & live
    a_lo = _a_half(a_row_ptr, r_ok, perm_base, kb, KD, KP, stride_ak, stride_pk, ACT_ORDER, EVEN_K, HALF, tl.float32)
    a_hi = _a_half(
        a_row_ptr, r_ok, perm_base, kb + HALF, KD, KP, stride_ak, stride_pk, ACT_ORDER, EVEN_K, HALF, tl.float32
    )
    return w_g, w_u, a_lo, a_hi


@triton.jit
def _w4_word_mac(
    acc, word, a_lo, a_hi, ws_base, wz_base, cols, ok, kb, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """acc [R, HALF] + the weights of a word tile times A's halves, two FFMA a weight pair. The
    eight [R, HALF/4] weight tiles of the words (FAST, e2m1: by PTX, ``_w4_unpack.e2m1_word_f32``;
    else raw * S + B per nibble, ``_w4_raw``) are joined back into the [R, HALF] halves in
    registers, so A comes as two contiguous vector loads."""
    R: tl.constexpr = word.shape[0]
    ws_rows = ws_base + cols * stride_wsn
    wz_rows = wz_base + cols * stride_wsn  # zero points share the scale's shape and strides
    RAW: tl.constexpr = FAST and W_FMT == "mxfp4"  # e8m0 codes stay codes until their bf16 bits
    s_lo, z_lo = _w4_group(ws_rows, wz_rows, ok, kb, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, R, PER=4, RAW=RAW)
    s_hi, z_hi = s_lo, z_lo
    if 2 * HALF > GROUP:  # the halves lie in different groups
        s_hi, z_hi = _w4_group(
            ws_rows, wz_rows, ok, kb + HALF, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, R, PER=4, RAW=RAW
        )
    if FAST:  # e2m1 (``fast_unpack``)
        l0, l1, l2, l3, h0, h1, h2, h3 = e2m1_word_f32(
            word, _bf16_pair(_e2m1_bits(s_lo, W_FMT, SPLIT)), _bf16_pair(_e2m1_bits(s_hi, W_FMT, SPLIT)), SPLIT
        )
    else:
        sc_lo, b_lo = _w4_affine_of(s_lo, z_lo, W_FMT)
        sc_hi, b_hi = _w4_affine_of(s_hi, z_hi, W_FMT)
        y0, y1, y2, y3 = word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF, (word >> 24) & 0xFF
        l0, l1 = _w4_raw(y0, False, W_FMT) * sc_lo + b_lo, _w4_raw(y1, False, W_FMT) * sc_lo + b_lo
        l2, l3 = _w4_raw(y2, False, W_FMT) * sc_lo + b_lo, _w4_raw(y3, False, W_FMT) * sc_lo + b_lo
        h0, h1 = _w4_raw(y0, True, W_FMT) * sc_hi + b_hi, _w4_raw(y1, True, W_FMT) * sc_hi + b_hi
        h2, h3 = _w4_raw(y2, True, W_FMT) * sc_hi + b_hi, _w4_raw(y3, True, W_FMT) * sc_hi + b_hi
    acc = tl.fma(_w4_unword(l0, l1, l2, l3, R, HALF), a_lo, acc)
    return tl.fma(_w4_unword(h0, h1, h2, h3, R, HALF), a_hi, acc)


@triton.jit
def _w4_mac(acc, w, a, MODE: tl.constexpr, IEEE: tl.constexpr):
    """acc + the product of a dequantized W half [BN, h] and an A half [BM, h] (module docstring)."""
    if MODE == "swap":
        if IEEE:
            return tl.dot(w, tl.trans(a), acc, input_precision="ieee")
        else:
            return tl.dot(w, tl.trans(a), acc)
    else:
        if IEEE:
            return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _w4_tiles(
    w_base, ws_base, wz_base, cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr, R: tl.constexpr, OP: tl.constexpr, RUNS: tl.constexpr, PK: tl.constexpr, KP,
    KS: tl.constexpr, kps, pre=None,
):  # fmt: skip
    """The dequantized W tiles [R, RUNS * HALF] in OP (low half, high half) of the RUNS pack blocks
    at ``kb``: FAST, paired 16-bit math in PTX (``_w4_unpack``); else one fp32 FMA per weight
    and a cast. Scales and zero points: ``ws_base`` and ``wz_base`` start at the K step's first
    group, where ``kb`` is column KS and KP column ``kps`` (``_w4_step_scales``); ``pre``: the
    step's codes, loaded beforehand (``_w4_step_codes``: ``LaunchConfig.scale_loads`` 1 or 2)."""
    byte = _w4_bytes(w_base, cols, ok, kb, stride_wn, stride_wk, HALF, RUNS, PK, KP)
    if FAST:
        ws_rows = ws_base + cols * stride_wsn
        wz_rows = wz_base + cols * stride_wsn
        m_lo, s_lo, t_lo = _w4_unpack_args(
            ws_rows, wz_rows, ok, KS, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, SPLIT, R, OP, RUNS, PK, kps, pre
        )
        m_hi, s_hi, t_hi = m_lo, s_lo, t_lo
        if 2 * HALF > GROUP:  # the halves lie in different groups
            m_hi, s_hi, t_hi = _w4_unpack_args(
                ws_rows, wz_rows, ok, KS + HALF, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, SPLIT, R, OP, RUNS, PK,
                kps, pre,
            )  # fmt: skip
        return w4_unpack(byte, m_lo, m_hi, s_lo, s_hi, t_lo, t_hi, W_FMT, OP, SPLIT)
    else:
        v_lo, s_lo, b_lo, v_hi, s_hi, b_hi = _w4_decode(
            byte, ws_base, wz_base, cols, ok, KS, stride_wsn, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, R, RUNS, PK,
            kps, pre,
        )  # fmt: skip
        return (v_lo * s_lo + b_lo).to(OP), (v_hi * s_hi + b_hi).to(OP)


@triton.jit
def _w4_tile_mac(
    acc, a_lo, a_hi, w_base, ws_base, wz_base, cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr, R: tl.constexpr, OP: tl.constexpr,
    RUNS: tl.constexpr, PK: tl.constexpr, KP, KS: tl.constexpr, kps, CAT: tl.constexpr = False, pre=None,
):  # fmt: skip
    """acc + the RUNS pack blocks at ``kb`` (column KS of the K step: ``_w4_tiles``) of W rows
    ``cols`` times A: two dots (A's low and high halves), or under CAT one dot of the blocks in K
    order (``a_lo`` is then A's whole step)."""
    if CAT:  # each block unpacked with its own [R, 1] scales, then concatenated
        if RUNS == 1:
            w = _w4_block(w_base, ws_base, wz_base, cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
                          W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, R, OP, PK, KP, KS, kps, pre)  # fmt: skip
        else:
            w = _w4_block_pair(w_base, ws_base, wz_base, cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
                               W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, R, OP, PK, KP, KS, kps, pre)  # fmt: skip
            if RUNS == 4:
                w = _cat_k(w, _w4_block_pair(w_base, ws_base, wz_base, cols, ok, kb + 2 * PK, stride_wn, stride_wk,
                                             stride_wsn, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, R, OP,
                                             PK, KP, KS + 2 * PK, kps, pre))  # fmt: skip
        acc = _w4_mac(acc, w, a_lo, MODE, IEEE)
    else:
        w_lo, w_hi = _w4_tiles(
            w_base, ws_base, wz_base, cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
            W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, R, OP, RUNS, PK, KP, KS, kps, pre,
        )  # fmt: skip
        acc = _w4_mac(acc, w_lo, a_lo, MODE, IEEE)
        acc = _w4_mac(acc, w_hi, a_hi, MODE, IEEE)
    return acc


@triton.jit
def _cat_k(x, y):
    """[R, 2C]: x's columns, then y's (a join along a new last axis, moved before the columns)."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.join(x, y), (0, 2, 1)), [R, 2 * C])


@triton.jit
def _w4_block_pair(
    w_base, ws_base, wz_base, cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr, R: tl.constexpr, OP: tl.constexpr, PK: tl.constexpr, KP, KS: tl.constexpr, kps, pre=None,
):  # fmt: skip
    """The [R, 2 PK] tile of the pack blocks at ``kb`` and ``kb + PK`` in K order (``_w4_block``)."""
    return _cat_k(
        _w4_block(w_base, ws_base, wz_base, cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
                  W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, R, OP, PK, KP, KS, kps, pre),
        _w4_block(w_base, ws_base, wz_base, cols, ok, kb + PK, stride_wn, stride_wk, stride_wsn, stride_wsk,
                  W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, R, OP, PK, KP, KS + PK, kps, pre),
    )  # fmt: skip


@triton.jit
def _w4_block(
    w_base, ws_base, wz_base, cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, HAS_ZERO: tl.constexpr, FAST: tl.constexpr,
    SPLIT: tl.constexpr, R: tl.constexpr, OP: tl.constexpr, PK: tl.constexpr, KP, KS: tl.constexpr, kps, pre=None,
):  # fmt: skip
    """The dequantized [R, PK] tile of the pack block at ``kb`` (column KS of the K step), columns
    in K order (its low half, then its high half); a block at or past KP is zeros (bytes and
    scales masked)."""
    lo, hi = _w4_tiles(
        w_base, ws_base, wz_base, cols, ok & (kb < KP), kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
        W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, R, OP, 1, PK, KP, KS, kps, pre,
    )  # fmt: skip
    return _cat_k(lo, hi)


@triton.jit
def _w4_dot_step(
    acc, acc_u, a_row_ptr, row_ok, perm_base, w_base, ws_base, wz_base, g_cols, u_cols, n_ok, kb,
    KD, KP, stride_ak, stride_pk, stride_wn, stride_wk, stride_wsn, stride_wsk,
    W_FMT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, ACT_ORDER: tl.constexpr, HAS_ZERO: tl.constexpr,
    GATED: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr, OP: tl.constexpr,
    FAST: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, RUNS: tl.constexpr, PK: tl.constexpr,
    KS: tl.constexpr, kps, CAT: tl.constexpr = False, pre_g=None, pre_u=None,
):  # fmt: skip
    """RUNS pack blocks on the tensor cores: two dots (A's low and high halves) per row set, each
    over the RUNS blocks' halves (K = RUNS * HALF: 32-column halves make K = 32 dots, which
    wait for each other; two runs make K = 64 ones), or under CAT (``grouped_gemm_w4.dot_cat``)
    one dot over the RUNS blocks in K order with A's step loaded as it lies. ``pre_g``, ``pre_u``:
    the step's scale codes of the gate and up rows, loaded beforehand (``_w4_step_codes``), or None."""
    if EVEN_K:
        ok = n_ok
    else:
        ok = n_ok & (kb < KP)
    if CAT:
        a_lo = _a_cols(
            a_row_ptr, row_ok, perm_base, kb + tl.arange(0, RUNS * PK), KD, KP, stride_ak, stride_pk,
            ACT_ORDER, EVEN_K, OP,
        )  # fmt: skip
        a_hi = a_lo
    else:
        a_lo = _a_half(
            a_row_ptr, row_ok, perm_base, kb, KD, KP, stride_ak, stride_pk, ACT_ORDER, EVEN_K, HALF, OP, RUNS, PK
        )
        a_hi = _a_half(
            a_row_ptr, row_ok, perm_base, kb + HALF, KD, KP, stride_ak, stride_pk, ACT_ORDER, EVEN_K, HALF, OP, RUNS, PK
        )
    acc = _w4_tile_mac(
        acc, a_lo, a_hi, w_base, ws_base, wz_base, g_cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
        W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, MODE, IEEE, BLOCK_N, OP, RUNS, PK, KP, KS, kps, CAT, pre_g,
    )  # fmt: skip
    if GATED:
        acc_u = _w4_tile_mac(
            acc_u, a_lo, a_hi, w_base, ws_base, wz_base, u_cols, ok, kb, stride_wn, stride_wk, stride_wsn, stride_wsk,
            W_FMT, GROUP, HALF, HAS_ZERO, FAST, SPLIT, MODE, IEEE, BLOCK_N, OP, RUNS, PK, KP, KS, kps, CAT, pre_u,
        )  # fmt: skip
    return acc, acc_u


@triton.jit
def _w4_finish(
    acc, acc_u, c_ptrs, c_mask, rw_ptrs, row_ok, c_scale_ptr, alpha, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    OUT_QUANT: tl.constexpr, EXACT_CAST: tl.constexpr,
):  # fmt: skip
    """Activation, router weight, store (in C's dtype, or quantized with the static scale)."""
    if GATED:
        acc = apply_act(acc, acc_u, alpha, limit, ACT)
    else:
        acc = apply_act(acc, acc, alpha, limit, ACT)
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(rw_ptrs, mask=row_ok, other=0).to(tl.float32)[:, None]
    if OUT_QUANT == "none":
        tl.store(c_ptrs, acc.to(c_ptrs.dtype.element_ty), mask=c_mask)
    else:
        tl.store(c_ptrs, quant_linear(acc, tl.load(c_scale_ptr), OUT_QUANT, EXACT_CAST), mask=c_mask)


# num_experts only bounds pair-block ids: not specialised, so a binary serves any E (the tuner's
# workers compile with 2 experts' weights what the main process runs with E)
@triton.jit(do_not_specialize=["num_experts"])
def _w4_gemm_kernel(
    a_ptr, w_ptr, w_scale_ptr, w_zero_ptr, w_gscale_ptr, perm_ptr, bias_ptr, route_w_ptr,
    c_ptr,  # C, or the fp32 partials P [SPLIT_K, ...] when SPLIT_K > 1
    c_scale_ptr, sorted_ids_ptr, block_expert_ptr, counts_ptr,
    N,  # columns of C (I under a gated ACT, whose W has 2N rows)
    KD,  # K of A (logical)
    KP,  # K of W's storage: KD rounded up to PK
    K_SPLIT,  # K columns per split (a multiple of BLOCK_K)
    num_pairs, a_div, m_max, blocks_per_expert, num_experts, num_m_blocks, alpha, limit,
    stride_ae, stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_wse, stride_wsn, stride_wsk,
    stride_pe, stride_pk,
    stride_be, stride_bn,
    stride_re, stride_rm,
    stride_cs, stride_ce, stride_cm, stride_cn,
    BATCHED: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,  # standard layout: block b is pair b alone (AlignedRouting.pair_blocks)
    W_FMT: tl.constexpr,  # "int4" | "mxfp4" | "nvfp4"
    GROUP: tl.constexpr,  # K columns per scale
    PK: tl.constexpr,  # the layout's pack block
    RUNS: tl.constexpr,  # tensor-core tiles: pack blocks per dot (``grouped_gemm_w4.dot_runs``)
    CAT: tl.constexpr,  # W-major tiles: one dot per K step, the blocks in K order (``dot_cat``)
    ACT_ORDER: tl.constexpr,  # A's columns gathered through perm (groups sorted at conversion)
    HAS_ZERO: tl.constexpr,
    HAS_W_GSCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,  # ACT takes a gate and an up row (Activation.is_gated)
    INTERLEAVED: tl.constexpr,
    OUT_QUANT: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    MODE: tl.constexpr,  # "dot" | "swap" | "fma" | "fma1" (module docstring)
    FAST: tl.constexpr,  # W unpacked by PTX (``_w4_unpack``): tensor cores bf16/fp16 pairs, FMA e2m1 to fp32
    # FAST: the scale is two 16-bit factors: int4, s_hi + s_lo (it is not a value of the
    # activations' type); e2m1, 2^126 x s (not every scale times 2^126 is a bf16 value)
    SPLIT_SCALE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # KD == KP and every split is whole BLOCK_K steps: no K masks
    EVEN_N: tl.constexpr,  # BLOCK_N divides N: no column masks on W's loads
    A_SLOT: tl.constexpr,  # A has a row per aligned slot (act-order A permuted beforehand)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SCALE_LOADS: tl.constexpr,  # tensor-core tiles: where scale codes are loaded (LaunchConfig.scale_loads)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):  # fmt: skip
    # 119 lines: one Triton kernel; the unpack, the FMA/dot paths and the split-K epilogue are constexpr branches and
    # @triton.jit helpers.
    pdl_wait(PDL)
    pid_m, pid_n = _w4_tile_ids(tl.program_id(0), num_m_blocks, N, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    e, idle, row_ok, a_rows, c_rows = _w4_rows(
        pid_m, sorted_ids_ptr, block_expert_ptr, counts_ptr, num_pairs, a_div, m_max, blocks_per_expert, num_experts,
        BATCHED, PAIR_BLOCKS, BLOCK_M, A_SLOT,
    )  # fmt: skip
    if idle:
        return
    offs_n, n_ok, g_cols, u_cols = _w4_cols(pid_n, N, GATED, INTERLEAVED, BLOCK_N, EVEN_N)
    HALF: tl.constexpr = PK // 2
    FMA: tl.constexpr = MODE == "fma" or MODE == "fma1"
    OP: tl.constexpr = tl.float32 if FMA else DOT_DTYPE
    IEEE: tl.constexpr = DOT_DTYPE == tl.float32  # fp32 operands (the interpreter): no tf32
    a_row_ptr = a_ptr + e * stride_ae + a_rows * stride_am
    w_base = w_ptr + e * stride_we
    ws_base = w_scale_ptr + e * stride_wse
    wz_base = w_zero_ptr + e * stride_wse
    perm_base = perm_ptr + e * stride_pe
    if MODE == "swap":
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif MODE == "fma1":
        acc = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = acc  # the up rows' accumulator, carried only under a gated ACT

    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, KP)
    if FMA:
        # NB = BLOCK_K / PK pack blocks (1 or 2, ``fit_w4_config``) per K step, their W and A
        # loaded one step ahead: these loads do not feed tl.dot, so the compiler does not
        # pipeline them (no async copies in the TTGIR of the first H100 run), and each step
        # waited for its loads before its math. Two blocks a step put twice the bytes in flight
        # per thread (a [32, 32] byte tile is 8 bytes a thread).
        NB: tl.constexpr = BLOCK_K // PK
        nxt = _w4_fma_loads(
            a_row_ptr, row_ok, perm_base, w_base, g_cols, u_cols, n_ok, k_lo, k_lo < k_hi,
            KD, KP, stride_ak, stride_pk, stride_wn, stride_wk, ACT_ORDER, EVEN_K, GATED, HALF, MODE,
        )  # fmt: skip
        nxt2 = nxt
        if NB == 2:
            nxt2 = _w4_fma_loads(
                a_row_ptr, row_ok, perm_base, w_base, g_cols, u_cols, n_ok, k_lo + PK, k_lo + PK < k_hi,
                KD, KP, stride_ak, stride_pk, stride_wn, stride_wk, ACT_ORDER, EVEN_K, GATED, HALF, MODE,
            )  # fmt: skip
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cur = nxt
            cur2 = nxt2
            k1 = k0 + BLOCK_K
            nxt = _w4_fma_loads(
                a_row_ptr, row_ok, perm_base, w_base, g_cols, u_cols, n_ok, k1, k1 < k_hi,
                KD, KP, stride_ak, stride_pk, stride_wn, stride_wk, ACT_ORDER, EVEN_K, GATED, HALF, MODE,
            )  # fmt: skip
            if NB == 2:
                nxt2 = _w4_fma_loads(
                    a_row_ptr, row_ok, perm_base, w_base, g_cols, u_cols, n_ok, k1 + PK, k1 + PK < k_hi,
                    KD, KP, stride_ak, stride_pk, stride_wn, stride_wk, ACT_ORDER, EVEN_K, GATED, HALF, MODE,
                )  # fmt: skip
            acc, acc_u = _w4_fma_block(
                acc, acc_u, cur, ws_base, wz_base, g_cols, u_cols, n_ok, k0, stride_wsn, stride_wsk,
                W_FMT, GROUP, HALF, HAS_ZERO, GATED, MODE, FAST, SPLIT_SCALE, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            if NB == 2:  # the second block may lie past this program's K: its scales are masked
                acc, acc_u = _w4_fma_block(
                    acc, acc_u, cur2, ws_base, wz_base, g_cols, u_cols, n_ok & (k0 + PK < k_hi), k0 + PK,
                    stride_wsn, stride_wsk, W_FMT, GROUP, HALF, HAS_ZERO, GATED, MODE, FAST, SPLIT_SCALE,
                    BLOCK_M, BLOCK_N,
                )  # fmt: skip
    else:
        # Every program has K to walk (``fit_w4_config`` leaves no split empty). Said to the
        # compiler, the loop has no zero-trip path that sets the accumulators by moves, which
        # made ptxas serialise every register-A wgmma of "swap" (C7515: a wait after each HGMMA,
        # nothing of the next tile's unpack overlapped; 32 -> 6 warpgroup barriers per K step,
        # int4 GEMM1 BM 64). The C-major tiles (mma.sync at BM 16-32) do not have the stall and
        # measured slower with it (MXFP4 BM 16: Qwen3 GEMM1 T = 256 227 -> 258 us).
        if MODE == "swap":
            tl.assume(k_hi > k_lo)
        # where each step's scale codes are loaded (``LaunchConfig.scale_loads``, ``_w4_step_codes``):
        # 0 beside each block's unpack, 1 in the step before, 2 all at the step's start
        nxt_g, nxt_u = None, None
        if SCALE_LOADS == 1:
            nxt_g, nxt_u = _w4_step_codes(
                ws_base, wz_base, g_cols, u_cols, n_ok, k_lo, KP, stride_wsn, stride_wsk,
                GROUP, BLOCK_K, HAS_ZERO, GATED,
            )  # fmt: skip
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ws_k, wz_k = _w4_step_scales(ws_base, wz_base, k0, stride_wsk, GROUP)
            pre_g, pre_u = nxt_g, nxt_u
            if SCALE_LOADS > 0:  # this step's codes (2), or the next step's (1)
                kc = k0
                ok_c = n_ok
                if SCALE_LOADS == 1:  # past the last step: nothing to load
                    kc = k0 + BLOCK_K
                    ok_c = n_ok & (kc < k_hi)
                codes = _w4_step_codes(
                    ws_base, wz_base, g_cols, u_cols, ok_c, kc, KP, stride_wsn, stride_wsk,
                    GROUP, BLOCK_K, HAS_ZERO, GATED,
                )  # fmt: skip
                if SCALE_LOADS == 2:
                    pre_g, pre_u = codes
                else:
                    nxt_g, nxt_u = codes
            for j in tl.static_range(BLOCK_K // (RUNS * PK)):
                kb = k0 + j * RUNS * PK
                acc, acc_u = _w4_dot_step(
                    acc, acc_u, a_row_ptr, row_ok, perm_base, w_base, ws_k, wz_k, g_cols, u_cols, n_ok, kb,
                    KD, KP, stride_ak, stride_pk, stride_wn, stride_wk, stride_wsn, stride_wsk,
                    W_FMT, GROUP, HALF, ACT_ORDER, HAS_ZERO, GATED, EVEN_K, MODE, IEEE, OP, FAST, SPLIT_SCALE,
                    BLOCK_N, RUNS, PK, j * RUNS * PK, KP - k0, CAT, pre_g, pre_u,
                )  # fmt: skip

    # ---- back to [BM, BN]; global scale; bias (split 0 only)
    if MODE == "swap":
        acc = tl.trans(acc)
        acc_u = tl.trans(acc_u)
    elif MODE == "fma1":
        acc = tl.sum(acc, axis=1)[None, :]
        acc_u = tl.sum(acc_u, axis=1)[None, :]
    if HAS_W_GSCALE:
        gs = tl.load(w_gscale_ptr + e)
        acc *= gs
        acc_u *= gs
    if HAS_BIAS:
        b_ok = n_ok & (pid_k == 0)
        acc += tl.load(bias_ptr + e * stride_be + g_cols * stride_bn, mask=b_ok, other=0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(bias_ptr + e * stride_be + u_cols * stride_bn, mask=b_ok, other=0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + pid_k * stride_cs + e * stride_ce + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    rw_ptrs = route_w_ptr + e * stride_re + c_rows * stride_rm
    _w4_finish(
        acc, acc_u, c_ptrs, row_ok[:, None] & n_ok[None, :], rw_ptrs, row_ok, c_scale_ptr, alpha, limit,
        GATED, ACT, MUL_ROUTED_WEIGHT, OUT_QUANT, EXACT_CAST,
    )  # fmt: skip


# num_experts not specialised: see _w4_gemm_kernel
@triton.jit(do_not_specialize=["num_experts"])
def _w4_reduce_kernel(
    p_ptr, c_ptr, c_scale_ptr, route_w_ptr, sorted_ids_ptr, block_expert_ptr, counts_ptr,
    N, num_pairs, m_max, blocks_per_expert, num_experts, alpha, limit,
    stride_ps, stride_pe, stride_pm, stride_pn,
    stride_re, stride_rm,
    stride_ce, stride_cm, stride_cn,
    SPLIT_K: tl.constexpr,
    BATCHED: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,  # ACT takes a gate and an up row (Activation.is_gated)
    INTERLEAVED: tl.constexpr,
    OUT_QUANT: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):  # fmt: skip
    """C = finish(sum over s of P[s]) for the rows the GEMM wrote (same row blocks), s in order."""
    pdl_wait(PDL)
    e, idle, row_ok, _, c_rows = _w4_rows(
        tl.program_id(0), sorted_ids_ptr, block_expert_ptr, counts_ptr, num_pairs, 1, m_max, blocks_per_expert,
        num_experts, BATCHED, PAIR_BLOCKS, BLOCK_M,
    )  # fmt: skip
    if idle:
        return
    offs_n, n_ok, g_cols, u_cols = _w4_cols(tl.program_id(1), N, GATED, INTERLEAVED, BLOCK_N)
    mask = row_ok[:, None] & n_ok[None, :]
    p_rows = p_ptr + e * stride_pe + c_rows[:, None] * stride_pm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = acc
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_rows + s * stride_ps + g_cols[None, :] * stride_pn, mask=mask, other=0)
        if GATED:
            acc_u += tl.load(p_rows + s * stride_ps + u_cols[None, :] * stride_pn, mask=mask, other=0)
    c_ptrs = c_ptr + e * stride_ce + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    rw_ptrs = route_w_ptr + e * stride_re + c_rows * stride_rm
    _w4_finish(
        acc, acc_u, c_ptrs, mask, rw_ptrs, row_ok, c_scale_ptr, alpha, limit,
        GATED, ACT, MUL_ROUTED_WEIGHT, OUT_QUANT, EXACT_CAST,
    )  # fmt: skip


# num_experts not specialised: see _w4_gemm_kernel
@triton.jit(do_not_specialize=["num_experts"])
def _w4_permute_a_kernel(
    a_ptr, perm_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, counts_ptr,
    KD, KP, num_pairs, a_div, m_max, blocks_per_expert, num_experts,
    stride_ae, stride_am, stride_ak, stride_pe, stride_pk, stride_oe, stride_om,
    BATCHED: tl.constexpr, PAIR_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):  # fmt: skip
    """Act-order A for the tensor-core path: out[row, j] = A[row's A row, perm[e, j]], the columns
    of the row's expert in its sorted (group-contiguous) order, zeros past K. Standard layout:
    a row per aligned slot; batched: [E, M_max, KP]. The GEMM then reads A with whole-row vector
    loads: gathering columns inside its tile loads cost 6.5x (Qwen3 int4 GEMM1 at T = 4096 on an
    H100: 4.10 ms against 0.63 ms without act-order; scalar loads that the pipeliner skips)."""
    pdl_wait(PDL)
    e, idle, row_ok, a_rows, _ = _w4_rows(
        tl.program_id(0), sorted_ids_ptr, block_expert_ptr, counts_ptr, num_pairs, a_div, m_max, blocks_per_expert,
        num_experts, BATCHED, PAIR_BLOCKS, BLOCK_M,
    )  # fmt: skip
    if idle:
        return
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.load(perm_ptr + e * stride_pe + offs * stride_pk, mask=offs < KP, other=0)
    vals = tl.load(
        a_ptr + e * stride_ae + a_rows[:, None] * stride_am + cols[None, :] * stride_ak,
        mask=row_ok[:, None] & (offs < KD)[None, :],
        other=0,
    )
    if BATCHED:
        o_rows = a_rows
    else:
        o_rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    o_mask = row_ok[:, None] & (offs < KP)[None, :]
    tl.store(out_ptr + e * stride_oe + o_rows[:, None] * stride_om + offs[None, :], vals, mask=o_mask)
