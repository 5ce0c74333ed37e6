"""CUDA graphs: workspace allocated once up front, capture, replay with new inputs.

On the CPU: ``MoEKernel.allocate`` gives the same results as per-call buffers and the
buffers are reused (same addresses) call after call. On a GPU: the standard
(local + triton) and batched (local_batched with a fixed capacity + triton_batched)
paths are captured once and replayed with three different inputs copied into the static
buffers; every replay equals an eager call bit for bit (same kernels, same configs).
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalBatchedDispatcher, LocalDispatcher
from fusedmoe.errors import FusedMoEError
from fusedmoe.experts.cpu import CpuExperts
from fusedmoe.experts.triton import TritonBatchedExperts, TritonExperts
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import Problem, make_problem, poison_, random_topk, rel_error, tolerance

PATHS = ["local+triton", "local_batched+triton_batched"]


def _kernel(path: str, config: MoEConfig, scheme: QuantScheme, capacity: int | None = None, **kw) -> MoEKernel:
    if path == "local+triton":
        return MoEKernel(LocalDispatcher(config, scheme), TritonExperts(config, scheme), **kw)
    if path == "local+cpu":
        return MoEKernel(LocalDispatcher(config, scheme), CpuExperts(config, scheme), **kw)
    disp = LocalBatchedDispatcher(config, scheme, capacity=capacity)
    return MoEKernel(disp, TritonBatchedExperts(config, scheme), **kw)


def _inputs(config: MoEConfig, t: int, seed: int, device) -> tuple[torch.Tensor, TopK]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, config.hidden_size, generator=g, device=device).to(config.dtype)
    ids, w = random_topk(t, config.num_experts, config.top_k, g)
    return x, TopK(ids, w)


# ---- CPU: the workspace is used and reused -------------------------------------------------


# fp8_block: a1 row scales travel through the batched layout; mxfp4: 4-bit weights, bf16 activations
CPU_CASES = [
    ("local+triton", "bf16"),
    ("local+triton", "fp8_block"),
    ("local_batched+triton_batched", "bf16"),
    ("local_batched+triton_batched", "fp8_block"),
    ("local_batched+triton_batched", "mxfp4"),
    ("local+cpu", "bf16"),
]


@pytest.mark.parametrize("path,scheme", CPU_CASES)
def test_preallocated_workspace_gives_the_same_results_and_is_reused(path, scheme):
    config = MoEConfig(num_experts=5, top_k=2, hidden_size=64, intermediate_size=32)
    s = QuantScheme.by_name(scheme)
    prob = make_problem(config, s, 1, seed=1)
    # chunk 8 and a capacity of 8 rows per expert: 13 tokens run as chunks of 8 and 5
    fresh = _kernel(path, config, s, capacity=8, chunk_size=8)
    kept = _kernel(path, config, s, capacity=8, chunk_size=8)
    bufs = kept.allocate(13, "cpu")
    assert set(bufs) == set(kept.workspace(13).shapes)
    for b in bufs.values():
        poison_(b)  # results must not depend on what the buffers held before
    ptrs = {k: b.data_ptr() for k, b in bufs.items()}
    before = {k: b.clone() for k, b in bufs.items()}
    for seed, t in enumerate((13, 3)):
        x, topk = _inputs(config, t, seed, "cpu")
        want = fresh(x, topk, prob.weights)
        got = kept(x, topk, prob.weights)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert {k: b.data_ptr() for k, b in kept.buffers.items()} == ptrs
    # every buffer was written by a call (none is declared and left unused)
    for k, b in bufs.items():
        assert not torch.equal(b.view(torch.uint8), before[k].view(torch.uint8)), k


def test_more_tokens_than_allocated_still_run():
    config = MoEConfig(num_experts=5, top_k=2, hidden_size=64, intermediate_size=32)
    s = QuantScheme.unquantized()
    prob = make_problem(config, s, 12, seed=4)
    kernel = _kernel("local+triton", config, s)
    kernel.allocate(4, "cpu")
    out = kernel(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights)
    assert rel_error(out, prob.reference()) <= tolerance(s, config.dtype)


def test_batched_capacity_overflow_flag():
    config = MoEConfig(num_experts=4, top_k=1, hidden_size=64, intermediate_size=32)
    s = QuantScheme.unquantized()
    prob = make_problem(config, s, 8, seed=0, routing="one_expert")
    disp = LocalBatchedDispatcher(config, s, capacity=4, raise_on_overflow=False)
    kernel = MoEKernel(disp, TritonBatchedExperts(config, s))
    kernel(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights)  # pairs past 4 are left out
    assert int(disp.needed) == 8
    with pytest.raises(FusedMoEError, match="expected at most 4 tokens per expert, got 8"):
        disp.check_capacity()


# ---- GPU: capture once, replay with new inputs ---------------------------------------------

GPU_SHAPES = [  # E, K, H, I, T
    (8, 2, 256, 128, 1),
    (16, 4, 1024, 512, 64),
    (64, 8, 2048, 1024, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "E{}_K{}_H{}_I{}_T{}".format(*s))
@pytest.mark.parametrize("path", PATHS)
def test_cuda_graph_replays_match_eager(path, shape, scheme):
    e, k, h, i, t = shape
    config = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, dtype=torch.bfloat16)
    s = QuantScheme.by_name(scheme)
    prob = make_problem(config, s, 1, seed=0, device="cuda")
    # a token picks an expert at most once, so T rows per expert can never overflow
    kernel = _kernel(path, config, s, capacity=t)
    kernel.allocate(t, "cuda")
    x0, topk0 = _inputs(config, t, 0, "cuda")
    sx, sids, sw = x0.clone(), topk0.ids.clone(), topk0.weights.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the Triton kernels outside the capture
        for _ in range(2):
            kernel(sx, TopK(sids, sw), prob.weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout = kernel(sx, TopK(sids, sw), prob.weights)
    for seed in (1, 2, 3):
        x, topk = _inputs(config, t, seed, "cuda")
        sx.copy_(x)
        sids.copy_(topk.ids)
        sw.copy_(topk.weights)
        graph.replay()
        want = kernel(x, topk, prob.weights)
        torch.cuda.synchronize()
        assert torch.equal(sout, want), f"replay {seed}: max diff {(sout.float() - want.float()).abs().max()}"
        ref = Problem(config, s, x, topk.ids, topk.weights, prob.weights)
        assert rel_error(sout, ref.reference()) <= tolerance(s, config.dtype)
