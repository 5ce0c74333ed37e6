"""``kernels.w4_dequant``: 4-bit weights in the w4 layout written out in the model dtype.

Against ``dequantize_w4_ref`` (float64 from the reference layout, rounded once), output
poisoned with NaN first: MXFP4 values are exact in bf16 (e2m1 times a power of two), so bit
equality; int4 and NVFP4 take one rounding, which the kernel may make from an fp32 value (int4's
scale product, NVFP4's global scale), so at most one unit in the last place. Every 4-bit scheme
of the w4 GEMM's tests, K padded to the pack block and not, odd N; on a GPU also at a real
expert's shape and through the PTX unpack (fp16 with int4)."""

from __future__ import annotations

import pytest
import torch
from test_kernels_gemm import DEVICE, needs_cuda, needs_triton
from test_kernels_gemm_w4 import SCHEMES, _quantized

from fusedmoe.errors import FusedMoEError
from fusedmoe.kernels.w4_dequant import dequantize_w4, dequantize_w4_ref
from fusedmoe.quant.w4_layout import to_w4
from fusedmoe.testing import poison_

pytestmark = needs_triton


def _check(w4, tq, dtype, exact: bool, global_scale: bool = True) -> None:
    e, n, k = w4.shape
    out = poison_(torch.empty(e, n, k, dtype=dtype, device=w4.data.device))
    got = dequantize_w4(w4, dtype, out=out, global_scale=global_scale)
    assert got.data_ptr() == out.data_ptr()
    ref = dequantize_w4_ref(w4, tq, dtype, global_scale).to(got.device)
    assert bool(torch.isfinite(got).all()), "unwritten (NaN) or non-finite values"
    if exact:
        assert torch.equal(got, ref)
        return
    ulp = torch.finfo(dtype).eps  # one unit in the last place, relative to the value's binade
    diff = (got.double() - ref.double()).abs()
    bound = ref.double().abs() * ulp + torch.finfo(dtype).tiny
    assert bool((diff <= bound).all()), f"max diff {diff.max().item():.3g} ({int((diff > bound).sum())} values)"


CASES = {  # label: (scheme, E, N, K, dtype)
    "int4_g32 K padded": ("int4_g32", 2, 37, 96, torch.bfloat16),
    "int4_g64": ("int4_g64", 2, 40, 128, torch.bfloat16),
    "int4_g128 fp16": ("int4_g128", 2, 33, 256, torch.float16),
    "int4_g64 zero points, K padded": ("int4_g64_zp", 2, 20, 192, torch.bfloat16),
    "int4_g16 zero points (halves of two groups)": ("int4_g16_zp", 1, 24, 96, torch.bfloat16),
    "int4_g32 act-order, K padded": ("int4_g32_actorder", 2, 18, 160, torch.bfloat16),
    "mxfp4 K padded": ("mxfp4", 2, 37, 96, torch.bfloat16),
    "mxfp4 fp32": ("mxfp4", 1, 16, 64, torch.float32),
    "nvfp4 (global scale)": ("nvfp4", 2, 30, 96, torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dequantize_w4_matches_reference(case):
    scheme, e, n, k, dtype = CASES[case]
    tq = SCHEMES[scheme].w1
    w4 = to_w4(_quantized(SCHEMES[scheme], e, n, k, seed=len(case)), tq).to(DEVICE)
    _check(w4, tq, dtype, exact=scheme == "mxfp4")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4", "int4_g128", "int4_g32_actorder", "int4_g64_zp"])
def test_dequantize_w4_real_shape_gpu(scheme):
    """gpt-oss-20b's W2 (2880 x 2880: K padded to the pack block) and Qwen3-30B-A3B's W13 shape,
    through the PTX unpack (bf16)."""
    tq = SCHEMES[scheme].w1
    for e, n, k in ((4, 2880, 2880 if tq.granularity.group_size <= 64 else 2944), (8, 1536, 2048)):
        w4 = to_w4(_quantized(SCHEMES[scheme], e, n, k, seed=k, device="cuda"), tq)
        _check(w4, tq, torch.bfloat16, exact=scheme == "mxfp4")


def test_nvfp4_without_its_global_scale_is_exact():
    """``global_scale=False``: e2m1 times the e4m3 block scale, exact in bf16 (what the written-out
    path's GEMMs take, the global scale going to their accumulators); folded, each value is that
    times the global scale, rounded once. Mutation-checked: folding it anyway fails the first."""
    tq = SCHEMES["nvfp4"].w1
    w4 = to_w4(_quantized(SCHEMES["nvfp4"], 2, 30, 96, seed=7), tq).to(DEVICE)
    _check(w4, tq, torch.bfloat16, exact=True, global_scale=False)
    bare = dequantize_w4(w4, torch.bfloat16, global_scale=False).double()
    folded = dequantize_w4(w4, torch.bfloat16).double()
    gs = w4.global_scale.reshape(-1, 1, 1).double().to(bare.device)
    assert torch.equal(folded, (bare * gs).to(torch.bfloat16).double())


def test_dequantize_w4_bad_input_is_named():
    tq = SCHEMES["mxfp4"].w1
    q = _quantized(SCHEMES["mxfp4"], 1, 8, 64, device=DEVICE)
    with pytest.raises(FusedMoEError, match="^w: "):
        dequantize_w4(q, torch.bfloat16)  # the reference layout
    w4 = to_w4(q, tq)
    with pytest.raises(FusedMoEError, match="^dtype: "):
        dequantize_w4(w4, torch.int8)
    with pytest.raises(FusedMoEError, match="^out: "):
        dequantize_w4(w4, torch.bfloat16, out=torch.empty(1, 8, 32, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(FusedMoEError, match="^out: "):
        dequantize_w4(w4, torch.bfloat16, out=torch.empty(1, 8, 64, dtype=torch.float16, device=DEVICE))
