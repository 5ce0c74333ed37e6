"""Typed routing metadata shared by every backend (what the router and the aligner produce).

Shapes use T tokens, K top-k, E_l local experts, BM the block size of the
grouped GEMM. Every field is a device tensor (or None where a pair-block routing
has none); sizes that depend on the data are *upper bounds* so nothing needs a
host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Expert id dtypes every kernel and check takes as they are (transformers' routers give int64;
# the kernels compare ids in their own width, so no int64 id wraps into [0, E)).
ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class TopK:
    """The router's choice.

    ids:     int32 or int64 [T, K] global expert ids, distinct within a row.
    weights: float32 [T, K] router weights (already renormalized/scaled).

    Ids outside [0, E) (-1, the usual "no expert" mark, included) are not errors: such a
    (token, k) pair contributes nothing, and its weight is dropped (the token's other pairs
    are not renormalized). So does a pair whose expert maps to an entry outside [0, E_local)
    of the expert map (-1: another rank's expert). Every backend, dispatcher and kernel
    honours this without reading the ids on the host (``local_expert_ids``); with value
    checks on (``FUSEDMOE_CHECK_VALUES``) ids other than -1 outside [0, E) raise instead.
    """

    ids: torch.Tensor
    weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]


@dataclass(frozen=True)
class AlignedRouting:
    """(token, k) pairs sorted by local expert, each expert's run padded to BM.

    sorted_ids:   int32 [P] with P = max_padded(T*K, E_l, BM): the flat index
                  t*K + k of the pair in each slot; T*K marks a padding slot.
    block_expert: int32 [P // BM]: local expert of each BM block; -1 for blocks
                  past ``num_padded`` or whose expert is not local.
    num_padded:   int32 [1]: used slots (a multiple of BM), on the device.
    expert_counts: int32 [E_l]: pairs routed to each local expert.
    block_m:      BM.
    num_pairs:    T*K (the padding sentinel).

    Invariants (tested): counts sum to the number of local pairs; every local
    pair appears exactly once in sorted_ids[:num_padded]; slots of a block all
    belong to its expert; padding slots hold num_pairs.

    pair_blocks (``kernels.align.pair_blocks``, decode without ``moe_align``): block b holds
    pair b alone, in slot b * BM (the block's other slots are padding). ``block_expert`` is
    then the pairs' own expert ids [T*K], unchecked: the kernels skip a block whose id is
    outside [0, E_l), as ``moe_align`` leaves such pairs out. ``sorted_ids``, ``num_padded``
    and ``expert_counts`` are None (the kernels derive the slots from the block index;
    ``slot_ids()`` makes them for references and tests).
    """

    sorted_ids: torch.Tensor | None
    block_expert: torch.Tensor
    num_padded: torch.Tensor | None
    expert_counts: torch.Tensor | None
    block_m: int
    num_pairs: int
    pair_blocks: bool = False

    def slot_ids(self) -> torch.Tensor:
        """int32 [blocks * BM]: the pair in each slot (``num_pairs`` for padding)."""
        if not self.pair_blocks:
            return self.sorted_ids
        n, bm = self.num_pairs, self.block_m
        slots = torch.full((n, bm), n, dtype=torch.int32, device=self.block_expert.device)
        slots[:, 0] = torch.arange(n, dtype=torch.int32, device=slots.device)
        return slots.reshape(-1)

    @staticmethod
    def max_padded(num_pairs: int, num_local_experts: int, block_m: int) -> int:
        """Upper bound on used slots: every expert's run rounded up to BM."""
        bound = num_pairs + num_local_experts * (block_m - 1)
        return max(block_m, -(-bound // block_m) * block_m)


def local_expert_ids(ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int) -> torch.Tensor:
    """int64 local expert of each element of ``ids``, or -1 for a pair that contributes nothing
    (see ``TopK``): an id outside [0, E) (E = the expert map's length, or ``num_local`` without
    one) or one whose map entry is outside [0, num_local). Two or three elementwise ops; never
    indexes out of bounds, whatever ``ids`` and ``expert_map`` hold."""
    e = ids.long()
    if expert_map is None:
        return torch.where((e >= 0) & (e < num_local), e, -1)
    n = expert_map.shape[0]
    local = expert_map.long()[e.clamp(0, max(n - 1, 0))] if n else torch.full_like(e, -1)
    return torch.where((e >= 0) & (e < n) & (local >= 0) & (local < num_local), local, -1)


def int32_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``ids`` as int32 for the kernels, keeping every id outside [0, num_experts) outside it
    (a plain cast would wrap an int64 id of 2^32 + 1 to the valid id 1). No-op for int32."""
    if ids.dtype == torch.int32:
        return ids
    return ids.long().clamp(-1, num_experts).to(torch.int32)
