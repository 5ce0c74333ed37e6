"""Pair blocks (``kernels.align.pair_blocks``): the grouped GEMM without ``moe_align``.

One GEMM block per (token, k) pair, in pair order, its expert read from the pair's own id.
Checked, on fresh random operands with NaN-poisoned outputs:

* the kernels (the plain grouped GEMM, the FMA path at BM 1 and the dot path at BM 16, and
  the 4-bit kernel on converted weights) against the float64 reference of the same routing,
  and against the same GEMM over ``moe_align``'s blocks: the rows of local pairs bit for
  bit (each row meets the same tiles and K order), every other row untouched;
* ids outside [0, E) (-1, E, E + 5; int64 2^32 + 1) and a repeated id: such pairs are
  skipped, as ``moe_align`` leaves them out, and no block reads past the weights; int64 ids
  and bf16 router weights are read as given (both routings);
* the layer (``MoEKernel``) at T = 1, where it takes pair blocks, and at T = 4 over 64 experts
  with an expert every token shares: equal to the same call with them off
  (``pair_blocks_tokens = 0``), and to the float64 reference; the rule of when it takes them.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_gemm import DEVICE, _tol, check, make_operands, needs_triton

from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.kernels.align import moe_align_ref, pair_blocks
from fusedmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_ref
from fusedmoe.kernels.launch_config import LaunchConfig
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import Operand, QuantScheme
from fusedmoe.quant.w4_layout import to_w4
from fusedmoe.testing import make_problem, poison_, rel_error, tolerance

E, N, KD = 6, 40, 128


def _cfg(bm: int) -> LaunchConfig:
    return LaunchConfig(block_m=bm, block_n=32, block_k=64, group_m=4, num_warps=4, num_stages=2)


def _ids(t: int, k: int, bad: bool, gen: torch.Generator, dtype=torch.int32) -> torch.Tensor:
    """[T, K] random distinct ids per row; ``bad``: -1, E and E + 5 (int64: 2^32 + 1, which a cast
    to int32 would make expert 1) in places, and one id twice."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)]).to(dtype)
    if bad:
        flat = ids.reshape(-1)
        flat[0], flat[-1] = -1, E if dtype == torch.int32 else 2**32 + 1
        if flat.numel() > 3:
            flat[1], flat[2] = E + 5, flat[3]  # out of range, and a repeat of another pair's expert
    return ids.to(DEVICE)


# (scheme, BM, 4-bit kernel): the plain kernel on both paths, a w8a8 dot, and the 4-bit kernel
CASES = [
    ("bf16", 1, False),
    ("bf16", 16, False),
    ("fp8_block", 1, False),
    ("int8_w8a8_channel", 16, False),
    ("int4_g64_zp", 1, True),
    ("mxfp4", 16, True),
]


@needs_triton
@pytest.mark.parametrize("ids", ["valid", "bad", "bad_int64"])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("scheme,bm,w4", CASES, ids=[f"{s}-BM{b}{'-w4' if w else ''}" for s, b, w in CASES])
def test_pair_blocks_gemm(scheme, bm, w4, t, ids):
    # int64 ids and bf16 router weights (transformers' routers) are read as given
    k = 2
    gen = torch.Generator().manual_seed(t * 10 + bm)
    sch = QuantScheme.by_name(scheme)
    wide = ids == "bad_int64"
    ids = _ids(t, k, ids != "valid", gen, torch.int64 if wide else torch.int32)
    tw = torch.rand(t, k, generator=gen).to(torch.bfloat16 if wide else torch.float32).to(DEVICE)
    ops = make_operands(sch, t, E, N, KD, gen)
    w = Operand(to_w4(ops.w.q, sch.w1), sch.w1) if w4 else ops.w
    outs = []
    for routing in (pair_blocks(ids, bm), moe_align_ref(ids, E, bm)):
        out = poison_(torch.empty(t * k, N, dtype=torch.float32, device=DEVICE))
        grouped_gemm(ops.a, w, routing, topk_weights=tw, a_div=k, out=out, config=_cfg(bm))
        outs.append(out)
    ref = grouped_gemm_ref(ops.a, ops.w, pair_blocks(ids, bm), topk_weights=tw, a_div=k)
    check(outs[0], ref, _tol(sch, torch.float32))
    local = ((ids >= 0) & (ids < E)).reshape(-1)
    assert torch.equal(~ref.isnan().all(dim=1), local), "the reference's rows are not the local pairs"
    assert torch.equal(outs[0][local], outs[1][local]), "pair blocks differ from moe_align's blocks"


def _layer_case(scheme: str, config: MoEConfig, monkeypatch, t: int = 1, routing: str = "random") -> None:
    monkeypatch.setenv("FUSEDMOE_LAUNCH_PLANS", "0")  # the plain path each call
    sch = QuantScheme.by_name(scheme)
    experts = TritonExperts(config, sch)
    kernel = MoEKernel(LocalDispatcher(config, sch), experts)
    problem = make_problem(config, sch, t, seed=3, device=DEVICE, routing=routing)
    weights = kernel.prepared(problem.weights)
    topk = TopK(problem.topk_ids, problem.topk_weights)
    aligned = []
    monkeypatch.setattr(
        "fusedmoe.experts.triton.moe_align", lambda *a, **kw: aligned.append(1) or moe_align_ref(*a, **kw)
    )
    by_pair = kernel(problem.x, topk, weights)
    assert not aligned, f"T = {t} ran moe_align"
    experts.pair_blocks_tokens = 0
    sorted_ = kernel(problem.x, topk, weights)
    assert aligned, "pair_blocks_tokens = 0 did not align"
    assert torch.equal(by_pair, sorted_)
    err = rel_error(by_pair, problem.reference())
    assert err <= tolerance(sch, config.dtype), f"rel error {err:.2e}"


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "int4_g128", "mxfp4"])
def test_layer_at_t1_takes_pair_blocks(scheme, monkeypatch):
    _layer_case(scheme, MoEConfig(num_experts=8, top_k=4, hidden_size=128, intermediate_size=128), monkeypatch)


def test_pair_blocks_beyond_one_token_where_pairs_are_few():
    """T = 1 always; beyond, up to 16 pairs that are at most 1/8 of the experts; a limit overrides."""
    rule = TritonExperts.pair_blocked
    assert rule(1, 2, 8) and not rule(2, 2, 8)  # Mixtral: T = 1 only
    assert rule(2, 8, 128) and not rule(3, 8, 128)  # Qwen3-30B-A3B: 16 pairs of 128 experts
    assert rule(2, 8, 256) and not rule(3, 8, 256) and not rule(4, 8, 256)  # DeepSeek-V3: not 32 pairs
    assert rule(1, 8, 16) and not rule(2, 4, 32)  # gpt-oss-20b: 8 pairs of 32 experts are too many
    assert rule(3, 8, 8, limit=3) and not rule(1, 8, 256, limit=0)


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor"])
def test_layer_pair_blocks_with_a_shared_expert(scheme, monkeypatch):
    """T = 4, K = 2 over 64 experts: pair blocks, with every token's first pair on expert 0 (four
    blocks of one expert); the same bits as aligned blocks, the reference within tolerance."""
    config = MoEConfig(num_experts=64, top_k=2, hidden_size=128, intermediate_size=128)
    _layer_case(scheme, config, monkeypatch, t=4, routing="one_expert")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor", "fp8_block", "int8_w8a8_channel", "int4_g128", "mxfp4"])
def test_layer_at_t1_takes_pair_blocks_gpu(scheme, monkeypatch):
    # Qwen3-30B-A3B's shape, its launch configs (the decode tiles and the 4-bit kernel's)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _layer_case(scheme, MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768), monkeypatch)
