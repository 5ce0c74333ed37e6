"""The persistent, TMA-fed grouped GEMM (see ``grouped_gemm_persistent.py`` for the contract).

Prefill (>= ~16 rows per expert) ran the one-program-per-tile kernel (``_grouped_gemm``) at
340-540 of ~790 TFLOP/s in bf16 and 300-740 of ~1315 in fp8 on an H100. Three things that
kernel does not do, done here:

* a persistent grid: min(#SMs, #tiles) programs walk the (M block, N block) tiles with a
  stride of the grid size, GROUP_M row blocks per column block so consecutive tiles of a
  program and its neighbours share W[e] in L2. The number of M blocks in use is read on the
  device (``num_padded // BM``; the grid is sized from the host's upper bound, so there is
  no host sync and the launch can be captured in a CUDA graph). With ``flatten`` the tile
  loop and the K loop become one software pipeline, so the next tile's first loads are in
  flight while this tile's epilogue runs;
* W tiles through device-side tensor descriptors (TMA): a 2-D descriptor over W viewed as
  [E * N_w, K]. Rows past an expert's N_w belong to the next expert (or are zero-filled past
  the last); they only ever meet output columns >= N, which are masked at the store and
  zeroed before a group amax, and columns do not mix in a GEMM, so no 3-D descriptor is
  needed. K past the end is zero-filled by the hardware. Descriptors are typed fp8 (not the
  uint8 view that pointer loads need for ``other=0``): a bitcast between the TMA load and the
  dot could send the tile through registers on its way back to shared memory;
* A either gathered by pointer through ``sorted_ids // a_div`` (as the old kernel), or, with
  ``A_SORTED``, read by slot (row ``pid_m * BM + i`` of a [num_slots, K] buffer) through a
  descriptor: then both operands arrive by TMA, which warp specialization wants. Padding
  slots of such a buffer may hold anything: their rows are masked at the store, their scales
  load as 0, and rows do not mix, so nothing reaches a real row. ``C_SORTED`` writes C by
  slot (GEMM1 can produce GEMM2's A_SORTED input).

Operands meet as in ``_grouped_gemm`` (its ``_mac`` and ``_act_epilogue`` are used as they
are): float x float, and native w8a8 (fp8 x fp8, int8 x int8) with the stored bytes in
``tl.dot``, per-K-step scales (1 x g activation groups, bn x bk weight blocks) on each
partial product, tensor/token/channel scales once at the end; float x 8-bit weights with
tensor/channel scales are widened to the model dtype in registers.

A gated activation (GEMM1 with the activation in its epilogue) takes W13's gate and up rows
of the tile's BN output columns: with the split layout (gate n, up I + n) two descriptor
loads and two accumulators; interleaved (gate 2n, up 2n + 1), one [2BN, BK] load and one
[BM, 2BN] accumulator, split into gate and up after the K loop.

Epilogue, per column piece (``SUBTILE`` pieces of BN / SUBTILE columns, to bound live
registers): remaining scales, bias, activation, router weight, then one of: a store in C's
dtype (with its abs-max raised, ``ActEpilogue.track_amax``); static per-tensor fp8/int8 codes
(``quant_linear``); or fp8 codes with a dynamic scale per 1 x OUT_GROUP group (amax / 448, as
``fusedmoe.quant`` and ``act_quant`` compute it), written with the [rows, ceil(N / OUT_GROUP)]
fp32 scales (a piece holds whole groups).

What ptxas makes of it for sm_90 (offline compiles, ``tests/kernels/sm90_compile.py``):
wgmma (HGMMA/QGMMA) for BM >= 64 (BM 16/32 fall back to mma.sync), W by TMA (UTMALDG), gathered
A by cp.async. 128 x 256 accumulators at 8 warps: bf16 207-255 registers, 144 KiB of shared
memory at 3 stages, no spills; fp8 with block scales keeps each K step's partial product beside
the accumulator and spilled 344-536 bytes at 128 x 256 as one tile, none at 128 x 128 (227 registers there,
with one weight scale per step: ``_mac``'s W_UNIFORM; timed on an H200, PERF_LOG 2026-11-28). A
128 x 256 fp8-block tile runs as two halves of one 128-row block each (``HALVES``, chosen by
``grouped_gemm_persistent.halves``): two [BM, 128] accumulators and one partial product, 255
registers, 40 bytes spilled outside the K loop, 321 instructions a K step for 8 MMAs (199 for 4
at 128 x 128); with the H200 tables re-tuned the layer gained 1.02-1.11x at T >= 4096 (PERF_LOG,
tenth session). ``warp_specialize``
(on the K loop) gives 1 producer + 2 consumer warpgroups (12 warps, 168 registers) only for
4-warp programs with A through TMA, without ``flatten``; Triton 3.6's pass fails on gathered
A, on the interleaved split at BM 128 and on BM 64 x 256-row W tiles (the launcher refuses
those), and leaves 8-warp programs unspecialized. Without it, Triton's pipeline puts CTA-wide
barriers in each K step (three in the 128 x 256 fp8-block loop), so an 8-warp program's two
warpgroups promote their partial products in lockstep while the tensor cores idle; the launcher
can instead run two 4-warp programs per SM (``LaunchConfig.programs_per_sm``, the grid's size),
whose promotions overlap each other's MMAs (64 x 128 x 128 fp8 blocks on an H200: 1.6x over one
program per SM, PERF_LOG eleventh session).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._act_quant import _abs_bits, _scale_of
from ._common import pdl_wait, quant_linear
from ._grouped_gemm import _act_epilogue, _gate_up_cols, _mac, _store_c


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(M block, N block) of tile number ``tile``: GROUP_M M blocks per N block, then the next
    N block, so tiles that run at the same time share W columns."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _tile_rows(
    pid_m,
    sorted_ids_ptr,
    block_expert_ptr,
    counts_ptr,
    num_pairs,
    a_div,
    m_max,
    blocks_per_expert,
    BATCHED: tl.constexpr,
    A_SORTED: tl.constexpr,
    C_SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Where the rows of M block ``pid_m`` live.

    Returns (e, live, row_ok, a_rows, c_rows, rw_rows, a_desc_row): the expert (>= 0 even for a
    dead block), whether the block has work, the real rows, the row of A (and of its scales),
    of C (and of C's group scales) and of the router weight for each of the BM rows, and the
    first row of A's descriptor (A_SORTED)."""
    offs = tl.arange(0, BLOCK_M)
    if BATCHED:
        e = pid_m // blocks_per_expert
        m0 = (pid_m % blocks_per_expert) * BLOCK_M
        count = tl.minimum(tl.load(counts_ptr + e), m_max)
        live = m0 < count
        rows = m0 + offs
        row_ok = rows < count
        a_rows = rows.to(tl.int64)
        c_rows = a_rows
        rw_rows = a_rows
        a_desc_row = e * m_max + m0
    else:
        e = tl.load(block_expert_ptr + pid_m)
        live = e >= 0
        e = tl.maximum(e, 0)
        slots = pid_m * BLOCK_M + offs
        ids = tl.load(sorted_ids_ptr + slots)
        row_ok = (ids < num_pairs) & live
        rw_rows = ids.to(tl.int64)
        if A_SORTED:
            a_rows = slots.to(tl.int64)
        else:
            a_rows = (ids // a_div).to(tl.int64)
        if C_SORTED:
            c_rows = slots.to(tl.int64)
        else:
            c_rows = rw_rows
        a_desc_row = pid_m * BLOCK_M
    return e.to(tl.int64), live, row_ok, a_rows, c_rows, rw_rows, a_desc_row


@triton.jit
def _a_tile(a_src, a_row_ptr, row_ok, a_desc_row, k0, KD, stride_ak, A_FMT: tl.constexpr, A_SORTED: tl.constexpr,
            DOT_DTYPE: tl.constexpr, NATIVE: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The [BM, BK] A operand at K step k0: by descriptor (A_SORTED, rows past the buffer and K
    past the end zero-filled) or gathered by pointer with masks."""
    if A_SORTED:
        a = a_src.load([a_desc_row, k0])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_row_ptr[:, None] + offs_k[None, :] * stride_ak, mask=row_ok[:, None] & (offs_k < KD)[None, :], other=0
        )
    if A_FMT == "fp8" and not A_SORTED:
        a = a.to(tl.float8e4nv, bitcast=True)  # gathered e4m3 comes as uint8 (masked loads fill 0 bytes)
    if not NATIVE:
        a = a.to(DOT_DTYPE)  # a no-op on the GPU (model dtype); fp32 under the interpreter
    return a


@triton.jit
def _w_operand(w_desc, row, k0, W_FMT: tl.constexpr, NATIVE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """W rows row.. (of the [E * N_w, K] view) at K step k0 as the [BK, BNL] dot operand: the
    stored values (native w8a8) or widened to DOT_DTYPE."""
    b = w_desc.load([row, k0])
    if not NATIVE:
        b = b.to(DOT_DTYPE)
    return tl.trans(b)


@triton.jit
def _split_cols(x, PIECES: tl.constexpr, P: tl.constexpr):
    """Column piece P of PIECES (1 or 2) of x [BM, BN]."""
    if PIECES == 1:
        return x
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), [0, 2, 1]))
        if P == 0:
            return lo
        else:
            return hi


@triton.jit
def _piece(acc, acc_u, P: tl.constexpr, SUBTILE: tl.constexpr, HALVES: tl.constexpr):
    """The accumulators of epilogue piece P: a half's own (HALVES), else column piece P of both."""
    if HALVES == 2:
        if P == 0:
            return acc, acc
        else:
            return acc_u, acc_u
    else:
        return _split_cols(acc, SUBTILE, P), _split_cols(acc_u, SUBTILE, P)


@triton.jit
def _store_group_fp8(v, mask, c_ptrs, cs_row_ptr, row_ok, n0, num_groups, stride_csg, EXACT_CAST: tl.constexpr,
                     OUT_GROUP: tl.constexpr, PIECE_N: tl.constexpr):  # fmt: skip
    """fp8 codes of v [BM, PIECE_N] (columns n0..) with one dynamic scale per 1 x OUT_GROUP
    group: amax / 448 (1 for an all-zero group, NaN kept), as ``fusedmoe.quant`` computes it.
    Masked elements count as 0 in the amax, as quant's zero padding of a partial group."""
    BM: tl.constexpr = v.shape[0]
    NG: tl.constexpr = PIECE_N // OUT_GROUP
    v3 = tl.reshape(tl.where(mask, v, 0.0), [BM, NG, OUT_GROUP])
    amax = tl.max(_abs_bits(v3), axis=2).to(tl.float32, bitcast=True)  # integer max keeps NaN
    s = _scale_of(amax, "fp8")
    g = n0 // OUT_GROUP + tl.arange(0, NG)
    tl.store(cs_row_ptr[:, None] + g[None, :] * stride_csg, s, mask=row_ok[:, None] & (g < num_groups)[None, :])
    q = tl.reshape(quant_linear(v3, s[:, :, None], "fp8", EXACT_CAST), [BM, PIECE_N])
    tl.store(c_ptrs, q, mask=mask)


@triton.jit
def _epilogue_piece(
    acc, acc_u, n0, e, row_ok, c_rows, rw_rows, as_row_ptr, ws_base, w_gscale_ptr, bias_ptr, route_w_ptr, c_ptr,
    c_scale_ptr, N, alpha, limit, num_groups,
    stride_wsn, stride_be, stride_bn, stride_re, stride_rm, stride_ce, stride_cm, stride_cn,
    stride_cse, stride_csm, stride_csg,
    A_FMT: tl.constexpr, A_GROUP: tl.constexpr, W_FMT: tl.constexpr, W_BK: tl.constexpr, HAS_W_GSCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr, OUT_QUANT: tl.constexpr, OUT_GROUP: tl.constexpr, EXACT_CAST: tl.constexpr,
    PIECE_N: tl.constexpr,
):  # fmt: skip
    """Output columns n0..n0+PIECE_N of the tile: scales, bias, activation, router weight, store."""
    offs_n = n0 + tl.arange(0, PIECE_N)
    n_ok = offs_n < N
    g_cols, u_cols = _gate_up_cols(offs_n, N, GATED, INTERLEAVED)
    # an activation global scale belongs to NVFP4 activations (not served): off, any pointer
    acc = _act_epilogue(
        acc, acc_u, e, g_cols, u_cols, n_ok, row_ok, rw_rows, as_row_ptr, ws_base, w_gscale_ptr, c_ptr, bias_ptr,
        route_w_ptr, alpha, limit, 0, stride_wsn, stride_be, stride_bn, stride_re, stride_rm,
        A_FMT, A_GROUP, W_FMT, W_BK, False, HAS_W_GSCALE, HAS_BIAS, MUL_ROUTED_WEIGHT, ACT, GATED,
    )  # fmt: skip
    c_row_ptr = c_ptr + e * stride_ce + c_rows * stride_cm
    c_ptrs = c_row_ptr[:, None] + offs_n[None, :] * stride_cn
    c_mask = row_ok[:, None] & n_ok[None, :]
    if OUT_QUANT == "fp8_group":
        cs_row_ptr = c_scale_ptr + e * stride_cse + c_rows * stride_csm
        _store_group_fp8(acc, c_mask, c_ptrs, cs_row_ptr, row_ok, n0, num_groups, stride_csg, EXACT_CAST, OUT_GROUP,
                         PIECE_N)  # fmt: skip
    else:
        _store_c(c_ptrs, acc, c_mask, c_scale_ptr, OUT_QUANT, EXACT_CAST)


@triton.jit
def _persistent_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr,
    w_gscale_ptr,  # fp32 [E]: a scale per expert times the accumulator (HAS_W_GSCALE)
    bias_ptr, route_w_ptr,
    c_ptr,
    c_scale_ptr,  # OUT_QUANT "fp8"/"int8": static scale [1], read; "fp8_group": [rows, G], written; "amax": [1], raised
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, counts_ptr,
    N,  # columns of C (I under a gated ACT, whose W has N_W = 2N rows)
    N_W, KD, num_pairs, a_div, m_max, blocks_per_expert,
    num_m_blocks,  # batched: E * blocks_per_expert (standard: read from num_padded)
    a_rows_total,  # rows of A's descriptor (A_SORTED)
    w_rows_total,  # E * N_W
    num_groups,  # ceil(N / OUT_GROUP)
    alpha, limit,
    stride_ae, stride_am, stride_ak,  # strides: one line per operand, the expert's first
    stride_ase, stride_asm, stride_ask,
    stride_wn,  # W is read through a [E * N_W, K] descriptor: its row stride only
    stride_wse, stride_wsn, stride_wsk,
    stride_be, stride_bn,
    stride_re, stride_rm,
    stride_ce, stride_cm, stride_cn,
    stride_cse, stride_csm, stride_csg,
    BATCHED: tl.constexpr,
    A_SORTED: tl.constexpr,  # A rows by slot, read through a descriptor (module docstring)
    C_SORTED: tl.constexpr,  # C rows by slot
    A_FMT: tl.constexpr,  # "float" | "fp8" | "int8"
    A_GROUP: tl.constexpr,  # 0: one scale per row (tensor/token), else 1 x A_GROUP groups
    W_FMT: tl.constexpr,  # "float" | "fp8" | "int8"
    W_BN: tl.constexpr,  # 0, 0: one scale per column (tensor/channel); else W_BN x W_BK blocks
    W_BK: tl.constexpr,
    W_UNIFORM: tl.constexpr,  # the accumulator's W rows lie in one W_BN block (``_mac``)
    HAS_W_GSCALE: tl.constexpr,  # 4-bit weights written out with their NVFP4 global scale left to here
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    NATIVE: tl.constexpr,  # w8a8: the stored bytes feed tl.dot
    DOT_DTYPE: tl.constexpr,
    ACT: tl.constexpr,  # "none" | an Activation value
    GATED: tl.constexpr,  # ACT takes a gate and an up row (Activation.is_gated)
    INTERLEAVED: tl.constexpr,
    OUT_QUANT: tl.constexpr,  # "none" | "amax" | "fp8" | "int8" (static) | "fp8_group" (dynamic 1 x OUT_GROUP)
    OUT_GROUP: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SUBTILE: tl.constexpr,  # epilogue column pieces: 1 or 2
    HALVES: tl.constexpr,  # 2: the tile's W rows as two halves of one weight block each (module docstring)
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):  # fmt: skip
    # One body for every layout and format: the branches are constexpr, so each compiled
    # variant holds only its own path (the old kernel is organised the same way).
    # 119 lines: one Triton kernel: descriptors, the tile loop and the epilogue share the persistent program's state;
    # the per-tile pieces are @triton.jit helpers.
    pdl_wait(PDL)
    WIDE: tl.constexpr = GATED and INTERLEAVED  # one [BM, 2BN] accumulator, split after the K loop
    BNL: tl.constexpr = 2 * BLOCK_N if WIDE else BLOCK_N // HALVES  # W rows per descriptor load
    A_PER_K: tl.constexpr = A_GROUP > 0
    INT_ACC: tl.constexpr = NATIVE and W_FMT == "int8" and not A_PER_K and not W_BK > 0
    ACC_DTYPE: tl.constexpr = tl.int32 if INT_ACC else tl.float32

    w_desc = tl.make_tensor_descriptor(
        w_ptr, shape=[w_rows_total, KD], strides=[stride_wn, 1], block_shape=[BNL, BLOCK_K]
    )
    if A_SORTED:
        a_src = tl.make_tensor_descriptor(
            a_ptr, shape=[a_rows_total, KD], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
    else:
        a_src = a_ptr
    if BATCHED:
        num_m = num_m_blocks
    else:
        num_m = tl.load(num_padded_ptr) // BLOCK_M  # blocks in use, on the device: no host sync
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(KD, BLOCK_K)

    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        e, live, row_ok, a_rows, c_rows, rw_rows, a_desc_row = _tile_rows(
            pid_m, sorted_ids_ptr, block_expert_ptr, counts_ptr, num_pairs, a_div, m_max, blocks_per_expert,
            BATCHED, A_SORTED, C_SORTED, BLOCK_M,
        )  # fmt: skip
        a_row_ptr = a_ptr + e * stride_ae + a_rows * stride_am
        as_row_ptr = a_scale_ptr + e * stride_ase + a_rows * stride_asm
        ws_base = w_scale_ptr + e * stride_wse
        n0 = pid_n * BLOCK_N
        w_row = (e * N_W).to(tl.int32) + (2 * n0 if WIDE else n0)  # gate rows (or gate/up pairs)
        g0 = w_row - (e * N_W).to(tl.int32)  # the expert's W row of the accumulator's first column
        g_cols = g0 + tl.arange(0, BNL)  # W rows of the accumulator's columns
        g_ok = g_cols < N_W  # columns past N are masked at the store; these keep scale loads in bounds
        u_off = BNL if HALVES == 2 else N  # W rows from the accumulator's to the up rows', or the second half's
        u_cols = g_cols + u_off
        u_ok = u_cols < N_W
        # the second half's weight block (one scale a step): a half past N_W reads zeros (or the
        # next expert's rows, masked at the store) and keeps its scale load in bounds
        u0 = tl.minimum(g0 + u_off, N_W - 1) if HALVES == 2 else g0 + u_off
        acc = tl.zeros([BLOCK_M, BNL], dtype=ACC_DTYPE)
        acc_u = acc  # the up rows' accumulator: carried only under a split-layout gated ACT
        # a dead block (expert -1: not local; batched: past counts[e]) runs no K step and
        # stores nothing (row_ok is all false); no branch, so the two loops stay a simple nest
        for ki in tl.range(0, k_tiles * live.to(tl.int32), warp_specialize=WARP_SPECIALIZE):
            k0 = ki * BLOCK_K
            a = _a_tile(a_src, a_row_ptr, row_ok, a_desc_row, k0, KD, stride_ak, A_FMT, A_SORTED, DOT_DTYPE, NATIVE,
                        BLOCK_K)  # fmt: skip
            b = _w_operand(w_desc, w_row, k0, W_FMT, NATIVE, DOT_DTYPE)
            acc = _mac(
                acc, a, b, as_row_ptr, row_ok, ws_base, g_cols, g_ok, g0, k0, stride_ask, stride_wsn, stride_wsk,
                W_FMT, A_GROUP, W_BN, W_BK, W_UNIFORM, NATIVE, INT_ACC, DOT_DTYPE, 1.0, False,
            )  # fmt: skip
            if (GATED and not INTERLEAVED) or HALVES == 2:
                b_u = _w_operand(w_desc, w_row + u_off, k0, W_FMT, NATIVE, DOT_DTYPE)
                acc_u = _mac(
                    acc_u, a, b_u, as_row_ptr, row_ok, ws_base, u_cols, u_ok, u0, k0, stride_ask, stride_wsn,
                    stride_wsk, W_FMT, A_GROUP, W_BN, W_BK, W_UNIFORM, NATIVE, INT_ACC, DOT_DTYPE, 1.0, False,
                )  # fmt: skip

        if WIDE:  # columns 2j, 2j + 1 of the accumulator are gate and up of output column j
            acc, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        PIECES: tl.constexpr = HALVES if HALVES == 2 else SUBTILE
        PIECE_N: tl.constexpr = BLOCK_N // PIECES
        for p in tl.static_range(PIECES):
            x, x_u = _piece(acc, acc_u, p, SUBTILE, HALVES)
            _epilogue_piece(
                x, x_u, n0 + p * PIECE_N, e, row_ok, c_rows,
                rw_rows, as_row_ptr, ws_base, w_gscale_ptr, bias_ptr, route_w_ptr, c_ptr, c_scale_ptr, N, alpha,
                limit, num_groups, stride_wsn, stride_be, stride_bn, stride_re, stride_rm, stride_ce, stride_cm,
                stride_cn, stride_cse, stride_csm, stride_csg,
                A_FMT, A_GROUP, W_FMT, W_BK, HAS_W_GSCALE, HAS_BIAS, MUL_ROUTED_WEIGHT, ACT, GATED, INTERLEAVED,
                OUT_QUANT, OUT_GROUP, EXACT_CAST, PIECE_N,
            )  # fmt: skip
