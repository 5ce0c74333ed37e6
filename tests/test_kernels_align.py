"""moe_align: the Triton kernels equal moe_align_ref exactly, and both keep the
AlignedRouting invariants, on the labelled edge cases."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.align import moe_align, moe_align_launch, moe_align_ref
from fusedmoe.metadata import AlignedRouting
from fusedmoe.testing import EDGE_CASES, random_topk

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
FIELDS = ("sorted_ids", "block_expert", "num_padded", "expert_counts")


def check_invariants(r: AlignedRouting, topk_ids: torch.Tensor, e_l: int, expert_map=None) -> None:
    """What every consumer of AlignedRouting relies on (metadata.AlignedRouting docstring)."""
    t, k = topk_ids.shape
    bm, n = r.block_m, t * k
    flat = topk_ids.reshape(-1).long().cpu()
    local = expert_map.long().cpu()[flat] if expert_map is not None else flat
    sid, be = r.sorted_ids.long().cpu(), r.block_expert.long().cpu()
    used = int(r.num_padded.item())
    assert r.num_pairs == n
    assert sid.numel() == AlignedRouting.max_padded(n, e_l, bm) and be.numel() * bm == sid.numel()
    assert used % bm == 0 and used <= sid.numel()
    want_counts = torch.bincount(local[local >= 0], minlength=e_l)
    assert torch.equal(r.expert_counts.long().cpu(), want_counts)
    # every local pair exactly once in the used slots; nothing else but padding
    real = sid[:used][sid[:used] < n]
    assert torch.equal(real.sort().values, (local >= 0).nonzero().flatten())
    assert bool((sid[used:] == n).all()) and bool((sid <= n).all())
    # blocks: their slots belong to their expert, experts in increasing order, -1 past the end
    slot_expert = be.repeat_interleave(bm)
    assert bool((slot_expert[:used] >= 0).all()) and bool((be[used // bm :] == -1).all())
    assert torch.equal(local[real], slot_expert[:used][sid[:used] < n])
    assert bool((be[: used // bm].diff() >= 0).all())
    # each expert's run: its pairs in increasing flat index, then padding (< BM slots)
    for e in range(e_l):
        run = sid[:used][slot_expert[:used] == e]
        pairs = run[run < n]
        assert torch.equal(pairs, pairs.sort().values)
        assert run.numel() == -(-pairs.numel() // bm) * bm
        assert bool((run[pairs.numel() :] == n).all())


def _ids(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    return random_topk(case.t, case.e, case.k, g, case.routing)[0]


@needs_triton
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.label for c in EDGE_CASES])
def test_align_kernel_equals_ref(case, block_m):
    ids = _ids(case).to(DEVICE)
    got = moe_align_launch(ids, case.e, block_m)
    ref = moe_align_ref(ids, case.e, block_m)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    check_invariants(got, ids, case.e)


@needs_triton
@pytest.mark.parametrize("chunk", [16, 64])
def test_align_many_chunks(chunk):
    """Pairs of one expert spread over several chunks keep flat-index order."""
    g = torch.Generator().manual_seed(1)
    ids = random_topk(50, 7, 3, g)[0].to(DEVICE)  # 150 pairs, prime E
    got = moe_align_launch(ids, 7, 16, chunk=chunk)
    ref = moe_align_ref(ids, 7, 16)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


@needs_triton
@pytest.mark.parametrize("label", ["some_local", "none_local"])
def test_align_expert_map(label):
    """expert_map with -1s: non-local pairs appear nowhere; local ids are renumbered."""
    g = torch.Generator().manual_seed(2)
    ids = random_topk(13, 8, 3, g)[0].to(DEVICE)
    if label == "some_local":
        emap = torch.tensor([-1, 0, -1, 1, 2, -1, -1, 3], dtype=torch.int32, device=DEVICE)
    else:
        emap = torch.full((8,), -1, dtype=torch.int32, device=DEVICE)
    got = moe_align_launch(ids, 4, 16, expert_map=emap)
    ref = moe_align_ref(ids, 4, 16, expert_map=emap)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    check_invariants(got, ids, 4, emap)


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.label for c in EDGE_CASES])
def test_align_ref_invariants(case):
    ids = _ids(case, seed=3)
    check_invariants(moe_align_ref(ids, case.e, 16), ids, case.e)


def test_align_cpu_path_is_ref(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ids = _ids(EDGE_CASES[2])
    got, ref = moe_align(ids, 4, 16), moe_align_ref(ids, 4, 16)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "t,e,k,block_m",
    [(1, 8, 2, 16), (77, 64, 8, 16), (512, 64, 8, 64), (4096, 256, 8, 128), (3000, 16, 1, 32)],
)
@pytest.mark.parametrize("with_map", [False, True])
def test_align_real_shapes(t, e, k, block_m, with_map):
    g = torch.Generator().manual_seed(4)
    ids = random_topk(t, e, k, g)[0].cuda()
    emap, e_l = None, e
    if with_map:  # rank 1 of 2 under round-robin placement
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[1::2] = torch.arange(e // 2, dtype=torch.int32)
        emap, e_l = emap.cuda(), e // 2
    got = moe_align(ids, e_l, block_m, expert_map=emap)
    ref = moe_align_ref(ids, e_l, block_m, expert_map=emap)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    check_invariants(got, ids, e_l, emap)
