"""The ``triton`` experts with 4-bit weights converted to the w4 layout (``prepare_weights``).

The whole layer (align, GEMM1 with the fused activation, GEMM2, moe_sum) against the float64
reference of the same scheme, from the original (reference-layout) weights, in the regimes whose
plans differ: decode (BM 1, GEMM2 split along K and summed by moe_sum), mid (BM 16-64) and
prefill (GEMM1 and GEMM2 with different BM: the pairs are aligned twice); both token layouts;
and the conversion's exact inverse (``restore_weights``).
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalBatchedDispatcher, LocalDispatcher
from fusedmoe.experts.triton import TritonBatchedExperts, TritonExperts
from fusedmoe.kernels._common import interpreting
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.quant.w4_layout import is_w4
from fusedmoe.testing import make_problem, rel_error, tolerance

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if HAS_CUDA else "cpu"

SCHEMES = ["int4_g128", "int4_g64_zp", "int4_g128_actorder", "mxfp4", "nvfp4_w4a16"]
# (label, T, E, K): decode (0.25 pairs per expert: BM 1 and split-K), mid, prefill (> 160 per expert)
REGIMES = [("decode", 1, 8, 2), ("mid", 24, 4, 2), ("prefill", 336, 4, 2)]


def _config(e: int, k: int) -> MoEConfig:
    return MoEConfig(e, k, 128, 256, dtype=torch.bfloat16)


def _schemes(name: str) -> QuantScheme:
    s = QuantScheme.by_name(name)
    assert s.a1 is None and s.w1 is not None, name
    return s


@pytest.mark.parametrize("regime", REGIMES, ids=[r[0] for r in REGIMES])
@pytest.mark.parametrize("name", SCHEMES)
def test_layer_with_converted_weights(name, regime):
    _, t, e, k = regime
    scheme, config = _schemes(name), _config(e, k)
    prob = make_problem(config, scheme, t, seed=t + e, device=DEVICE)
    experts = TritonExperts(config, scheme)
    w4 = experts.prepare_weights(prob.weights)
    assert is_w4(w4.w13) and is_w4(w4.w2), "4-bit weights with float activations run in the w4 layout"
    kernel = MoEKernel(LocalDispatcher(config, scheme), experts)
    out = kernel(prob.x, TopK(prob.topk_ids, prob.topk_weights), w4)
    ref = prob.reference()
    assert out.isfinite().all()
    assert rel_error(out, ref) <= tolerance(scheme, config.dtype)
    back = experts.restore_weights(w4)
    for a, b in ((back.w13, prob.weights.w13), (back.w2, prob.weights.w2)):
        for key, v in b.tensors().items():
            got = getattr(a, key)
            assert got.dtype == v.dtype and torch.equal(got.view(torch.uint8), v.view(torch.uint8)), key


@pytest.mark.parametrize("name", ["int4_g128", "mxfp4"])
def test_batched_layout_with_converted_weights(name):
    scheme, config = _schemes(name), _config(4, 2)
    prob = make_problem(config, scheme, 9, seed=5, device=DEVICE)
    experts = TritonBatchedExperts(config, scheme)
    w4 = experts.prepare_weights(prob.weights)
    kernel = MoEKernel(LocalBatchedDispatcher(config, scheme), experts)
    out = kernel(prob.x, TopK(prob.topk_ids, prob.topk_weights), w4)
    assert rel_error(out, prob.reference()) <= tolerance(scheme, config.dtype)


def test_plans_are_kept_per_pair_count():
    scheme, config = _schemes("int4_g128"), _config(4, 2)
    prob = make_problem(config, scheme, 4, seed=1, device=DEVICE)
    experts = TritonExperts(config, scheme)
    w4 = experts.prepare_weights(prob.weights)
    a = experts._plan(8, 4, w4.w13, w4.w2)
    assert experts._plan(8, 4, w4.w13, w4.w2) is a  # no config picked twice for one T
    assert experts._plan(512, 4, w4.w13, w4.w2) is not a


def test_other_schemes_keep_the_reference_layout():
    for name in ("bf16", "fp8_block", "mxfp4_mxfp8", "int8_w8a16"):
        scheme, config = QuantScheme.by_name(name), _config(4, 2)
        prob = make_problem(config, scheme, 2, seed=0, device=DEVICE)
        assert TritonExperts(config, scheme).prepare_weights(prob.weights) is prob.weights, name


# ---- prefill with the weights written out in the model dtype (``_dequant_w4``) ------------------


def _count_dequant(monkeypatch) -> list:
    """Calls of ``dequantize_w4`` made by the experts (the path taken, not just planned)."""
    import fusedmoe.experts.triton as mod

    calls = []
    real = mod.dequantize_w4

    def counted(w, dtype, **kw):
        calls.append(tuple(w.shape))
        return real(w, dtype, **kw)

    monkeypatch.setattr(mod, "dequantize_w4", counted)
    return calls


# every scheme in the standard layout; the batched layout with one e2m1 and one act-order scheme
WRITTEN_OUT = [(n, "standard") for n in SCHEMES] + [("mxfp4", "batched"), ("int4_g128_actorder", "batched")]


@pytest.mark.parametrize(("name", "layout"), WRITTEN_OUT, ids=[f"{n}-{lay}" for n, lay in WRITTEN_OUT])
def test_layer_with_weights_written_out(name, layout, monkeypatch):
    """From 4 rows per expert (forced): both GEMMs on dequantized weights, written into the
    workspace's buffer (GEMM2's over GEMM1's), against the float64 reference."""
    scheme, config = _schemes(name), _config(4, 2)
    calls = _count_dequant(monkeypatch)
    prob = make_problem(config, scheme, 24, seed=3, device=DEVICE)
    cls, disp = (
        (TritonExperts, LocalDispatcher) if layout == "standard" else (TritonBatchedExperts, LocalBatchedDispatcher)
    )
    experts = cls(config, scheme)
    experts.w4_dequant = 4
    w4 = experts.prepare_weights(prob.weights)
    kernel = MoEKernel(disp(config, scheme), experts)
    out = kernel(prob.x, TopK(prob.topk_ids, prob.topk_weights), w4)
    assert calls == [tuple(w4.w13.shape), tuple(w4.w2.shape)]
    assert out.isfinite().all()
    assert rel_error(out, prob.reference()) <= tolerance(scheme, config.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the persistent GEMM is GPU-only)")
def test_nvfp4_written_out_keeps_the_global_scale_in_fp32():
    """NVFP4 written out at a prefill shape (Qwen3-30B-A3B's H and I, 8 experts, 512 rows each):
    the bf16 weights without the global scale, which the persistent GEMMs apply to their fp32
    accumulators; within the tolerance of float64, and no further from it than the 4-bit GEMM
    on the same problem (folding the scale into each bf16 weight was 1.35x further, PERF_LOG)."""
    from fusedmoe.kernels.launch import intercept_launches

    config, scheme = MoEConfig(8, 2, 2048, 768, dtype=torch.bfloat16), _schemes("nvfp4_w4a16")
    prob = make_problem(config, scheme, 2048, seed=5, device="cuda")
    ref = prob.reference()
    errs, names = {}, []

    def record(k, grid, args, kwargs):
        names.append(k.fn.__name__)
        k[grid](*args, **kwargs)

    for rows in (0, 1):  # never written out, written out from one row per expert
        experts = TritonExperts(config, scheme)
        experts.w4_dequant = rows
        w4 = experts.prepare_weights(prob.weights)
        kernel = MoEKernel(LocalDispatcher(config, scheme), experts)
        with intercept_launches(record):
            out = kernel(prob.x, TopK(prob.topk_ids, prob.topk_weights), w4)
        errs[rows] = rel_error(out, ref)
    assert "_persistent_gemm_kernel" in names and "_w4_dequant_kernel" in names
    assert errs[1] <= tolerance(scheme, config.dtype)
    assert errs[1] <= 1.1 * errs[0], errs


def test_dequant_rule(monkeypatch):
    """Where a call writes its 4-bit weights out: the forced start, the measured table (GPU row
    before its architecture's), never in deterministic mode or past the buffer bound; the
    workspace holds the buffer only where the largest call may take the path."""
    import fusedmoe.experts.triton as mod
    from fusedmoe.platform import current_platform

    scheme, config = _schemes("mxfp4"), _config(4, 2)
    experts = TritonExperts(config, scheme)
    experts.w4_dequant = 8
    assert experts._dequant_w4(32, 4, "mxfp4") and not experts._dequant_w4(31, 4, "mxfp4")
    # with an expert map (2 of the 4 experts here) the pairs of all 4 arrive: 31 pairs are under 8 an expert
    assert experts._dequant_w4(32, 2, "mxfp4") and not experts._dequant_w4(31, 2, "mxfp4")
    assert "w_deq" in experts.workspace(16, 4).shapes and "w_deq" not in experts.workspace(15, 4).shapes
    assert experts.workspace(16, 4).shapes["w_deq"] == ((4 * 512 * 128,), torch.bfloat16)  # max(2I x H, H x I)
    experts.deterministic = True
    assert not experts._dequant_w4(4096, 4, "mxfp4")
    experts.deterministic = False
    monkeypatch.setattr(mod, "W4_DEQUANT_MAX_BYTES", 4 * 512 * 128 * 2 - 1)
    assert not experts._dequant_w4(4096, 4, "mxfp4")
    monkeypatch.setattr(mod, "W4_DEQUANT_MAX_BYTES", 1 << 30)
    experts.w4_dequant = 0
    assert not experts._dequant_w4(4096, 4, "mxfp4")
    experts.w4_dequant = None  # the measured table
    plat = current_platform()
    table = {(plat.arch, "mxfp4"): 64}
    monkeypatch.setattr("fusedmoe.experts.thresholds.W4_DEQUANT_FROM", table)
    assert experts._dequant_w4(256, 4, "mxfp4") and not experts._dequant_w4(255, 4, "mxfp4")
    assert not experts._dequant_w4(4096, 4, "int4")  # no row for the format: never
    table[(plat.name, "mxfp4")] = None  # the GPU's own row wins, None included
    assert not experts._dequant_w4(4096, 4, "mxfp4")


def test_shipped_dequant_table():
    """Every row names a 4-bit format of the kernel and a count of rows per expert (or None)."""
    from fusedmoe.experts.thresholds import W4_DEQUANT_FROM
    from fusedmoe.quant.w4_layout import W4_FORMATS

    assert W4_DEQUANT_FROM
    for (_, fmt), start in W4_DEQUANT_FROM.items():
        assert fmt in W4_FORMATS.values() and (start is None or start >= 1)


def test_w4_dequant_variable(monkeypatch):
    from fusedmoe import env
    from fusedmoe.errors import FusedMoEError

    scheme, config = _schemes("int4_g128"), _config(4, 2)
    monkeypatch.setenv(env.W4_DEQUANT, "128")
    assert TritonExperts(config, scheme).w4_dequant == 128
    monkeypatch.setenv(env.W4_DEQUANT, "auto")
    assert TritonExperts(config, scheme).w4_dequant is None
    monkeypatch.setenv(env.W4_DEQUANT, "always")
    with pytest.raises(FusedMoEError, match="FUSEDMOE_W4_DEQUANT"):
        TritonExperts(config, scheme)


def test_the_oracle_explains_the_4bit_rule(monkeypatch):
    """``select_experts`` notes the per-call rule of 4-bit weights on the Triton experts: the GPU's
    measured threshold and the path of the given T, or the 4-bit GEMM where none is measured; no
    note for other schemes."""
    from dataclasses import replace

    from fusedmoe import env
    from fusedmoe.oracle import select_experts
    from fusedmoe.platform import Platform

    config = MoEConfig(8, 2, 4096, 14336, dtype=torch.bfloat16)
    h200 = replace(Platform.simulated("sm90"), name="NVIDIA H200")
    notes = select_experts(config, _schemes("mxfp4"), platform=h200, num_tokens=4096).notes
    assert any("from 512 rows per expert (measured on NVIDIA H200)" in n and "1024 rows" in n and "written out" in n
               for n in notes), notes  # fmt: skip
    notes = select_experts(config, _schemes("mxfp4"), platform=h200, num_tokens=1024).notes
    assert any("256 rows per expert at T = 1024: the 4-bit GEMM" in n for n in notes), notes
    notes = select_experts(config, _schemes("int4_g128"), platform=Platform.simulated("sm90")).notes
    assert any("the 4-bit GEMM at every size (no threshold measured for int4" in n for n in notes), notes
    monkeypatch.setenv(env.W4_DEQUANT, "64")
    notes = select_experts(config, _schemes("nvfp4_w4a16"), platform=Platform.simulated("sm90"), num_tokens=256).notes
    assert any("from 64 rows per expert (FUSEDMOE_W4_DEQUANT); 64 rows per expert at T = 256: written out" in n
               for n in notes), notes  # fmt: skip
    notes = select_experts(config, QuantScheme.by_name("bf16"), platform=h200, num_tokens=4096).notes
    assert not any("4-bit" in n for n in notes)
