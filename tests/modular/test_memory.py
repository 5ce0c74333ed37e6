"""Chunking bounds the workspace: its peak stops growing with T beyond ``chunk_size``.

On the CPU the declared workspace (``MoEKernel.workspace(T).nbytes()``, what one chunk
allocates) is compared across T; on a GPU the measured peak of
``torch.cuda.max_memory_allocated`` over a call, less its output, for T from 4096 to
65536 at chunk size 8192 (H 2048, E 64, K 8: the workspace of one chunk is ~0.7 GB).
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalBatchedDispatcher, LocalDispatcher
from fusedmoe.experts.cpu import CpuExperts
from fusedmoe.experts.triton import TritonBatchedExperts, TritonExperts
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem, random_topk

CHUNK = 8192
TOKENS = (1, 1024, 4096, 8192, 16384, 32768, 65536)
CONFIG = MoEConfig(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=1024, dtype=torch.bfloat16)


def _kernel(path: str, scheme: QuantScheme, capacity: int | None = None) -> MoEKernel:
    if path == "local+triton":
        return MoEKernel(LocalDispatcher(CONFIG, scheme), TritonExperts(CONFIG, scheme), chunk_size=CHUNK)
    if path == "local+cpu":
        return MoEKernel(LocalDispatcher(CONFIG, scheme), CpuExperts(CONFIG, scheme), chunk_size=CHUNK)
    disp = LocalBatchedDispatcher(CONFIG, scheme, capacity=capacity)
    return MoEKernel(disp, TritonBatchedExperts(CONFIG, scheme), chunk_size=CHUNK)


@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("path", ["local+triton", "local_batched+triton_batched", "local+cpu"])
def test_declared_workspace_is_flat_beyond_the_chunk_size(path, scheme):
    kernel = _kernel(path, QuantScheme.by_name(scheme))
    sizes = {t: kernel.workspace(t).nbytes() for t in TOKENS}
    print(path, scheme, {t: f"{b / 2**20:.1f} MiB" for t, b in sizes.items()})
    small = [sizes[t] for t in TOKENS if t <= CHUNK]
    if path == "local+cpu":
        # the cpu experts declare nothing and write the layer's output directly (no copy, no buffer)
        assert set(sizes.values()) == {0}
        return
    assert small == sorted(small) and small[0] < small[-1], "the workspace should grow with T up to a chunk"
    assert all(sizes[t] == sizes[CHUNK] for t in TOKENS if t >= CHUNK)


def test_declared_workspace_of_triton_adds_up():
    # one chunk of standard triton bf16: a2 [TK, I] + y [TK, H], and h [TK, 2I] only when the
    # activation is not fused into GEMM1; the experts sum into the layer's output itself
    kernel = _kernel("local+triton", QuantScheme.unquantized())
    tk, i, h = CHUNK * CONFIG.top_k, CONFIG.intermediate_size, CONFIG.hidden_size
    assert kernel.workspace(10**6).nbytes() == 2 * (tk * i + tk * h)
    kernel.experts.fuse_act = False
    assert kernel.workspace(10**6).nbytes() == 2 * (tk * 2 * i + tk * i + tk * h)


def test_fixed_capacity_workspace_does_not_depend_on_t():
    kernel = _kernel("local_batched+triton_batched", QuantScheme.by_name("fp8_block"), capacity=256)
    assert len({kernel.workspace(t).nbytes() for t in TOKENS}) == 1


def test_allocate_creates_what_is_declared():
    kernel = _kernel("local_batched+triton_batched", QuantScheme.by_name("nvfp4"), capacity=4)
    bufs = kernel.allocate(8, "cpu")
    assert sum(b.numel() * b.element_size() for b in bufs.values()) == kernel.workspace(8).nbytes()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["local+triton", "local_batched+triton_batched"])
def test_measured_peak_is_flat_beyond_the_chunk_size(path):
    s = QuantScheme.unquantized()
    # batched without a capacity: M follows each chunk's largest expert count (~1100 rows here),
    # where a fixed capacity would make the workspace constant in T
    kernel = _kernel(path, s)
    weights = make_problem(CONFIG, s, 1, seed=0, device="cuda").weights
    g = torch.Generator(device="cuda").manual_seed(0)
    peaks = {}
    for t in (4096, 8192, 16384, 32768, 65536):
        x = torch.randn(t, CONFIG.hidden_size, device="cuda", dtype=CONFIG.dtype)
        ids, w = random_topk(t, CONFIG.num_experts, CONFIG.top_k, g)
        kernel(x[:16], TopK(ids[:16], w[:16]), weights)  # compile the kernels before measuring
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = kernel(x, TopK(ids, w), weights)
        torch.cuda.synchronize()
        peaks[t] = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
        print(f"MEMORY {path} T={t}: peak {peaks[t] / 2**20:.1f} MiB beyond inputs and output")
        del x, out
    for t, p in peaks.items():
        if t > CHUNK:
            assert p <= peaks[CHUNK] * 1.05 + 2**20, f"T={t}: {p / 2**20:.1f} MiB vs {peaks[CHUNK] / 2**20:.1f}"
    assert peaks[4096] < peaks[CHUNK]
