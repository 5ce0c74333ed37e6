"""moe_align: the Triton kernels equal moe_align_ref exactly, and both keep the
AlignedRouting invariants, on the labelled edge cases.

Both launch paths run on every case: the one-program kernel (T*K <= 1024, every decode
step) and the three-kernel pipeline, forced with ``one_launch``. BM goes down to 1: a
decode GEMM path will use BM in {1, 2, 4, 8}."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.errors import FusedMoEError
from fusedmoe.kernels import align as align_mod
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.align import moe_align, moe_align_launch, moe_align_ref
from fusedmoe.metadata import AlignedRouting
from fusedmoe.testing import EDGE_CASES, poison_, random_topk

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
FIELDS = ("sorted_ids", "block_expert", "num_padded", "expert_counts")
BLOCK_MS = [1, 2, 4, 8, 16, 64]
PATHS = {"one_launch": True, "three_kernels": False}


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


class _PoisoningTorch:
    """``torch`` for align.py whose ``empty`` returns poisoned buffers, so unwritten outputs show."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*a, **k):
        return poison_(torch.empty(*a, **k))


@needs_triton
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.label for c in EDGE_CASES])
def test_align_kernel_equals_ref(case, block_m, path, monkeypatch):
    ids = _ids(case).to(DEVICE)
    monkeypatch.setattr(align_mod, "torch", _PoisoningTorch())
    got = moe_align_launch(ids, case.e, block_m, one_launch=PATHS[path])
    ref = moe_align_ref(ids, case.e, block_m)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    check_invariants(got, ids, case.e)


@needs_triton
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("blocks_per_step", [1, 4, 16], ids=lambda b: f"{b}-blocks-a-step")
@pytest.mark.parametrize("block_m", [1, 4])
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.label for c in EDGE_CASES])
def test_block_experts_over_many_steps(case, block_m, blocks_per_step, path, monkeypatch):
    """block_expert labelled a few blocks per step (the shipped step covers the tiny cases in one):
    runs that end inside a step, on its first block, past it, and empty experts."""
    monkeypatch.setattr(align_mod, "_BLOCK_B", blocks_per_step)
    ids = _ids(case, seed=3).to(DEVICE)
    got = moe_align_launch(ids, case.e, block_m, one_launch=PATHS[path])
    ref = moe_align_ref(ids, case.e, block_m)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


@pytest.fixture
def launches():
    """Names of the align kernels launched, in order (through the launch interceptor, so the GPU's
    direct-launch path is covered too)."""
    from fusedmoe.kernels.launch import intercept_launches

    names = []

    def record(kernel, grid, args, kwargs):
        names.append(kernel.fn.__name__)
        kernel[grid](*args, **kwargs)

    with intercept_launches(record):
        yield names


@needs_triton
@pytest.mark.parametrize(
    "label,t,e,k,block_m,launched",
    [
        ("decode_T1", 1, 8, 2, 16, 1),
        ("decode_T64_dsv3", 64, 256, 8, 1, 1),
        ("TK_1024_max_one_chunk", 128, 64, 8, 64, 1),
        ("TK_1025_two_chunks", 205, 16, 5, 16, 3),
    ],
)
def test_align_launch_count(label, t, e, k, block_m, launched, launches):
    """One launch while all pairs fit one chunk (T*K <= 1024), three beyond; same outputs."""
    g = torch.Generator().manual_seed(6)
    ids = random_topk(t, e, k, g)[0].to(DEVICE)
    got = moe_align_launch(ids, e, block_m)
    assert len(launches) == launched, launches
    ref = moe_align_ref(ids, e, block_m)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    check_invariants(got, ids, e)


@needs_triton
def test_align_one_launch_needs_one_chunk():
    ids = random_topk(50, 7, 3, torch.Generator().manual_seed(1))[0].to(DEVICE)
    with pytest.raises(FusedMoEError, match="one_launch"):
        moe_align_launch(ids, 7, 16, chunk=16, one_launch=True)


@needs_triton
@pytest.mark.parametrize(
    "chunk, tile",
    [
        pytest.param(16, None, id="10-chunks-one-step"),
        pytest.param(64, None, id="3-chunks-one-step"),
        # 8 bins: 4 chunks per step of the offsets kernel, 10 chunks = 3 steps, the last one
        # partial (the running bases carry over steps)
        pytest.param(16, 32, id="10-chunks-steps-of-4"),
        pytest.param(16, 8, id="10-chunks-steps-of-1"),
    ],
)
def test_align_many_chunks(chunk, tile, monkeypatch):
    """Pairs of one expert spread over several chunks keep flat-index order."""
    if tile is not None:
        monkeypatch.setattr(align_mod, "_OFFSETS_TILE", tile)
    g = torch.Generator().manual_seed(1)
    ids = random_topk(50, 7, 3, g)[0].to(DEVICE)  # 150 pairs, prime E
    got = moe_align_launch(ids, 7, 16, chunk=chunk)  # several chunks: the three kernels
    ref = moe_align_ref(ids, 7, 16)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


@needs_triton
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("label", ["some_local", "none_local"])
def test_align_expert_map(label, block_m, path):
    """expert_map with -1s: non-local pairs appear nowhere; local ids are renumbered."""
    g = torch.Generator().manual_seed(2)
    ids = random_topk(13, 8, 3, g)[0].to(DEVICE)
    if label == "some_local":
        emap = torch.tensor([-1, 0, -1, 1, 2, -1, -1, 3], dtype=torch.int32, device=DEVICE)
    else:
        emap = torch.full((8,), -1, dtype=torch.int32, device=DEVICE)
    got = moe_align_launch(ids, 4, block_m, expert_map=emap, one_launch=PATHS[path])
    ref = moe_align_ref(ids, 4, block_m, expert_map=emap)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    check_invariants(got, ids, 4, emap)


@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.label for c in EDGE_CASES])
def test_align_ref_invariants(case, block_m):
    ids = _ids(case, seed=3)
    check_invariants(moe_align_ref(ids, case.e, block_m), ids, case.e)


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
    [(1, 8, 2, 16), (64, 256, 8, 1), (64, 256, 8, 8), (77, 64, 8, 16), (512, 64, 8, 64), (4096, 256, 8, 128)]
    + [(3000, 16, 1, 32)],
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
