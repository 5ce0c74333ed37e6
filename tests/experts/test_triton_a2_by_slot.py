"""The triton experts with a2 by slot (prefill, unfused GEMM1 and a persistent GEMM2):
``act_and_quantize`` writes a2 in slot order and GEMM2 reads it through a descriptor. The path
is taken where the plan says so (checked), its output equals the by-pair path's bit for bit
and the float64 reference within the scheme's tolerance, with a poisoned workspace, an expert
map and ids outside [0, E); where it cannot run (per-tensor dynamic a2, a plain GEMM2 config,
pair blocks) the plan says no."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.experts import triton as triton_experts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.kernels._common import interpreting
from fusedmoe.metadata import TopK
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem, poison_, rel_error, tolerance

pytestmark = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or a CUDA GPU"
)
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
PERSISTENT = "16,32,128,2,4,2,persistent=1"  # both GEMMs on the persistent kernel (FUSEDMOE_LAUNCH_CONFIG)

# (label, scheme, expert parallel rank or None, ids outside [0, E))
CASES = [
    ("fp8_block", QuantScheme.fp8_block(), None, False),
    ("fp8_per_token", QuantScheme.fp8_per_token(), None, False),
    ("int8_per_token", QuantScheme.int8_w8a8(), None, False),
    ("fp8_block_ep_rank1_of_2", QuantScheme.fp8_block(), 1, False),
    ("fp8_block_ids_outside", QuantScheme.fp8_block(), None, True),
]


def _run(prob, config, scheme, emap, n_local, by_slot: bool):
    experts = TritonExperts(config, scheme)
    experts.fuse_act = False  # GEMM1 plain, a2 by act_and_quantize (what these schemes do at prefill)
    if not by_slot:
        experts._a2_by_slot = lambda *a: False
    t = prob.x.shape[0]
    ws = experts.workspace(t, n_local).allocate(DEVICE)
    for buf in ws.values():
        poison_(buf)  # padding slots' a2 rows are NaN: an output that read them would be NaN
    topk = TopK(prob.topk_ids, prob.topk_weights)
    d = LocalDispatcher(config, scheme).dispatch(prob.x, topk, prob.weights)
    out = poison_(torch.empty(t, config.hidden_size, dtype=config.dtype, device=DEVICE))
    experts.apply(d.a, topk, prob.weights, out, expert_map=emap, workspace=ws)
    plans = list(experts._plans.values())
    return out, plans


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_a2_by_slot_equals_by_pair_and_the_reference(monkeypatch, case):
    label, scheme, rank, outside = case
    monkeypatch.setenv("FUSEDMOE_LAUNCH_CONFIG", PERSISTENT)
    config = MoEConfig(6, 2, 128, 128)
    emap, n_local = None, 6
    if rank is not None:
        par = ParallelConfig(ep_size=2, ep_rank=rank)
        emap, n_local = par.expert_map(6, DEVICE), len(par.local_experts(6))
    prob = make_problem(config, scheme, 19, seed=5, device=DEVICE, expert_map=emap, num_local_experts=n_local)
    if outside:  # such pairs contribute nothing, in the reference too
        prob.topk_ids[0, 0], prob.topk_ids[7, 1] = -1, 6
    out, plans = _run(prob, config, scheme, emap, n_local, by_slot=True)
    assert [p.a2_by_slot for p in plans] == [True], label
    ref_pairs, _ = _run(prob, config, scheme, emap, n_local, by_slot=False)
    assert torch.equal(out, ref_pairs), label
    assert torch.isfinite(out).all(), label
    assert rel_error(out, prob.reference()) <= tolerance(scheme, config.dtype), label


@pytest.mark.parametrize(
    "label, scheme, pinned, tokens, want",
    [
        ("per_tensor_dynamic_a2", QuantScheme.fp8_per_tensor(), PERSISTENT, 19, False),
        ("plain_gemm2_config", QuantScheme.fp8_block(), "16,32,128,2,4,2", 19, False),
        ("pair_blocks_at_t1", QuantScheme.fp8_block(), PERSISTENT, 1, False),
        ("fp8_block_prefill", QuantScheme.fp8_block(), PERSISTENT, 19, True),
    ],
)
def test_plan_takes_a2_by_slot_only_where_it_can(monkeypatch, label, scheme, pinned, tokens, want):
    monkeypatch.setenv("FUSEDMOE_LAUNCH_CONFIG", pinned)
    config = MoEConfig(6, 2, 128, 128)
    prob = make_problem(config, scheme, tokens, seed=2, device=DEVICE)
    _, plans = _run(prob, config, scheme, None, 6, by_slot=True)
    assert [p.a2_by_slot for p in plans] == [want], label


def test_workspace_holds_a2_by_slot_from_the_prefill_rows():
    """From ``_BY_SLOT_ROWS`` pairs an expert the workspace's a2 has the slots of a BM 128
    alignment (so a prefill call allocates nothing); below, the pairs only."""
    config = MoEConfig(4, 2, 128, 128)
    experts = TritonExperts(config, QuantScheme.fp8_block())
    experts.fuse_act = False
    small = experts.workspace(8, 4).shapes["a2"][0][0]
    pairs = 2 * triton_experts._BY_SLOT_ROWS * 4
    big = experts.workspace(pairs // 2, 4).shapes["a2"][0][0]
    assert small == 16
    assert big == -(-(pairs + 4 * 127) // 128) * 128


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", ["128,256,128,8,8,3,persistent=1", "64,128,128,8,4,3,persistent=1"])
@pytest.mark.parametrize("scheme", [QuantScheme.fp8_block(), QuantScheme.fp8_per_token()], ids=lambda s: s.name)
def test_a2_by_slot_real_shapes(monkeypatch, scheme, pinned):
    """Qwen3-30B-A3B's H and I, 32 experts, T = 1024 (64 pairs an expert): by slot equals by pair
    bit for bit and the float32 reference within the tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("FUSEDMOE_LAUNCH_CONFIG", pinned)
    config = MoEConfig(32, 2, 2048, 768)
    prob = make_problem(config, scheme, 1024, seed=9, device="cuda")
    out, plans = _run(prob, config, scheme, None, 32, by_slot=True)
    assert [p.a2_by_slot for p in plans] == [True]
    by_pair, _ = _run(prob, config, scheme, None, 32, by_slot=False)
    assert torch.equal(out, by_pair)
    assert rel_error(out, prob.reference(torch.float32)) <= tolerance(scheme, config.dtype)
