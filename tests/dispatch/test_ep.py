"""Expert parallelism over gloo: every EP dispatcher on 2 and 4 CPU ranks against the float64 reference.

Each multi-process test forks one world (fork start: ~0.02 s against ~3-6 s
for spawn on 2 cores), on a fresh free port, with timeouts on the process
group, the result queue and the joins, and runs a group of checks from
``fusedmoe.testing.ep_check`` (the same code scripts/ep_suite.sh runs under NCCL).
The row movers' Triton kernels (``dispatch/rows.py``) are checked against their
PyTorch references in one process (the interpreter here, the GPU there).
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import traceback
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.dispatch.ep.base import RowLayout
from fusedmoe.dispatch.ep.groups import ExpertPlacement, layer_fingerprint, shard_experts
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.rows import (
    as_words,
    gather_sum_launch,
    gather_sum_ref,
    rank_rows_launch,
    rank_rows_ref,
    scatter_rows_launch,
    scatter_rows_ref,
)
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import ep_check, make_problem

WORLD_TIMEOUT_S = 90
GROUP_SCALED = {"fp8_block", "int8_w8a8_block", "mxfp4_mxfp8", "nvfp4"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(dev):
    return [ep_check.run_case(case, dev) for case in ep_check.cpu_cases(torch.distributed.get_world_size())]


def _bench_smoke(dev, out_dir):
    from fusedmoe.tools import bench_ep

    argv = ["--preset", "tiny", "--tokens", "0,1,7", "--iters", "1", "--layer-tokens", "3", "--out", str(out_dir)]
    return bench_ep.main(argv)


def _barrier_job(dev):
    """Rank 1 never arrives: rank 0's barrier must fail within its timeout, naming rank 1."""
    from fusedmoe.dispatch.ep.groups import barrier

    barrier(timeout_s=30)  # both arrive
    if torch.distributed.get_rank() == 1:
        return "skipped"
    try:
        barrier(timeout_s=2)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _worker(rank: int, world: int, port: int, job, args, q) -> None:
    import torch.distributed as dist

    from fusedmoe.dispatch.ep.groups import init_ep

    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        torch.set_num_threads(1)
        init_ep("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout_s=60)
        out = job(torch.device("cpu"), *args)
        q.put((rank, "ok", out))
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def _run_world(world: int, job, *args) -> list:
    """Fork ``world`` ranks running ``job(device, *args)``; returns each rank's result (index = rank)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, job, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        for _ in range(world):
            rank, status, out = q.get(timeout=WORLD_TIMEOUT_S)
            got[rank] = (status, out)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    missing = sorted(set(range(world)) - set(got))
    assert not missing, f"ranks {missing} did not report within {WORLD_TIMEOUT_S}s (hang?); got {got}"
    errors = {r: out for r, (s, out) in got.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    return [got[r][1] for r in range(world)]


# ---- multi-process ------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_ep_dispatchers_match_reference(world):
    """allgather_reducescatter and all2all with reference/cpu experts, all2all_low_latency with
    reference_batched, x bf16/fp8_token/fp8_block; tokens (5, 0) / (3, 0, 8, 1); 7 experts on 2 and 4
    ranks, linear / round-robin; plus the router weight on the input, and on 2 ranks the other wire
    formats (static fp8 tensor scale, int8 groups, MXFP8, NVFP4). Each case runs every exchange path
    (``ep_check.PATHS``: sizes exchanged, fixed blocks of a workspace, MoEKernel in chunks of 2 with and
    without ``allocate``), and each path must have exchanged as ``ep_check.MODES`` says; the low-latency
    dispatcher runs with (direct, no bound) and without (bound <= capacity) its overflow bookkeeping."""
    per_rank = _run_world(world, _cases)
    labels = {r.label for r in per_rank[0]}
    assert len(labels) == len(ep_check.cpu_cases(world))
    assert {c.split("+")[0] for c in labels} == set(ep_check.DISPATCHERS)
    bad = [f"rank {r.rank} {r.label}: {r.detail}" for rank in per_rank for r in rank if not r.ok]
    assert not bad, "\n".join(bad)
    assert any(r.rows == 0 for r in per_rank[1]), "one rank must hold no token"
    for r in per_rank[0]:
        assert r.extra["modes"] == list(ep_check.MODES[r.label.split("+")[0]]), (r.label, r.extra["modes"])
    for r in per_rank[0]:
        dname, scheme = r.label.split("+")[0], r.label.split("/")[1]
        # all2all sends the model dtype unless a1 has group/block scales; the others send a1's format
        want = scheme != "bf16" and (dname != "all2all" or scheme in GROUP_SCALED)
        assert r.extra["quantized_before_exchange"] == want, r.label


@pytest.mark.parametrize("world", [2, 4])
def test_token_bound_edges(world):
    """MoEKernel.allocate(2) with a rank holding 5 tokens: every rank leaves the workspace alone
    together (all2all back to variable sizes) and matches the reference; workspaces of different
    sizes raise on every rank."""
    per_rank = _run_world(world, ep_check.check_bounds)
    assert ep_check.bounds_ok(per_rank), per_rank


@pytest.mark.parametrize("world", [2, 4])
def test_fixed_blocks_never_sync_the_host(world):
    """Fixed blocks: no .item()/.tolist()/nonzero/host-to-device copy in dispatch + combine (what a
    CUDA graph needs); variable sizes: their one sync is seen, so the spy works."""
    per_rank = _run_world(world, ep_check.check_no_host_sync)
    assert ep_check.no_host_sync_ok(per_rank), per_rank


def test_config_mismatch_raises_on_every_rank():
    per_rank = _run_world(2, ep_check.check_mismatch)
    for rank, got in enumerate(per_rank):
        msg = got["hidden_size"]
        assert "MoEConfig.hidden_size" in msg and "rank 0=64" in msg and "rank 1=96" in msg, (rank, msg)
        assert "top_k" not in msg, msg  # only what differs is named
        assert "dispatcher.capacity" in got["capacity"] and "rank 1=5" in got["capacity"], got["capacity"]
        assert "ParallelConfig.ep_size" in got["ep_size"], got["ep_size"]
        assert got["agree"] == "ok"


def test_low_latency_capacity_overflow_is_reported():
    per_rank = _run_world(2, ep_check.check_overflow)
    for got in per_rank:
        assert "capacity=2" in got["eager"] and "needed 6" in got["eager"], got["eager"]
        assert got["flag"] == 6
        assert "capacity=2" in got["check"] and "needed 6" in got["check"], got["check"]
        assert got["fits"]["ok"], got["fits"]


def test_bench_ep_runs_on_gloo(tmp_path):
    """The benchmark program end to end at a tiny shape (timings meaningless; the GPU suite measures):
    every (dispatcher, mode) row with its raw all-to-all and ratio, and the layer on one rank against EP."""
    from fusedmoe.tools import bench_ep

    assert _run_world(2, _bench_smoke, tmp_path) == [0, 0]
    data = json.loads((tmp_path / "bench_ep_w2.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 3 * len(bench_ep.MODES) and not [r for r in rows if "error" in r], rows
    assert all(r["dispatch_MB"] >= 0 and r["dispatch_us"] > 0 and r["ratio_eager"] > 0 for r in rows)
    md = (tmp_path / "bench_ep_w2.md").read_text()
    assert md.count("| all2all_low_latency | fixed |") == 6 and md.count("| all2all | variable |") == 6
    layer = data["layer"]
    assert [r["setup"] for r in layer if r["scheme"] == "bf16"] == [
        "1 GPU",
        "EP2 allgather_reducescatter",
        "EP2 all2all",
        "EP2 all2all_low_latency",
    ], layer
    assert not [r for r in layer if "error" in r], layer
    assert all(r["speedup_eager"] > 0 for r in layer if r["setup"] != "1 GPU")


def test_barrier_times_out_naming_the_missing_rank():
    got = _run_world(2, _barrier_job)
    assert got[1] == "skipped"
    assert re.search(r"Ranks? 1\b", got[0]) and "monitoredBarrier" in got[0], got[0]


# ---- single process ------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_placement_matches_parallel_config(world, placement):
    e = 7
    pl = ExpertPlacement.of(e, ParallelConfig(ep_size=world, placement=placement))
    assert sum(pl.local_counts) == e and max(pl.local_counts) - min(pl.local_counts) == 1
    for r in range(world):
        par = ParallelConfig(ep_size=world, ep_rank=r, placement=placement)
        assert pl.experts_of(r) == par.local_experts(e)
        emap = par.expert_map(e)
        for g in range(e):
            assert (pl.owner[g] == r) == (emap[g] >= 0)
            if pl.owner[g] == r:
                assert pl.local_id[g] == emap[g]


# ---- the row movers: Triton kernels (on the GPU, or the interpreter) against their references ----
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1"
)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_scatter_rows_kernel_matches_reference(dtype, device):
    """J = 3 destinations per row, -1 and out-of-range indices skipped, a strided index."""
    g = torch.Generator().manual_seed(0)
    n, d, r, j = 9, 40, 30, 3
    src = torch.randint(0, 100, (n, d), generator=g).to(dtype)
    perm = torch.randperm(r, generator=g)[: n * j].view(n, j)  # distinct destinations
    idx = torch.cat([perm, torch.full((n, 1), 7)], dim=1)[:, :j]  # a strided [n, j] view
    idx[0, 1], idx[2, 0], idx[4, 2] = -1, r, r + 5
    fill = torch.full((r, d), 55, dtype=dtype)
    want = scatter_rows_ref(src, idx, fill.clone())
    got = scatter_rows_launch(src.to(device), idx.to(device), fill.to(device)).cpu()
    assert torch.equal(got, want)
    assert torch.equal(want[perm[1]], src[1].expand(j, d))  # a row with all its destinations valid


@needs_triton
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_sum_kernel_matches_reference(weighted, dtype, device):
    """Rows summed in fp32 with j in order; skipped indices read nothing (a NaN row stays out)."""
    g = torch.Generator().manual_seed(1)
    r, n, j, h = 12, 7, 4, 300
    src = torch.randn(r, h, generator=g).to(dtype)
    src[11] = float("nan")  # only ever named by a skipped index
    idx = torch.randint(0, 11, (n, j), generator=g, dtype=torch.int32)
    idx[0] = -1  # a row with nothing: zeros
    idx[1, 2], idx[3, 0] = 11 + 1, -1
    wts = torch.rand(n, 2 * j, generator=g)[:, ::2] if weighted else None  # strided weights
    want = gather_sum_ref(src, idx, torch.empty(n, h, dtype=dtype), wts)
    out = torch.full((n, h), float("nan"), dtype=dtype, device=device)
    dev_w = None if wts is None else torch.rand(n, 2 * j, device=device)[:, ::2].copy_(wts)  # strided there too
    got = gather_sum_launch(src.to(device), idx.to(device), out, dev_w).cpu()
    assert torch.isfinite(got).all() and torch.equal(got[0], torch.zeros(h, dtype=dtype))
    # both add in fp32 and round once: equal up to the order of fp32 additions
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(got, want, **tol)
    exact = src.double()[idx[2].long()] * (wts[2].double().unsqueeze(1) if weighted else 1.0)
    torch.testing.assert_close(got[2].double(), exact.sum(0), **tol)


@needs_triton
@pytest.mark.parametrize("wire", [False, True])
@pytest.mark.parametrize("rows", [None, 150])
@pytest.mark.parametrize("t", [0, 1, 7, 150])
def test_route_kernel_matches_reference(t, rows, wire, device):
    """Tokens to ranks: 3 ranks (not a power of 2), 11 experts, K 3; 150 tokens span several
    blocks of the kernel's scan; wire ids mark some pairs as not sent."""
    g = torch.Generator().manual_seed(t)
    e, k, w = 11, 3, 3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k)
    ids = ids.to(torch.int32)
    if wire:
        ids = torch.where(torch.rand(t, k, generator=g) < 0.3, 0, ids + 1).to(torch.int32)
    owner = torch.tensor([i % w for i in range(e)], dtype=torch.int32)
    want = rank_rows_ref(ids, owner, w, rows, wire=wire)
    got = rank_rows_launch(ids.to(device), owner.to(device), w, rows, wire=wire)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    if t:  # each rank's rows are 0.. (or r * rows ..) in token order, one per token that goes there
        d = want[0]
        for r in range(w):
            mine = d[:, r][d[:, r] >= 0]
            start = r * rows if rows is not None else int(want[1][:r].sum())
            assert torch.equal(mine, torch.arange(start, start + mine.numel()))


def test_as_words_views_rows_without_copies():
    lay = RowLayout([("x", torch.bfloat16, (12,)), ("s", torch.float32, (1,)), ("ids", torch.int32, (3,))])
    buf = lay.empty(5, "cpu")
    assert as_words(buf).dtype == torch.int64 and as_words(buf).data_ptr() == buf.data_ptr()
    assert as_words(lay.raw(buf, "x")).dtype == torch.int64  # 24 bytes at offset 0, stride 64
    assert as_words(lay.raw(buf, "s")).dtype == torch.int32  # 4 bytes
    assert as_words(lay.raw(buf, "ids")).dtype == torch.int32  # 12 bytes
    x = torch.randn(5, 12).to(torch.bfloat16)
    lay.view(buf, "x").copy_(x)
    assert torch.equal(as_words(lay.raw(buf, "x")).view(torch.uint8).view(torch.bfloat16), x)


def test_row_layout_round_trips_fp8_and_ints():
    lay = RowLayout([("data", torch.float8_e4m3fn, (5,)), ("scale", torch.float32, (2,)), ("ids", torch.int32, (3,))])
    assert lay.row_bytes % 16 == 0
    data = torch.randn(4, 5).to(torch.float8_e4m3fn)
    scale, ids = torch.rand(4, 2), torch.randint(0, 9, (4, 3), dtype=torch.int32)
    buf = lay.pack(lay.empty(4, "cpu"), data=data, scale=scale, ids=ids)
    d2, s2, i2 = lay.unpack(buf[torch.tensor([0, 1, 2, 3])], "data", "scale", "ids")
    assert torch.equal(d2.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(s2, scale) and torch.equal(i2, ids)


def test_shard_experts_keeps_per_expert_scales():
    config, scheme = MoEConfig(7, 2, 128, 64), QuantScheme.fp8_block()
    w = make_problem(config, scheme, 1).weights
    part = shard_experts(w, [6, 2])
    assert part.num_experts == 2
    assert torch.equal(part.w13.data.view(torch.uint8), w.w13.data[[6, 2]].view(torch.uint8))
    assert torch.equal(part.w2.scale, w.w2.scale[[6, 2]])


def test_fingerprint_leaves_out_rank_fields():
    c, s = MoEConfig(7, 2, 64, 32), QuantScheme.unquantized()
    a = layer_fingerprint(c, s, ParallelConfig(ep_size=2, ep_rank=0), "all2all")
    b = layer_fingerprint(c, s, ParallelConfig(ep_size=2, ep_rank=1), "all2all")
    assert a == b and "MoEConfig.hidden_size" in a and "ParallelConfig.ep_size" in a
