"""``intercept_launches``: the scoped hook through which tools see grouped-GEMM jit launches.

While a block is active every launch goes to its function (the innermost block's) with the
kernel, the grid and the arguments, and nothing runs unless the function launches; outside,
launches run as usual and the hook list is empty again, also after an exception.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.kernels import launch as launch_mod
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels._grouped_gemm import _grouped_gemm_kernel
from fusedmoe.kernels.align import moe_align_ref
from fusedmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_batched
from fusedmoe.kernels.launch import intercept_launches
from fusedmoe.kernels.launch_config import LaunchConfig
from fusedmoe.quant import Operand
from fusedmoe.testing import poison_, random_topk

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = LaunchConfig(16, 32, 32, 1, 4, 2)
T, E, K, H, N = 5, 3, 2, 48, 40  # E prime, H and N no powers of 2


def _problem():
    g = torch.Generator().manual_seed(0)
    ids, weights = random_topk(T, E, K, g)
    a = Operand.of(torch.randn(T, H, generator=g).to(DEVICE))
    w = Operand.of(torch.randn(E, N, H, generator=g).to(DEVICE))
    return a, w, moe_align_ref(ids.to(DEVICE), E, CFG.block_m), weights.to(DEVICE)


def _gemm(a, w, routing, weights, out):
    return grouped_gemm(a, w, routing, topk_weights=weights, a_div=K, out=out, config=CFG)


def test_an_interceptor_sees_every_launch_and_decides_whether_it_runs():
    a, w, routing, weights = _problem()
    seen = []

    def record(kernel, grid, args, kwargs):
        seen.append((kernel, grid, len(args), kwargs["BLOCK_M"], kwargs["BLOCK_N"]))

    out = poison_(torch.empty(T * K, N, device=DEVICE))
    with intercept_launches(record) as fn:
        assert fn is record
        _gemm(a, w, routing, weights, out)
    assert out.isnan().all()  # recorded, not run
    assert len(seen) == 1 and seen[0][0] is _grouped_gemm_kernel and seen[0][3:] == (16, 32)
    assert seen[0][1] == (routing.block_expert.numel() * 2,)  # M blocks x ceil(N / BN) = 2 N tiles

    def run(kernel, grid, args, kwargs):
        return kernel[grid](*args, **kwargs)

    expected = _gemm(a, w, routing, weights, poison_(torch.empty(T * K, N, device=DEVICE)))
    with intercept_launches(run):
        got = _gemm(a, w, routing, weights, poison_(torch.empty(T * K, N, device=DEVICE)))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_innermost_interceptor_wins_and_each_block_restores_the_one_before():
    a, w, routing, weights = _problem()
    calls = []

    def hook(name):
        return lambda kernel, grid, args, kwargs: calls.append(name)

    out = torch.empty(T * K, N, device=DEVICE)
    with intercept_launches(hook("outer")):
        with intercept_launches(hook("inner")):
            _gemm(a, w, routing, weights, out)
        _gemm(a, w, routing, weights, out)
        with pytest.raises(RuntimeError, match="boom"), intercept_launches(hook("failing")):
            raise RuntimeError("boom")
        _gemm(a, w, routing, weights, out)
    assert calls == ["inner", "outer", "outer"]
    assert launch_mod._INTERCEPTORS == []


def test_batched_launches_are_intercepted_too():
    g = torch.Generator().manual_seed(1)
    a = Operand.of(torch.randn(E, 4, H, generator=g).to(DEVICE))
    w = Operand.of(torch.randn(E, N, H, generator=g).to(DEVICE))
    counts = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    seen = []
    with intercept_launches(lambda kernel, grid, args, kwargs: seen.append(kwargs["BATCHED"])):
        grouped_gemm_batched(a, w, counts, config=CFG)
    assert seen == [True]
