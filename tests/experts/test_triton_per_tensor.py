"""The triton experts with a per-tensor dynamic a2 scale: the rows of h that GEMM1 does not write
(pairs of experts held elsewhere, ids outside [0, E)) must not reach the abs-max. With the
activation in GEMM1 the abs-max is raised by GEMM1's own stores (``ActEpilogue.track_amax``);
unfused (``act_and_quantize``), the rows are zero-filled (small h) or skipped by a row mask (large
h: ``_MASK_OVER_FILL_BYTES``), both forced here."""

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
# (label, expert parallel rank or None, routing): every way a pair's h row goes unwritten
CASES = [
    ("all_local", None, "random"),
    ("ep_rank1_of_3", 1, "random"),
    ("ids_outside_range", None, "outside"),
]


@pytest.mark.parametrize("fuse_act", [True, False], ids=["act_in_gemm1", "act_and_quantize"])
@pytest.mark.parametrize("rows_skipped_by", ["mask", "fill"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_unwritten_h_rows_do_not_reach_the_scale(monkeypatch, case, rows_skipped_by, fuse_act):
    label, rank, routing = case
    # the mask at every size, or the fill at every size
    monkeypatch.setattr(triton_experts, "_MASK_OVER_FILL_BYTES", 0 if rows_skipped_by == "mask" else 1 << 62)
    config, scheme = MoEConfig(7, 3, 64, 32), QuantScheme.fp8_per_tensor()
    emap, n_local = None, 7
    if rank is not None:
        par = ParallelConfig(ep_size=3, ep_rank=rank)
        emap, n_local = par.expert_map(7, DEVICE), len(par.local_experts(7))
    prob = make_problem(config, scheme, 13, seed=11, device=DEVICE, expert_map=emap, num_local_experts=n_local)
    if routing == "outside":  # ids outside [0, E) contribute nothing, in the reference too
        prob.topk_ids[0, 0], prob.topk_ids[3, 1], prob.topk_ids[12, 2] = -1, 7, 1 << 20
    experts = TritonExperts(config, scheme)
    experts.fuse_act = fuse_act
    ws = experts.workspace(13, n_local).allocate(DEVICE)
    for buf in ws.values():
        poison_(buf)  # h's unwritten rows are NaN: an abs-max that read them would be NaN
    topk = TopK(prob.topk_ids, prob.topk_weights)
    d = LocalDispatcher(config, scheme).dispatch(prob.x, topk, prob.weights)
    out = poison_(torch.empty(13, 64, dtype=config.dtype, device=DEVICE))
    experts.apply(d.a, topk, prob.weights, out, expert_map=emap, workspace=ws)
    assert torch.isfinite(out).all(), label
    assert rel_error(out, prob.reference()) <= tolerance(scheme, config.dtype), label


@pytest.mark.parametrize(
    "cfg, pieces",
    [
        pytest.param(dict(block_m=128, block_n=128, persistent=True), 2, id="persistent-128x128-split"),
        pytest.param(dict(block_m=128, block_n=64, persistent=True), 1, id="persistent-128x64-kept"),
        pytest.param(dict(block_m=64, block_n=128, persistent=True), 1, id="persistent-64x128-kept"),
        pytest.param(dict(block_m=128, block_n=128, persistent=False), 1, id="plain-kernel-kept"),
    ],
)
def test_amax_epilogue_pieces(cfg, pieces):
    """GEMM1 raising the abs-max takes the persistent epilogue of a 128 x >= 128 tile in two
    pieces (``_amax_subtile``: the tables were tuned without the abs-max's registers)."""
    from fusedmoe.kernels.launch_config import LaunchConfig

    base = LaunchConfig(cfg["block_m"], cfg["block_n"], 128, 8, 8, 3, persistent=cfg["persistent"])
    assert triton_experts._amax_subtile(base).epilogue_subtile == pieces
