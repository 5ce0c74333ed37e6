"""Triton kernels of ``moe_align`` (see ``align.py`` for the contract).

Three launches, no host synchronisation:

1. ``_align_count_kernel``  (one program per CHUNK pairs): per-chunk histogram of
   local experts; also fills every slot of ``sorted_ids`` with the padding
   sentinel (grid-stride, so the fill is spread over all programs).
2. ``_align_offsets_kernel`` (one program): totals, padded run starts, the
   number of used slots, ``block_expert``, and for every chunk the base slot of
   each expert's pairs in that chunk.
3. ``_align_scatter_kernel`` (one program per chunk): sorts the chunk's pairs by
   (expert, flat index) and writes each to ``base[chunk, expert] + rank``.

Pairs of one expert land in increasing flat-index order: chunks are laid out
in order by the prefix sums of (2) and each chunk is sorted by index in (3).

When all pairs fit one chunk (T*K <= 1024: every decode step), ``_align_one_kernel``
does the same work in ONE program and one launch: histogram, offsets and
``block_expert``, sentinel fill, scatter. Same outputs, bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import pdl_wait


@triton.jit
def _local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, E_G, E_L, HAS_MAP: tl.constexpr, BINS: tl.constexpr):
    """Local expert of each flat pair index in ``offs`` (int32); BINS - 1 for a non-local pair or
    past the end. The ids may be int32 or int64: the range checks run in their own width, so an
    int64 id of 2^32 + 1 is out of range, not expert 1."""
    ok = offs < num_pairs
    e = tl.load(topk_ids_ptr + offs, mask=ok, other=-1)
    if HAS_MAP:
        in_range = ok & (e >= 0) & (e < E_G)
        e = tl.load(expert_map_ptr + e, mask=in_range, other=-1)
    return tl.where((e >= 0) & (e < E_L), e, BINS - 1).to(tl.int32)


@triton.jit
def _block_experts(block_expert_ptr, end, num_padded, num_blocks, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """block_expert[b] for every block: the number of runs that end at or before its first slot
    (padding bins have end == num_padded, so they never count for s < num_padded); -1 past the end.

    Runs end on whole blocks, so that count is #{bins: end // BLOCK_M <= b}: per step of BLOCK_B
    blocks, the runs ending at or before the step's first block plus a running sum of a histogram
    of the ends inside the step. Comparing every block with every bin ([64, BINS] per step) cost
    ~1 us a step on an H200: 39 us at DeepSeek-V3's T = 4096 (510 blocks, 512 bins)."""
    eb = end // BLOCK_M
    for b0 in range(0, num_blocks, BLOCK_B):
        rel = eb - b0
        before = tl.sum((rel <= 0).to(tl.int32), 0)
        inside = tl.histogram(rel, BLOCK_B, mask=(rel > 0) & (rel < BLOCK_B))
        ex = before + tl.cumsum(inside, 0)
        b = b0 + tl.arange(0, BLOCK_B)
        tl.store(block_expert_ptr + b, tl.where(b * BLOCK_M < num_padded, ex, -1), mask=b < num_blocks)


@triton.jit
def _expert_runs(total, bins, is_expert, expert_counts_ptr, num_padded_ptr, block_expert_ptr, num_blocks,
                 BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):  # fmt: skip
    """From the pairs per bin ``total`` [BINS] (0 past the local experts): writes expert_counts,
    num_padded and block_expert, and returns the first slot of each expert's run (its pairs
    padded to whole BLOCK_M blocks, runs back to back). The offsets kernel and the one-launch
    kernel share it."""
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    num_padded = tl.sum(padded, 0)
    tl.store(expert_counts_ptr + bins, total, mask=is_expert)
    tl.store(num_padded_ptr, num_padded)
    _block_experts(block_expert_ptr, end, num_padded, num_blocks, BLOCK_M, BLOCK_B)
    return end - padded


@triton.jit
def _align_count_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    chunk_counts_ptr,  # int32 [num_chunks, BINS]
    sorted_ids_ptr,  # int32 [P]
    num_pairs,
    num_slots,
    E_G,
    E_L,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
    BINS: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    pdl_wait(PDL)
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = _local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, E_G, E_L, HAS_MAP, BINS)
    bins = tl.arange(0, BINS)
    tl.store(chunk_counts_ptr + c * BINS + bins, tl.histogram(e, BINS))
    sentinel = tl.zeros([FILL], dtype=tl.int32) + num_pairs
    for s in range(c * FILL, num_slots, tl.num_programs(0) * FILL):
        o = s + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + o, sentinel, mask=o < num_slots)


@triton.jit
def _align_offsets_kernel(
    chunk_counts_ptr,  # int32 [num_chunks, BINS]
    chunk_base_ptr,  # int32 [num_chunks, BINS] out
    expert_counts_ptr,  # int32 [E_L] out
    num_padded_ptr,  # int32 [1] out
    block_expert_ptr,  # int32 [num_blocks] out
    num_chunks,
    num_blocks,
    E_L,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CB: tl.constexpr,  # chunks per step
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    # CB chunks' counts per step as one [CB, BINS] tile, so a step's loads are in flight together
    # (one chunk a step made each loop a chain of T*K / 1024 dependent loads; on an H200 that
    # cost less than the block labels did, PERF_LOG 2026-11-28 fifth session).
    pdl_wait(PDL)
    bins = tl.arange(0, BINS)
    cb = tl.arange(0, CB)
    is_expert = bins < E_L
    total = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, num_chunks, CB):
        c = c0 + cb
        tile = chunk_counts_ptr + c[:, None] * BINS + bins[None, :]
        total += tl.sum(tl.load(tile, mask=(c < num_chunks)[:, None], other=0), axis=0)
    total = tl.where(is_expert, total, 0)
    run = _expert_runs(total, bins, is_expert, expert_counts_ptr, num_padded_ptr, block_expert_ptr, num_blocks,
                       BLOCK_M, BLOCK_B)  # fmt: skip

    # base[c, e] = (first slot of e) + (pairs of e in earlier chunks) - (first position of e
    # in chunk c sorted by expert); the scatter adds the sorted position.
    for c0 in range(0, num_chunks, CB):
        c = c0 + cb
        ok = (c < num_chunks)[:, None]
        cnt = tl.load(chunk_counts_ptr + c[:, None] * BINS + bins[None, :], mask=ok, other=0)
        cnt = tl.where(is_expert[None, :], cnt, 0)
        earlier = tl.cumsum(cnt, 0) - cnt  # pairs of e in this step's earlier chunks
        first = tl.cumsum(cnt, 1) - cnt  # first position of e in its chunk, sorted by expert
        tl.store(chunk_base_ptr + c[:, None] * BINS + bins[None, :], run[None, :] + earlier - first, mask=ok)
        run += tl.sum(cnt, axis=0)


@triton.jit
def _align_scatter_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    chunk_base_ptr,  # int32 [num_chunks, BINS]
    sorted_ids_ptr,  # int32 [P]
    num_pairs,
    E_G,
    E_L,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
    BINS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):
    pdl_wait(PDL)
    c = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    e = _local_expert(topk_ids_ptr, expert_map_ptr, c * CHUNK + i, num_pairs, E_G, E_L, HAS_MAP, BINS)
    # Sorting (expert, index) keys gives each pair's position among the chunk's pairs of its
    # expert without a CHUNK x CHUNK comparison; keys < BINS * CHUNK <= 2^21 fit int32.
    key = tl.sort(e * CHUNK + i)
    e_s = key // CHUNK
    dest = tl.load(chunk_base_ptr + c * BINS + e_s) + i
    tl.store(sorted_ids_ptr + dest, c * CHUNK + key % CHUNK, mask=e_s < E_L)


@triton.jit
def _align_one_kernel(
    topk_ids_ptr, expert_map_ptr,
    base_ptr,  # int32 [BINS] scratch: each expert's base slot, read back by other threads
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, expert_counts_ptr,  # out, as AlignedRouting holds them
    num_pairs, num_slots, num_blocks, E_G, E_L,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # >= num_pairs
    BINS: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.launch sets it)
):  # fmt: skip
    """The three kernels above in one program (grid (1,)), for num_pairs <= CHUNK."""
    pdl_wait(PDL)
    i = tl.arange(0, CHUNK)
    e = _local_expert(topk_ids_ptr, expert_map_ptr, i, num_pairs, E_G, E_L, HAS_MAP, BINS)
    bins = tl.arange(0, BINS)
    is_expert = bins < E_L
    total = tl.where(is_expert, tl.histogram(e, BINS), 0)
    start = _expert_runs(total, bins, is_expert, expert_counts_ptr, num_padded_ptr, block_expert_ptr, num_blocks,
                         BLOCK_M, BLOCK_B)  # fmt: skip

    # base[e] = (first slot of e) - (first position of e among the pairs sorted by expert)
    tl.store(base_ptr + bins, start - (tl.cumsum(total, 0) - total))
    sentinel = tl.zeros([FILL], dtype=tl.int32) + num_pairs
    for s0 in range(0, num_slots, FILL):
        o = s0 + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + o, sentinel, mask=o < num_slots)
    # One barrier for two hazards between threads of this program: the fill above and the
    # scatter below write the same slots from different threads (without it a late fill
    # store could overwrite a pair's index), and each thread reads base[] entries that other
    # threads stored. bar.sync orders and makes visible the block's global-memory accesses.
    tl.debug_barrier()

    key = tl.sort(e * CHUNK + i)  # by (expert, flat index), as in _align_scatter_kernel
    e_s = key // CHUNK
    dest = tl.load(base_ptr + e_s) + i
    tl.store(sorted_ids_ptr + dest, key % CHUNK, mask=e_s < E_L)
