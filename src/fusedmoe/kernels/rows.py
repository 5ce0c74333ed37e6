"""Row movers of the EP dispatchers: one launch each where PyTorch needs three to five.

    rank_rows(ids [T, K], owner [E], W, rows)             dest [T, W]: each token's send row per rank
    scatter_rows(src [N, D], idx [N, J], dst [R, D])      dst[idx[n, j]] = src[n]
    gather_sum(src [R, H], idx [N, J], out [N, H], w)     out[n] = sum_j (w[n, j] *) src[idx[n, j]]

An index outside [0, R) means "nowhere": the pair is skipped (no dump row to write, zero or
mask). Used on both sides of an exchange: the sender writes each token's packed row to
the slot of every rank it goes to (J = W), the combine sums a token's partial outputs from
every rank (J = W, home side) or a row's local (token, expert) outputs (J = K, low latency).

``gather_sum`` reads only the rows it sums: the low-latency combine would otherwise gather
all K rows of each received token and mask 3 in 4 of them away (EP4, K 8), about 4x the
bytes, in fp32. It adds in fp32 with j in order and rounds once, so it is deterministic.

On CUDA these launch the Triton kernels of ``_rows.py``; elsewhere (gloo CI) they run the
PyTorch references, which ``tests/dispatch/test_ep.py`` also checks the kernels against under the
Triton interpreter. Not registered as torch.library ops: they only run inside the
dispatchers, which sit behind ``fusedmoe::moe_forward`` under ``torch.compile``.
"""

from __future__ import annotations

import torch

from ._common import cdiv, interpreting, next_power_of_2
from ._rows import _gather_sum_kernel, _rank_rows_kernel, _scatter_rows_kernel
from .launch import launch

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A [N, D] view of ``t`` (any dtype, last dim contiguous) in the widest integer words that
    tile its rows: a row copy then moves 8-byte words, not bytes. Byte offsets and strides of
    ``RowLayout`` fields are multiples of 16, so they always allow it."""
    u8 = t.reshape(t.shape[0], -1) if t.dim() != 2 else t
    if u8.dtype != torch.uint8:
        u8 = u8.view(torch.uint8)
    nb = u8.shape[1]
    for w in _WORDS:
        size = w.itemsize
        if nb % size == 0 and (u8.shape[0] <= 1 or u8.stride(0) % size == 0) and u8.storage_offset() % size == 0:
            return u8.view(w)
    return u8


def _blocks(n_cols: int) -> tuple[int, int]:
    # GPU: 4 rows x 256 words (8 KiB of int64) per program, memory-bound like moe_sum;
    # the interpreter pays ~5 ms per program, so it takes tiny problems whole.
    if interpreting():
        return 16, 256
    return 4, 256


# ---- rank_rows -------------------------------------------------------------------------------
def rank_rows_ref(
    ids: torch.Tensor, owner: torch.Tensor, world: int, rows: int | None, *, wire: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of ``rank_rows``."""
    t, dev = ids.shape[0], ids.device
    e = ids.long()
    valid = e > 0 if wire else torch.ones_like(e, dtype=torch.bool)
    own = torch.where(valid, owner.long()[(e - 1).clamp(min=0) if wire else e], -1)
    hit = (own.unsqueeze(-1) == torch.arange(world, device=dev)).any(dim=1)
    cum = hit.cumsum(0)
    counts = cum[-1] if t else torch.zeros(world, dtype=torch.int64, device=dev)
    if rows is None:
        base = torch.cumsum(counts, 0) - counts - 1
    else:
        base = torch.arange(world, device=dev) * rows - 1
    return torch.where(hit, cum + base, -1), counts


def rank_rows_launch(
    ids: torch.Tensor, owner: torch.Tensor, world: int, rows: int | None, *, wire: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    t = ids.shape[0]
    dest = torch.empty(t, world, dtype=torch.int64, device=ids.device)
    counts = torch.empty(world, dtype=torch.int64, device=ids.device)
    # one program scans the tokens (a running count per rank), 128 tokens a step on a GPU
    bt = 64 if interpreting() else 128
    launch(
        _rank_rows_kernel,
        (1,),
        ids,
        owner,
        dest,
        counts,
        t,
        world,
        0 if rows is None else rows,
        ids.stride(0),
        ids.stride(1),
        K=ids.shape[1],
        WIRE=wire,
        BLOCK_T=bt,
        BLOCK_W=next_power_of_2(world),
    )
    if rows is None:  # positions within each rank's block -> after the previous ranks' blocks
        base = torch.cumsum(counts, 0) - counts
        dest = torch.where(dest >= 0, dest + base, -1)
    return dest, counts


def rank_rows(
    ids: torch.Tensor, owner: torch.Tensor, world: int, rows: int | None, *, wire: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest int64 [T, W], counts int64 [W]): dest[t, r] = the send row of token t's copy for rank
    r, or -1 when none of its experts is on r; counts[r] = the tokens that go to r.

    Tokens keep their order within each rank's block: blocks of ``rows`` rows (r * rows + i), or
    (``rows`` None) each rank's block right after the previous rank's. ids int [T, K] expert ids,
    or with ``wire`` 1 + expert id and 0 for a pair that is not sent; owner int32 [E] the rank of
    each expert. On CUDA one single-program launch (plus 3 small ops for variable blocks),
    where PyTorch takes 6 to 9.
    """
    if ids.is_cuda:
        return rank_rows_launch(ids, owner, world, rows, wire=wire)
    return rank_rows_ref(ids, owner, world, rows, wire=wire)


# ---- scatter_rows ------------------------------------------------------------------------
def scatter_rows_ref(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of ``scatter_rows`` (skipped indices go to a dump row: no host sync)."""
    n, j = idx.shape
    r = dst.shape[0]
    target = torch.where((idx >= 0) & (idx < r), idx.long(), r).reshape(-1)
    buf = torch.cat([dst, dst.new_empty(1, *dst.shape[1:])])
    buf.index_copy_(0, target, src.repeat_interleave(j, dim=0))
    dst.copy_(buf[:r])
    return dst


def scatter_rows_launch(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    n, d = src.shape
    if n == 0 or d == 0 or idx.shape[1] == 0 or dst.shape[0] == 0:
        return dst
    bn, bd = _blocks(d)
    grid = (cdiv(n, bn), cdiv(d, bd))
    launch(
        _scatter_rows_kernel,
        grid,
        src,
        idx,
        dst,
        n,
        d,
        dst.shape[0],
        src.stride(0),
        idx.stride(0),
        idx.stride(1),
        dst.stride(0),
        J=idx.shape[1],
        BLOCK_N=bn,
        BLOCK_D=bd,
    )
    return dst


def scatter_rows(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst[idx[n, j]] = src[n] for each index in [0, dst rows); returns ``dst``.

    src [N, D] and dst [R, D] of one dtype, last dim contiguous (pass ``as_words`` views to
    move packed bytes); idx int32/int64 [N, J], any strides. Two indices naming one dst row
    leave either value (the dispatchers never do it).
    """
    assert src.dtype == dst.dtype and src.shape[1] == dst.shape[1] and idx.shape[0] == src.shape[0]
    if src.is_cuda:
        assert src.stride(-1) == 1 and dst.stride(-1) == 1
        return scatter_rows_launch(src, idx, dst)
    return scatter_rows_ref(src, idx, dst)


# ---- gather_sum --------------------------------------------------------------------------
def gather_sum_ref(
    src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """PyTorch reference of ``gather_sum``."""
    n, j = idx.shape
    h = out.shape[1]
    if src.shape[0] == 0 or j == 0:
        return out.zero_()
    ok = (idx >= 0) & (idx < src.shape[0])
    g = src.index_select(0, torch.where(ok, idx.long(), 0).reshape(-1)).view(n, j, h).float()
    g = torch.where(ok.unsqueeze(-1), g, 0.0)
    if weights is not None:
        g = g * weights.float().unsqueeze(-1)
    out.copy_(g.sum(dim=1))
    return out


def gather_sum_launch(
    src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    n, h = out.shape
    if n == 0 or h == 0:
        return out
    if src.shape[0] == 0 or idx.shape[1] == 0:
        return out.zero_()
    bn, bh = _blocks(h)
    grid = (cdiv(n, bn), cdiv(h, bh))
    w = weights if weights is not None else idx
    launch(
        _gather_sum_kernel,
        grid,
        src,
        idx,
        w,
        out,
        n,
        h,
        src.shape[0],
        src.stride(0),
        idx.stride(0),
        idx.stride(1),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        J=idx.shape[1],
        HAS_W=weights is not None,
        BLOCK_N=bn,
        BLOCK_H=bh,
    )
    return out


def gather_sum(
    src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """out[n] = sum over j of (weights[n, j] *) src[idx[n, j]], skipping indices outside
    [0, src rows); fp32 sums, j in order, one rounding to out's dtype; returns ``out``.

    src [R, H] and out [N, H] float, last dim contiguous; idx int [N, J] and weights float
    [N, J], any strides. A row with no valid index is written as zeros.
    """
    assert idx.shape[0] == out.shape[0] and src.shape[1] == out.shape[1]
    if out.is_cuda:
        assert src.stride(-1) == 1 and out.stride(-1) == 1
        return gather_sum_launch(src, idx, out, weights)
    return gather_sum_ref(src, idx, out, weights)
