"""The fp8-block scheme's a2 (fp8 codes with dynamic 1 x 128 scales) quantized in GEMM1's epilogue:
the persistent kernel does it at prefill configs; where it declines the call (BN halved for the
activation no longer holds whole groups) or the config is not persistent, GEMM1 writes h and
act_and_quantize follows. Both against the float64 reference, with unwritten rows poisoned."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.activations import Activation
from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.experts import triton as triton_experts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.launch_config import LaunchConfig, override_launch_config
from fusedmoe.metadata import TopK
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem, poison_, rel_error, tolerance

pytestmark = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or a CUDA GPU"
)
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
# (label, launch config, whether GEMM1's epilogue quantizes a2); BM 16 keeps the interpreter quick
CONFIGS = [
    ("persistent_bn256", "16,256,128,2,4,2,persistent=1", True),  # BN 128 once halved: whole groups
    ("persistent_bn128", "16,128,128,2,4,2,persistent=1", False),  # BN 64 once halved: declined
    ("plain", "16,128,128,2,4,2", False),
]
ACTS = [(Activation.SILU, False), (Activation.SWIGLUOAI, True)]


@pytest.mark.parametrize("rank", [None, 1], ids=["all_local", "ep_rank1_of_2"])
@pytest.mark.parametrize("act,interleaved", ACTS, ids=["silu", "swigluoai_il"])
@pytest.mark.parametrize("case", CONFIGS, ids=lambda c: c[0])
def test_group_quant_in_gemm1_epilogue(monkeypatch, case, act, interleaved, rank):
    label, text, in_epilogue = case
    config = MoEConfig(6, 2, 128, 256, activation=act, gate_up_interleaved=interleaved, has_bias=interleaved)
    scheme = QuantScheme.fp8_block()
    emap, n_local = None, 6
    if rank is not None:
        par = ParallelConfig(ep_size=2, ep_rank=rank)
        emap, n_local = par.expert_map(6, DEVICE), len(par.local_experts(6))
    prob = make_problem(config, scheme, 9, seed=3, device=DEVICE, expert_map=emap, num_local_experts=n_local)
    calls = []
    real = triton_experts.act_and_quantize
    monkeypatch.setattr(triton_experts, "act_and_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    experts = TritonExperts(config, scheme)
    ws = experts.workspace(9, n_local).allocate(DEVICE)
    for buf in ws.values():
        poison_(buf)
    topk = TopK(prob.topk_ids, prob.topk_weights)
    d = LocalDispatcher(config, scheme).dispatch(prob.x, topk, prob.weights)
    out = poison_(torch.empty(9, 128, dtype=config.dtype, device=DEVICE))
    with override_launch_config(LaunchConfig.parse(text)):
        experts.apply(d.a, topk, prob.weights, out, expert_map=emap, workspace=ws)
    assert bool(calls) != in_epilogue, f"{label}: act_and_quantize called {len(calls)} times"
    assert torch.isfinite(out).all(), label
    assert rel_error(out, prob.reference()) <= tolerance(scheme, config.dtype), label


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [256, 2048])
def test_group_quant_in_epilogue_real_shapes(monkeypatch, t):
    """A prefill config the H100 tables hold for fp8 blocks (64 x 256 x 128, persistent) at a
    Mixtral-like width: the epilogue path runs and matches the reference."""
    config, scheme = MoEConfig(8, 2, 2048, 1024), QuantScheme.fp8_block()
    prob = make_problem(config, scheme, t, seed=t, device="cuda")
    calls = []
    real = triton_experts.act_and_quantize
    monkeypatch.setattr(triton_experts, "act_and_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    experts = TritonExperts(config, scheme)
    topk = TopK(prob.topk_ids, prob.topk_weights)
    d = LocalDispatcher(config, scheme).dispatch(prob.x, topk, prob.weights)
    out = poison_(torch.empty(t, 2048, dtype=config.dtype, device="cuda"))
    with override_launch_config(LaunchConfig.parse("64,256,128,8,8,4,persistent=1")):
        experts.apply(d.a, topk, prob.weights, out)
    torch.cuda.synchronize()
    err = rel_error(out, prob.reference(torch.float32))
    print(f"MAXERR triton fp8_block group epilogue T={t}: {err:.2e}")
    assert not calls and err <= tolerance(scheme, config.dtype)
