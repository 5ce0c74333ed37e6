"""Row movers of the EP dispatchers (jit code only; the ops and their references are in ``rows.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import pdl_wait, row_col_tile


@triton.jit
def _scatter_rows_kernel(
    src_ptr,
    idx_ptr,
    dst_ptr,
    N,
    D,
    LIMIT,
    stride_sn,
    stride_in,
    stride_ij,
    stride_dn,
    J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    """dst[idx[n, j]] = src[n] for every j with 0 <= idx[n, j] < LIMIT (one load, up to J stores)."""
    pdl_wait(PDL)
    r64, cols, row_ok, col_ok = row_col_tile(N, D, BLOCK_N, BLOCK_D)
    v = tl.load(src_ptr + r64[:, None] * stride_sn + cols[None, :], mask=row_ok[:, None] & col_ok[None, :])
    for j in tl.static_range(J):
        d = tl.load(idx_ptr + r64 * stride_in + j * stride_ij, mask=row_ok, other=-1).to(tl.int64)
        ok = row_ok & (d >= 0) & (d < LIMIT)
        tl.store(dst_ptr + d[:, None] * stride_dn + cols[None, :], v, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _gather_sum_kernel(
    src_ptr,
    idx_ptr,
    w_ptr,
    out_ptr,
    N,
    H,
    LIMIT,
    stride_sn,
    stride_in,
    stride_ij,
    stride_wn,
    stride_wj,
    stride_on,
    J: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    """out[n] = sum over j of (w[n, j] *) src[idx[n, j]], j in order, in fp32; indices outside
    [0, LIMIT) add nothing (their rows are never read, so stale or NaN rows cannot leak in)."""
    pdl_wait(PDL)
    r64, cols, row_ok, col_ok = row_col_tile(N, H, BLOCK_N, BLOCK_H)
    acc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(J):
        s = tl.load(idx_ptr + r64 * stride_in + j * stride_ij, mask=row_ok, other=-1).to(tl.int64)
        ok = row_ok & (s >= 0) & (s < LIMIT)
        v = tl.load(src_ptr + s[:, None] * stride_sn + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
        v = v.to(tl.float32)
        if HAS_W:
            wt = tl.load(w_ptr + r64 * stride_wn + j * stride_wj, mask=ok, other=0.0).to(tl.float32)
            v = v * wt[:, None]
        acc += v
    o_ptrs = out_ptr + r64[:, None] * stride_on + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _rank_rows_kernel(
    ids_ptr,
    owner_ptr,
    dest_ptr,
    counts_ptr,
    T,
    W,
    ROWS,
    stride_it,
    stride_ik,
    K: tl.constexpr,
    WIRE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    """One program: dest[t, r] = r * ROWS + (tokens up to t that go to rank r) - 1, or -1 if t does
    not go to r; counts[r] = tokens that go to r. Tokens in blocks of BLOCK_T, a running count per
    rank carried between blocks. ids: expert ids (WIRE: 1 + expert id, 0 = not sent)."""
    pdl_wait(PDL)
    ranks = tl.arange(0, BLOCK_W)
    r_ok = ranks < W
    carry = tl.zeros([BLOCK_W], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        t_ok = rows < T
        r64 = rows.to(tl.int64)
        hit = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.int32)
        for k in tl.static_range(K):
            e = tl.load(ids_ptr + r64 * stride_it + k * stride_ik, mask=t_ok, other=0).to(tl.int32)
            if WIRE:
                own = tl.load(owner_ptr + tl.maximum(e - 1, 0), mask=t_ok & (e > 0), other=-1)
            else:
                own = tl.load(owner_ptr + e, mask=t_ok, other=-1)
            hit = tl.maximum(hit, (own[:, None] == ranks[None, :]).to(tl.int32))
        cum = tl.cumsum(hit, axis=0) + carry[None, :]
        dest = tl.where(hit > 0, ranks[None, :].to(tl.int64) * ROWS + cum.to(tl.int64) - 1, -1)
        tl.store(dest_ptr + r64[:, None] * W + ranks[None, :], dest, mask=t_ok[:, None] & r_ok[None, :])
        carry += tl.sum(hit, axis=0)
    tl.store(counts_ptr + ranks, carry.to(tl.int64), mask=r_ok)
