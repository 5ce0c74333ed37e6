"""Deterministic mode: a token's output is bitwise the same alone, in any batch, and run to run.

What makes it so (``experts.triton``): launch configs chosen without the token count, no
atomic adds, the sum over top-k in k order, the batched combine summed in k order too; on the
CPU (``experts.cpu``), GEMMs over fixed 16-row tiles.
Tokens still meet through a per-tensor *dynamic* activation scale (an amax over the
batch), so those schemes are left out of the batch-invariance cases on purpose.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import fusedmoe.kernels
from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalBatchedDispatcher, LocalDispatcher
from fusedmoe.env import DETERMINISTIC as DETERMINISTIC_ENV
from fusedmoe.experts.cpu import CpuExperts, LoopExperts
from fusedmoe.experts.triton import TritonBatchedExperts, TritonExperts
from fusedmoe.kernels.launch_config import default_launch_config, pick_launch_config
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem


def _kernel(path: str, config: MoEConfig, scheme: QuantScheme, **kw) -> MoEKernel:
    if path == "local+triton":
        return MoEKernel(LocalDispatcher(config, scheme), TritonExperts(config, scheme), **kw)
    if path == "local+cpu":
        return MoEKernel(LocalDispatcher(config, scheme), CpuExperts(config, scheme), **kw)
    if path == "local+loop":
        return MoEKernel(LocalDispatcher(config, scheme), LoopExperts(config, scheme), **kw)
    return MoEKernel(LocalBatchedDispatcher(config, scheme), TritonBatchedExperts(config, scheme), **kw)


def _check_batch_invariance(kernel: MoEKernel, prob, batches: list[slice]) -> None:
    """Each batch's rows equal the same rows of the largest batch (the first), bitwise; the
    largest batch twice gives the same bits."""

    def run(rows: slice) -> torch.Tensor:
        return kernel(prob.x[rows], TopK(prob.topk_ids[rows], prob.topk_weights[rows]), prob.weights)

    full = run(batches[0])
    assert torch.equal(run(batches[0]), full), "two runs differ"
    for rows in batches[1:]:
        got = run(rows)
        want = full[rows]
        diff = (got.float() - want.float()).abs().max().item()
        assert torch.equal(got, want), f"tokens {rows.start}:{rows.stop} differ from the batch of 33 by {diff}"


# E 6 and K 4: 33 tokens give 22 rows per expert, which the heuristic would tile with BM 32,
# and one token BM 16; deterministic mode uses one config for both.
CPU_CASES = [
    ("local+triton", "bf16", torch.bfloat16),
    ("local+triton", "fp8_block", torch.bfloat16),
    ("local+triton", "int8_w8a8_channel", torch.float32),
    ("local_batched+triton_batched", "fp8_block", torch.bfloat16),
    ("local+cpu", "bf16", torch.bfloat16),
    ("local+cpu", "fp8_block", torch.bfloat16),
    # fp32 on the CPU is MKL sgemm, whose result for a row changes with the number of rows in the
    # call (1 row vs 2+: 5e-7): deterministic mode runs the cpu backend's GEMMs over fixed 16-row tiles
    ("local+cpu", "bf16", torch.float32),
    ("local+cpu", "int8_w8a8_channel", torch.float32),
    ("local+loop", "bf16", torch.float32),
]


@pytest.mark.parametrize("path,scheme,dtype", CPU_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_token_output_does_not_depend_on_its_batch(path, scheme, dtype):
    config = MoEConfig(num_experts=6, top_k=4, hidden_size=64, intermediate_size=32, dtype=dtype)
    s = QuantScheme.by_name(scheme)
    prob = make_problem(config, s, 33, seed=5)
    kernel = _kernel(path, config, s, deterministic=True)
    _check_batch_invariance(kernel, prob, [slice(0, 33), slice(10, 17), slice(12, 13)])


def test_launch_config_does_not_depend_on_the_token_count():
    args = (64, 1536, 2048, "fp8_block")
    picked = {pick_launch_config(m, *args, deterministic=True) for m in (1, 7, 33, 8 * 4096, 10**6)}
    assert len(picked) == 1
    # without the flag the heuristic does follow T (what deterministic mode must avoid)
    assert len({default_launch_config(m, *args) for m in (1, 8 * 4096)}) == 2


def test_env_var_and_argument(monkeypatch):
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    s = QuantScheme.unquantized()
    assert not TritonExperts(config, s).deterministic and not CpuExperts(config, s).deterministic
    assert not _kernel("local+triton", config, s).deterministic
    monkeypatch.setenv(DETERMINISTIC_ENV, "1")
    experts = TritonExperts(config, s)
    assert experts.deterministic and CpuExperts(config, s).deterministic
    assert _kernel("local+triton", config, s).deterministic
    assert MoEKernel(LocalDispatcher(config, s), experts).deterministic
    off = MoEKernel(LocalDispatcher(config, s), experts, deterministic=False)
    assert not off.deterministic and not experts.deterministic


def test_kernels_reduce_without_atomic_adds():
    # an atomic add (or a split-K reduction through one) sums in arrival order: forbidden.
    # atomic_max is order-free and may stay.
    root = pathlib.Path(fusedmoe.kernels.__file__).parent
    found = {
        p.name: re.findall(r"tl\.atomic_\w+", p.read_text()) for p in root.glob("*.py") if "tl.atomic_" in p.read_text()
    }
    assert all(set(ops) <= {"tl.atomic_max"} for ops in found.values()), found


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("path", ["local+triton", "local_batched+triton_batched"])
def test_token_output_does_not_depend_on_its_batch_gpu(path, scheme):
    config = MoEConfig(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=1024, dtype=torch.bfloat16)
    s = QuantScheme.by_name(scheme)
    prob = make_problem(config, s, 4096, seed=5, device="cuda")
    kernel = _kernel(path, config, s, deterministic=True)
    # 4096 tokens are 512 rows per expert (the heuristic's BM 128), 1 token is BM 16
    batches = [slice(0, 4096), slice(100, 133), slice(200, 207), slice(300, 301), slice(1000, 3048)]
    _check_batch_invariance(kernel, prob, batches)
