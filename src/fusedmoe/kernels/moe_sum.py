"""Sum each token's K expert outputs: ``moe_sum(c [T, K, H]) -> out [T, H]``.

The grouped GEMM writes one row per (token, k) pair (already multiplied by its router
weight when asked to); this kernel reduces them in a fixed order (k = 0..K-1, fp32),
so the result is deterministic, unlike an atomic scatter-add. Given the top-k ids, pairs
that contribute nothing (an id outside [0, E), or an expert that the expert map sends
outside [0, E_l): ``metadata.TopK``) are skipped, so their rows of ``c``, which no GEMM
wrote, never need to be zero-filled. Every load of an id or a map entry is masked to
its buffer, whatever the ids hold.

A split-K GEMM2 (``grouped_gemm_w4``, ``LaunchConfig.split_k`` = S) writes S fp32 partial
rows per pair instead, c [S, T, K, H]; the same launch then sums over k and s (k outer,
s inner, fp32), so split-K costs no launch of its own and stays deterministic.

A backend whose GEMMs leave the pairs sorted by expert (``grouped_mm``) hands ``c`` as
[P, H] rows with ``rows`` [T, K], the row of each pair, and the router ``weights`` [T, K]:
the same launch gathers, weights and sums. That replaces an fp32 copy of the rows, a
multiply, a select, a zero-filled accumulator, an atomic ``index_add_`` and a copy (six
passes over up to T*K x H values; on Mixtral at T = 4096, 0.9 GB of traffic, ~0.3 ms on
an H100) by one read of the rows, and the sum keeps its fixed k order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import expect
from ..metadata import local_expert_ids
from ._common import cdiv, interpreting, pdl_wait, row_col_tile
from .launch import launch


@triton.jit
def _moe_sum_kernel(
    c_ptr,
    out_ptr,
    ids_ptr,
    map_ptr,
    rows_ptr,  # [T, K] row of c per pair (HAS_ROWS)
    w_ptr,  # [T, K] router weights (HAS_W)
    T,
    H,
    P,  # rows of c (HAS_ROWS)
    E_G,  # ids in [0, E_G) are experts: the expert map's length, or E_L without a map
    E_L,
    stride_cs,
    stride_ct,
    stride_ck,
    stride_ch,
    stride_ot,
    stride_oh,
    K: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    pdl_wait(PDL)
    r64, cols, row_ok, col_ok = row_col_tile(T, H, BLOCK_T, BLOCK_H)
    mask = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        pair_ok = row_ok
        if HAS_IDS:
            e = tl.load(ids_ptr + r64 * K + k, mask=row_ok, other=-1).to(tl.int64)
            pair_ok = pair_ok & (e >= 0) & (e < E_G)
            if HAS_MAP:
                local = tl.load(map_ptr + e, mask=pair_ok, other=-1)
                pair_ok = pair_ok & (local >= 0) & (local < E_L)
        ok = mask & pair_ok[:, None]
        if HAS_ROWS:  # c is [P, H]: the pair's row, read only where the pair counts
            src = tl.load(rows_ptr + r64 * K + k, mask=pair_ok, other=0).to(tl.int64)
            ok = ok & ((src >= 0) & (src < P))[:, None]  # a row index past c is never read
            ptrs = c_ptr + src[:, None] * stride_ct + cols[None, :] * stride_ch
        else:
            ptrs = c_ptr + r64[:, None] * stride_ct + k * stride_ck + cols[None, :] * stride_ch
        if HAS_W:
            wk = tl.load(w_ptr + r64 * K + k, mask=pair_ok, other=0.0).to(tl.float32)
            part = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                part += tl.load(ptrs + s * stride_cs, mask=ok, other=0.0).to(tl.float32)
            acc += part * wk[:, None]  # masked loads gave 0 (and w 0) where the pair does not count
        else:
            for s in tl.static_range(SPLITS):
                acc += tl.load(ptrs + s * stride_cs, mask=ok, other=0.0).to(tl.float32)
    o_ptrs = out_ptr + r64[:, None] * stride_ot + cols[None, :] * stride_oh
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum_launch(
    c: torch.Tensor,
    out: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    num_local_experts: int = 0,
    rows: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    if rows is not None:  # c [P, H]: strides as [1, P, 1, H] (the k stride is unused)
        t, k = rows.shape
        c4 = c.unsqueeze(0).unsqueeze(2)
        splits, h = 1, c.shape[-1]
    else:
        c4 = c if c.dim() == 4 else c.unsqueeze(0)
        splits, t, k, h = c4.shape
    if t == 0 or h == 0:
        return out
    has_ids, has_map = topk_ids is not None, expert_map is not None
    # 4 x 256 values per program: memory-bound, K loads of 2 KiB (bf16) in flight each.
    bt, bh = (16, 128) if interpreting() else (4, 256)
    grid = (cdiv(t, bt), cdiv(h, bh))
    ids = topk_ids.contiguous() if has_ids else c
    launch(
        _moe_sum_kernel,
        grid,
        c,
        out,
        ids,
        expert_map.contiguous() if has_map else c,
        c if rows is None else rows.contiguous(),
        c if weights is None else weights.contiguous(),
        t,
        h,
        c.shape[0] if rows is not None else 0,
        expert_map.shape[0] if has_map else num_local_experts,
        num_local_experts,
        *c4.stride(),
        *out.stride(),
        K=k,
        SPLITS=splits,
        HAS_IDS=has_ids,
        HAS_MAP=has_map,
        HAS_ROWS=rows is not None,
        HAS_W=weights is not None,
        BLOCK_T=bt,
        BLOCK_H=bh,
        num_warps=4,
    )
    return out


def moe_sum(
    c: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    num_local_experts: int | None = None,
    rows: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H] = sum over k of c [T, K, H] (fp32 accumulation, output in ``out``'s or
    c's dtype), or over k and s of split-K partials c [S, T, K, H]. With ``topk_ids`` [T, K]
    (and ``num_local_experts`` E_l, and optionally ``expert_map`` [E]), pairs that contribute
    nothing (see the module docstring) are skipped. With ``rows`` [T, K] (integers), c is
    [P, H] and pair (t, k) is row ``rows[t, k]`` of it; with ``weights`` [T, K], each pair is
    multiplied by its weight (fp32) before the sum."""
    if rows is not None:
        expect(rows.dim() == 2 and not rows.is_floating_point(), "rows", "[T, K] integer row indices", rows)
        expect(c.dim() == 2, "c", "[P, H] rows when rows is given", tuple(c.shape))
        t, k, h = rows.shape[0], rows.shape[1], c.shape[1]
    else:
        expect(c.dim() in (3, 4), "c", "a [T, K, H] tensor or [S, T, K, H] split-K partials", tuple(c.shape))
        t, k, h = c.shape[-3:]
    if weights is not None:
        expect(tuple(weights.shape) == (t, k), "weights", f"shape {(t, k)}", tuple(weights.shape))
    if expert_map is not None:
        expect(topk_ids is not None, "topk_ids", f"[{t}, {k}] ids with expert_map")
    if topk_ids is not None:
        expect(tuple(topk_ids.shape) == (t, k), "topk_ids", f"shape {(t, k)}", tuple(topk_ids.shape))
        expect(
            isinstance(num_local_experts, int) and num_local_experts > 0,
            "num_local_experts",
            "the local expert count (> 0) with topk_ids",
            num_local_experts,
        )
    if out is None:
        out = torch.empty(t, h, dtype=c.dtype, device=c.device)
    expect(tuple(out.shape) == (t, h), "out", f"shape {(t, h)}", tuple(out.shape))
    if c.device.type == "cpu" and not interpreting():
        ref = moe_sum_ref(
            c, topk_ids=topk_ids, expert_map=expert_map, num_local_experts=num_local_experts, rows=rows, weights=weights
        )
        return out.copy_(ref)
    return moe_sum_launch(c, out, topk_ids, expert_map, num_local_experts or 0, rows, weights)


def moe_sum_ref(
    c: torch.Tensor,
    *,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    num_local_experts: int | None = None,
    rows: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``moe_sum`` in PyTorch, in ``dtype``."""
    if rows is not None:  # gathered where the pair counts (other indices may point anywhere)
        ok = torch.ones_like(rows, dtype=torch.bool)
        if topk_ids is not None:
            ok = local_expert_ids(topk_ids, expert_map, num_local_experts) >= 0
        c = c[torch.where(ok, rows, 0).long()]
    x = c.to(dtype)
    if x.dim() == 4:  # split-K partials [S, T, K, H]
        x = x.sum(dim=0)
    if weights is not None:
        x = x * weights.to(dtype).unsqueeze(-1)
    if topk_ids is not None:
        local = local_expert_ids(topk_ids, expert_map, num_local_experts)
        x = torch.where((local >= 0).unsqueeze(-1), x, torch.zeros((), dtype=dtype, device=c.device))
    return x.sum(dim=1)
