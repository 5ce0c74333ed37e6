"""Group (token, k) pairs by local expert and pad each expert's run to BM: ``moe_align``.

    topk_ids [T, K] --(expert_map)--> local expert per pair (or not local)
      -> counts per local expert, runs padded to BM, laid out in expert order
      -> sorted_ids [P]: the flat index t*K + k of the pair in each slot (T*K = padding)
      -> block_expert [P / BM]: the local expert of each BM block (-1 past the end)

Everything stays on the device: P = ``AlignedRouting.max_padded(T*K, E_l, BM)`` is an
upper bound known on the host, the used length ``num_padded`` is a device tensor. The
grouped GEMM skips blocks whose expert is -1, so no host synchronisation is needed and
the op can be captured in a CUDA graph. Pairs of one expert keep increasing flat-index
order, so the result is deterministic and equal to ``moe_align_ref``.

Launches: one when T*K <= 1024 (all pairs in one chunk: every decode step; the three
phases run in one program), else three (count, offsets, scatter; see ``_align.py``).
At decode each launch costs 2-4 us on an H100, more than the work itself.
"""

from __future__ import annotations

import torch

from ..errors import expect
from ..metadata import ID_DTYPES, AlignedRouting
from ._align import _align_count_kernel, _align_offsets_kernel, _align_one_kernel, _align_scatter_kernel
from ._common import cdiv, interpreting, next_power_of_2
from .launch import launch

# Pairs per program of the count and scatter kernels. 1024 keeps the sort of one chunk
# in registers with 4 warps; a decode step (T*K <= 64 x 8) uses one small chunk, and so
# one launch of _align_one_kernel.
_MAX_CHUNK = 1024
_FILL = 1024  # sentinel slots written per program and loop step
_BLOCK_B = 512  # blocks labelled per step of the offsets kernel (one step up to T*K ~ 32K at BM 64)
_OFFSETS_TILE = 8192  # chunk counts per step of the offsets kernel (64 a thread at 4 warps)


def _check(topk_ids: torch.Tensor, num_local_experts: int, block_m: int, expert_map) -> None:
    expect(topk_ids.dim() == 2, "topk_ids", "a [T, K] tensor", tuple(topk_ids.shape))
    expect(topk_ids.dtype in ID_DTYPES, "topk_ids", "int32 or int64", topk_ids.dtype)
    expect(num_local_experts > 0, "num_local_experts", "> 0", num_local_experts)
    expect(block_m > 0, "block_m", "> 0", block_m)
    if expert_map is not None:
        expect(expert_map.dtype == torch.int32, "expert_map", "int32", expert_map.dtype)
        expect(expert_map.dim() == 1, "expert_map", "a [E] tensor", tuple(expert_map.shape))


def moe_align_launch(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    block_m: int,
    expert_map: torch.Tensor | None = None,
    chunk: int | None = None,
    one_launch: bool | None = None,
) -> AlignedRouting:
    """Allocate the outputs and run the align kernels: ``_align_one_kernel`` when all pairs
    fit one chunk, else the three-kernel pipeline. ``chunk`` (a power of 2) overrides the
    pairs per program; tests use small chunks to cover many programs. ``one_launch``:
    None picks as just said; False forces the three kernels even for one chunk; True
    requires one chunk. Both give the same outputs."""
    # 113 lines: allocates the outputs and maps them to the two kernels' arguments in their order; split, that order
    # would be spread over several functions.
    t, k = topk_ids.shape
    num_pairs = t * k
    num_slots = AlignedRouting.max_padded(num_pairs, num_local_experts, block_m)
    num_blocks = num_slots // block_m
    dev = topk_ids.device
    if chunk is None:
        chunk = min(_MAX_CHUNK, max(16, next_power_of_2(num_pairs)))
    expect(chunk >= 16 and chunk & (chunk - 1) == 0, "chunk", "a power of 2 >= 16", chunk)
    num_chunks = max(1, cdiv(num_pairs, chunk))
    if one_launch is None:
        one_launch = num_chunks == 1
    expect(not one_launch or num_chunks == 1, "one_launch", f"T*K ({num_pairs}) <= chunk ({chunk})", one_launch)
    bins = next_power_of_2(num_local_experts + 1)  # last bin collects non-local pairs

    ids = topk_ids.contiguous()
    has_map = expert_map is not None
    emap = expert_map.contiguous() if has_map else ids  # any int32 pointer; never read
    e_global = expert_map.shape[0] if has_map else num_local_experts
    sorted_ids = torch.empty(num_slots, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    expert_counts = torch.empty(num_local_experts, dtype=torch.int32, device=dev)
    chunk_base = torch.empty(num_chunks, bins, dtype=torch.int32, device=dev)  # the one kernel's scratch too

    if one_launch:
        launch(
            _align_one_kernel,
            (1,),
            ids,
            emap,
            chunk_base,
            sorted_ids,
            block_expert,
            num_padded,
            expert_counts,
            num_pairs,
            num_slots,
            num_blocks,
            e_global,
            num_local_experts,
            HAS_MAP=has_map,
            BLOCK_M=block_m,
            CHUNK=chunk,
            BINS=bins,
            FILL=_FILL,
            BLOCK_B=_BLOCK_B,
            num_warps=4,
        )
        return AlignedRouting(sorted_ids, block_expert, num_padded, expert_counts, block_m, num_pairs)

    chunk_counts = torch.empty(num_chunks, bins, dtype=torch.int32, device=dev)
    launch(
        _align_count_kernel,
        (num_chunks,),
        ids,
        emap,
        chunk_counts,
        sorted_ids,
        num_pairs,
        num_slots,
        e_global,
        num_local_experts,
        HAS_MAP=has_map,
        CHUNK=chunk,
        BINS=bins,
        FILL=_FILL,
        num_warps=4,
    )
    launch(
        _align_offsets_kernel,
        (1,),
        chunk_counts,
        chunk_base,
        expert_counts,
        num_padded,
        block_expert,
        num_chunks,
        num_blocks,
        num_local_experts,
        BLOCK_M=block_m,
        BINS=bins,
        BLOCK_B=_BLOCK_B,
        CB=min(next_power_of_2(num_chunks), max(1, _OFFSETS_TILE // bins)),
        num_warps=4,
    )
    launch(
        _align_scatter_kernel,
        (num_chunks,),
        ids,
        emap,
        chunk_base,
        sorted_ids,
        num_pairs,
        e_global,
        num_local_experts,
        HAS_MAP=has_map,
        CHUNK=chunk,
        BINS=bins,
        num_warps=4,
    )
    return AlignedRouting(sorted_ids, block_expert, num_padded, expert_counts, block_m, num_pairs)


def moe_align(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    block_m: int,
    expert_map: torch.Tensor | None = None,
) -> AlignedRouting:
    """Sort the T*K (token, expert) pairs of ``topk_ids`` [T, K] (int32) by local expert.

    ``expert_map`` [E] (int32) maps global ids to local ids or -1; pairs mapped to -1
    (or outside [0, E_l)) appear nowhere. Runs on the device without a host sync on CUDA;
    on the CPU (without the Triton interpreter) it calls ``moe_align_ref``.
    """
    _check(topk_ids, num_local_experts, block_m, expert_map)
    if topk_ids.device.type == "cpu" and not interpreting():
        return moe_align_ref(topk_ids, num_local_experts, block_m, expert_map)
    return moe_align_launch(topk_ids, num_local_experts, block_m, expert_map)


def pair_blocks(topk_ids: torch.Tensor, block_m: int) -> AlignedRouting:
    """Routing with one block per (token, k) pair, in pair order, for the grouped GEMM without
    ``moe_align``: no launch, no copy (``AlignedRouting.pair_blocks``). Worth it where pairs
    rarely share an expert, so sorting them saves no weight reads: at T = 1 the K ids of the
    token are distinct. ``_align_one_kernel`` took 6.1 us of a 59 us Qwen3-30B-A3B bf16 call
    at T = 1 on an H100 (10.1 us for DeepSeek-V3's 256 experts), one launch of four.
    ``topk_ids`` [T, K] int32 or int64 (any values: the kernels skip ids outside [0, E_l))."""
    ok = topk_ids.dim() == 2 and topk_ids.dtype in ID_DTYPES
    expect(ok, "topk_ids", "an int32 or int64 [T, K] tensor", (topk_ids.dtype, tuple(topk_ids.shape)))
    expect(block_m > 0, "block_m", "> 0", block_m)
    ids = topk_ids.reshape(-1)
    return AlignedRouting(None, ids, None, None, block_m, ids.numel(), pair_blocks=True)


def moe_align_ref(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    block_m: int,
    expert_map: torch.Tensor | None = None,
) -> AlignedRouting:
    """``moe_align`` in PyTorch (same outputs, bit for bit)."""
    _check(topk_ids, num_local_experts, block_m, expert_map)
    dev = topk_ids.device
    t, k = topk_ids.shape
    num_pairs = t * k
    e_l = num_local_experts
    num_slots = AlignedRouting.max_padded(num_pairs, e_l, block_m)
    flat = topk_ids.reshape(-1).long()
    if expert_map is not None:
        in_range = (flat >= 0) & (flat < expert_map.shape[0])
        flat = torch.where(in_range, expert_map.long()[flat.clamp(0, expert_map.shape[0] - 1)], -1)
    local = torch.where((flat >= 0) & (flat < e_l), flat, e_l)
    counts = torch.bincount(local, minlength=e_l + 1)[:e_l]
    padded = (counts + block_m - 1) // block_m * block_m
    end = torch.cumsum(padded, 0)
    start = end - padded
    num_padded = int(padded.sum())

    order = torch.sort(local, stable=True).indices  # by expert, then flat index
    n_local = int(counts.sum())
    order, ex = order[:n_local], local[order[:n_local]]
    first = torch.cumsum(counts, 0) - counts  # position of each expert's first pair in ``order``
    dest = start[ex] + torch.arange(n_local, device=dev) - first[ex]
    sorted_ids = torch.full((num_slots,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)

    s = torch.arange(num_slots // block_m, device=dev) * block_m
    block_expert = torch.searchsorted(end, s, right=True)
    block_expert = torch.where(s < num_padded, block_expert, -1).to(torch.int32)
    return AlignedRouting(
        sorted_ids=sorted_ids,
        block_expert=block_expert,
        num_padded=torch.tensor([num_padded], dtype=torch.int32, device=dev),
        expert_counts=counts.to(torch.int32),
        block_m=block_m,
        num_pairs=num_pairs,
    )
