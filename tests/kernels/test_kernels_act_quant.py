"""Activation quantization kernels against ``fusedmoe.quant.quantize`` / ``apply_activation``.

Plain quantization must give the reference's bytes exactly: the kernels repeat the
reference's fp32 operations, and under the interpreter encode e4m3/bf16 by hand
(its own casts truncate), so this holds on both; the real-shape twins marked ``gpu``
check the hardware conversions. The fused activation differs from PyTorch's by an
ulp of fp32 here and there, which can move a value across a rounding boundary, so
there the dequantized values are compared with a tolerance. Outputs are poisoned
before each launch.

moe_sum is tested here too (a small kernel of the same pipeline stage).
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import Activation, MoEConfig
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.act_quant import (
    act_and_quantize,
    act_and_quantize_ref,
    quantize_activations,
    quantize_activations_ref,
)
from fusedmoe.kernels.moe_sum import moe_sum, moe_sum_ref
from fusedmoe.quant import Granularity, QDtype, QTensor, QuantScheme, TensorQuant, dequantize
from fusedmoe.quant.fp4 import nvfp4_global_scale
from fusedmoe.testing import poison_, rel_error

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _tq(dtype: QDtype, gran: Granularity, dynamic: bool = True) -> TensorQuant:
    return TensorQuant(dtype, gran, dynamic=dynamic)


QUANTS = {
    "fp8_tensor": _tq(QDtype.FP8, Granularity.tensor()),
    "fp8_tensor_static": _tq(QDtype.FP8, Granularity.tensor(), dynamic=False),
    "fp8_token": _tq(QDtype.FP8, Granularity.token()),
    "fp8_group128": _tq(QDtype.FP8, Granularity.group(128)),
    "fp8_group32": _tq(QDtype.FP8, Granularity.group(32)),
    "int8_tensor": _tq(QDtype.INT8, Granularity.tensor()),
    "int8_tensor_static": _tq(QDtype.INT8, Granularity.tensor(), dynamic=False),
    "int8_token": _tq(QDtype.INT8, Granularity.token()),
    "int8_group64": _tq(QDtype.INT8, Granularity.group(64)),
    "mxfp8": QuantScheme.mxfp4_mxfp8().a1,
    "nvfp4": QuantScheme.nvfp4().a1,
}
# K = 96: a partial last fp8/int8 group (64, 128) and two MX/NV groups per tile.
SHAPES = {"T0": (0, 128), "T1": (1, 128), "rows37": (37, 96), "rows5_k256": (5, 256)}


def _static(name: str, x: torch.Tensor) -> dict:
    """Static scales a checkpoint would carry (calibrated on a bound of |x|)."""
    amax = 4.0 * 3
    if name.endswith("_static"):
        qmax = 448.0 if name.startswith("fp8") else 127.0
        return {"scale": torch.tensor([[amax / qmax]], device=x.device)}
    if name == "nvfp4":
        return {"global_scale": nvfp4_global_scale(torch.tensor(amax)).reshape(1, 1).to(x.device)}
    return {}


def _poisoned_like(r: QTensor) -> QTensor:
    """Buffers shaped like the reference's, filled with values no quantizer produces here."""

    def p(t):
        if t is None:
            return None
        if t.dtype == torch.float8_e4m3fn:
            return torch.full(t.shape, 0xFF, dtype=torch.uint8, device=t.device).view(t.dtype)  # NaN
        if t.dtype == torch.int8:
            return torch.full(t.shape, -128, dtype=torch.int8, device=t.device)  # never: |q| <= 127
        if t.dtype == torch.uint8:
            return torch.full(t.shape, 0xFF, dtype=torch.uint8, device=t.device)
        return poison_(torch.empty_like(t))

    return QTensor(p(r.data), r.shape, scale=p(r.scale))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same_bytes(q: QTensor, r: QTensor) -> None:
    assert q.data.dtype == r.data.dtype and q.scale.dtype == r.scale.dtype
    assert torch.equal(_bytes(q.data), _bytes(r.data)), "data bytes differ"
    assert torch.equal(_bytes(q.scale).reshape(r.scale.shape), _bytes(r.scale)), "scales differ"


def _run_quant(name: str, m: int, k: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    tq, static = QUANTS[name], _static(name, x)
    r = quantize_activations_ref(x, tq, **static)
    q = quantize_activations(x, tq, out=_poisoned_like(r), **static)
    _assert_same_bytes(q, r)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("name", QUANTS)
def test_quantize_exact(name, shape):
    m, k = SHAPES[shape]
    if name in ("mxfp8", "nvfp4") and k % 32:
        k = 128
    _run_quant(name, m, k)


@needs_triton
def test_quantize_e4m3_rounding_edges():
    """Ties, subnormals, carries into the exponent and saturation, per-token fp8."""
    vals = [0.0, 2**-9, 1.5 * 2**-9, 2.5 * 2**-9, 2**-6 * 1.0625, 15.5, 31.0, 31.9, 240.0, 247.0, 447.9]
    x = torch.tensor(vals + [-v for v in vals] + [448.0], dtype=torch.float32)
    x = x.reshape(1, -1).expand(3, -1).contiguous().to(DEVICE)
    x[1] *= 0.5  # amax 224: the scale and every quotient change
    tq = QUANTS["fp8_token"]
    _assert_same_bytes(quantize_activations(x, tq), quantize_activations_ref(x, tq))


# ---- fused activation + quantization -------------------------------------------------

ACT_CASES = [(a, False) for a in Activation] + [(Activation.SWIGLUOAI, True), (Activation.SILU, True)]
A2 = ["none", "fp8_token", "fp8_tensor", "fp8_group128", "int8_token", "mxfp8", "nvfp4"]
# Dequantized error allowed against the fp32 reference: a rare rounding flip (an fp32
# ulp of difference in the activation) costs one quantization step of one element.
ACT_TOL = {"none": 4e-3, "fp8": 2e-3, "int8": 2e-3, "mxfp8": 2e-3, "nvfp4": 2e-2}


def _run_act(act: Activation, interleaved: bool, a2: str, m: int, i: int, seed: int = 0) -> None:
    cfg = MoEConfig(
        num_experts=4, top_k=2, hidden_size=64, intermediate_size=i, activation=act, gate_up_interleaved=interleaved
    )
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(m, cfg.w13_rows, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    tq = QUANTS.get(a2)
    static = _static(a2, h)
    r = act_and_quantize_ref(h, cfg, tq, **static)
    if tq is None:
        out = poison_(torch.empty(m, i, dtype=cfg.dtype, device=DEVICE))
        q = act_and_quantize(h, cfg, None, out=out)
        assert q.dtype == cfg.dtype and q.shape == (m, i)
        assert rel_error(q, r) <= ACT_TOL["none"]
        return
    q = act_and_quantize(h, cfg, tq, out=_poisoned_like(r), **static)
    assert q.data.shape == r.data.shape and q.scale.shape == r.scale.shape
    dq, dr = dequantize(q, tq), dequantize(r, tq)
    assert rel_error(dq, dr) <= ACT_TOL[tq.dtype.value.split("_")[0]]
    if tq.dtype in (QDtype.FP8, QDtype.INT8):
        torch.testing.assert_close(q.scale.float(), r.scale.float(), rtol=1e-5, atol=0)


@needs_triton
@pytest.mark.parametrize("a2", A2)
@pytest.mark.parametrize("act,interleaved", ACT_CASES, ids=[f"{a.value}{'_il' if il else ''}" for a, il in ACT_CASES])
def test_act_and_quantize(act, interleaved, a2):
    _run_act(act, interleaved, a2, m=19, i=128)


@needs_triton
@pytest.mark.parametrize("a2", ["none", "fp8_token", "fp8_group128", "fp8_tensor"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "split"])
def test_act_and_quantize_partial_column_tile(interleaved, a2):
    """I = 200: the second column tile is partial (and so is its last 1 x 128 group); interleaved
    gate/up pairs are loaded as one [BM, 2BK] tile and split in registers: the pairs past I must
    stay out of the activation and the scales."""
    _run_act(Activation.SWIGLUOAI, interleaved, a2, m=37, i=200)


@needs_triton
@pytest.mark.parametrize("m", [0, 1])
def test_act_and_quantize_few_rows(m):
    _run_act(Activation.SILU, False, "fp8_token", m=m, i=128)
    _run_act(Activation.SILU, False, "nvfp4", m=m, i=64)


# ---- NaN policy (fusedmoe.quant): a NaN makes the fp8/int8 scale it shares NaN, never 1 ------
# (and the nvfp4 block scale NaN; an mxfp8 NaN stays a NaN element under scale code 127)

NAN_QUANTS = [
    "fp8_token",
    "fp8_group32",
    "fp8_tensor",
    "fp8_tensor_static",
    "int8_token",
    "int8_group64",
    "int8_tensor",
    "mxfp8",
    "nvfp4",
]
# the interpreter's hand e4m3 encoding casts its unused subnormal branch of a NaN to int32
nan_cast_warning = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")


def _nan_out(r: QTensor) -> QTensor:
    """Poisoned buffers whose fp32 scales are finite (-1: no quantizer's), so an unwritten NaN shows."""
    p = _poisoned_like(r)
    if r.scale.dtype != torch.float32:
        return p
    return QTensor(p.data, p.shape, scale=torch.full_like(r.scale, -1.0))


def _assert_same_with_nan(q: QTensor, r: QTensor, tq: TensorQuant) -> None:
    """Same data bytes (fp8 NaN is 0x7F, int8 NaN is 0, as torch casts) and the same scales, NaN included."""
    assert torch.isnan(dequantize(r, tq)).any(), "the reference lost the NaN: the case tests nothing"
    assert torch.equal(_bytes(q.data), _bytes(r.data)), "data bytes differ"
    if r.scale.dtype == torch.float32:
        torch.testing.assert_close(q.scale.reshape(r.scale.shape), r.scale, rtol=0, atol=0, equal_nan=True)
    else:
        assert torch.equal(_bytes(q.scale), _bytes(r.scale)), "scales differ"


def _run_nan(name: str, m: int, k: int, row: int, col: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[row, col] = float("nan")
    x = x.to(DEVICE)
    tq, static = QUANTS[name], _static(name, x)
    r = quantize_activations_ref(x, tq, **static)
    if tq.dtype in (QDtype.FP8, QDtype.INT8) and tq.dynamic:
        assert torch.isnan(r.scale).any(), "the reference has no NaN scale"
    _assert_same_with_nan(quantize_activations(x, tq, out=_nan_out(r), **static), r, tq)


# row 3 is in the first program of rows, 35 in the last: a per-tensor amax must keep the NaN
# whichever program folds it in, before or after the finite ones; col 70 is in the 2nd/3rd group
@nan_cast_warning
@needs_triton
@pytest.mark.parametrize("row", [3, 35])
@pytest.mark.parametrize("name", NAN_QUANTS)
def test_quantize_nan_as_the_reference(name, row):
    _run_nan(name, 37, 128 if name in ("mxfp8", "nvfp4") else 96, row, 70)


@nan_cast_warning
@needs_triton
@pytest.mark.parametrize("a2", ["fp8_token", "fp8_group128", "fp8_tensor", "int8_token", "int8_group64"])
def test_act_and_quantize_nan_gives_nan_scale(a2):
    """The fused activation too: the NaN reaches exactly the outputs it reaches in the reference."""
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=128)
    h = (torch.randn(19, cfg.w13_rows, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    h[7, 5] = float("nan")  # a gate value of token 7
    h = h.to(DEVICE)
    tq = QUANTS[a2]
    r = act_and_quantize_ref(h, cfg, tq)
    q = act_and_quantize(h, cfg, tq, out=_nan_out(r))
    assert torch.isnan(r.scale).any()
    assert torch.equal(torch.isnan(q.scale.reshape(r.scale.shape)), torch.isnan(r.scale))
    assert torch.equal(torch.isnan(dequantize(q, tq)), torch.isnan(dequantize(r, tq)))


def test_cpu_path_is_ref(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("tests the CPU path")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(5, 64).bfloat16()
    tq = QUANTS["mxfp8"]
    _assert_same_bytes(quantize_activations(x, tq), quantize_activations_ref(x, tq))


# ---- moe_sum -----------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("t,k,h", [(0, 2, 64), (1, 1, 64), (7, 3, 50), (20, 8, 200)])
@pytest.mark.parametrize("with_map", [False, True])
def test_moe_sum(t, k, h, with_map):
    g = torch.Generator().manual_seed(t + k)
    c = torch.randn(t, k, h, generator=g).to(DEVICE)
    ids = emap = None
    if with_map:
        ids = torch.rand(t, 8, generator=g).argsort(dim=1)[:, :k].int()
        emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)
        c[(emap[ids.long()] < 0)] = float("nan")  # rows of non-local pairs: never written
        ids, emap = ids.to(DEVICE), emap.to(DEVICE)
    out = poison_(torch.empty(t, h, device=DEVICE))
    e_l = 4 if with_map else None
    moe_sum(c, out, topk_ids=ids, expert_map=emap, num_local_experts=e_l)
    ref = moe_sum_ref(c, topk_ids=ids, expert_map=emap, num_local_experts=e_l)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@nan_cast_warning
@needs_triton
@pytest.mark.parametrize("path", ["one_program", "two_passes"])
@pytest.mark.parametrize("name", ["fp8_tensor", "int8_tensor"])
def test_per_tensor_dynamic_one_program_and_two_passes(name, path, monkeypatch):
    # small tensors take one program (PASS 0), larger ones the amax pass and the quantize pass:
    # both forced here on the same cases (several tiles, a NaN in the last rows, the activation,
    # a row mask), each equal to the reference byte for byte
    from fusedmoe.kernels import act_quant as module
    from fusedmoe.kernels.launch import intercept_launches

    monkeypatch.setattr(module, "_ONE_PROGRAM_MAX", 1 << 30 if path == "one_program" else 0)
    passes = []

    def record(kernel, grid, args, kwargs):
        passes.append(kwargs["PASS"])
        kernel[grid](*args, **kwargs)

    with intercept_launches(record):
        _run_quant(name, 37, 96)
        _run_nan(name, 37, 96, 35, 70)
        _run_act(Activation.SILU, False, name, m=19, i=128)
        test_act_and_quantize_row_mask(name)
    assert set(passes) == ({0} if path == "one_program" else {1, 2}), passes


@needs_triton
@pytest.mark.parametrize("a2", ["fp8_tensor", "int8_tensor", "fp8_token", "none"])
def test_act_and_quantize_row_mask(a2):
    """Masked-out rows hold garbage (inf, NaN) that a per-tensor scale must not see; the kernel
    leaves their output rows as they were and computes the others as the reference of the rows kept."""
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=128)
    g = torch.Generator().manual_seed(5)
    m = 23
    h = (torch.randn(m, cfg.w13_rows, generator=g) * 3).to(torch.bfloat16)
    keep = torch.rand(m, generator=g) < 0.6
    keep[0] = True
    h[~keep] = float("inf")
    h[~keep, 1] = float("nan")
    tq = QUANTS.get(a2)
    ref = act_and_quantize_ref(h[keep], cfg, tq)
    h, keep = h.to(DEVICE), keep.to(DEVICE)
    if tq is None:
        out = poison_(torch.empty(m, 128, dtype=cfg.dtype, device=DEVICE))
    else:
        out = _poisoned_like(act_and_quantize_ref(torch.zeros_like(h), cfg, tq))
    before = (out if tq is None else out.data).clone()
    q = act_and_quantize(h, cfg, tq, out=out, row_mask=keep)
    data = q if tq is None else q.data
    assert torch.equal(data[~keep].view(torch.uint8), before[~keep].view(torch.uint8))  # rows skipped: untouched
    if tq is None:
        assert rel_error(data[keep].cpu(), ref) <= ACT_TOL["none"]
        return
    scale = (q.scale if q.scale.numel() == 1 else q.scale[keep]).cpu()
    rows = QTensor(q.data[keep].cpu(), tuple(ref.shape), scale=scale)
    assert torch.isfinite(rows.scale.float()).all()
    torch.testing.assert_close(rows.scale.float().cpu(), ref.scale.float(), rtol=1e-5, atol=0)
    assert rel_error(dequantize(rows, tq).cpu(), dequantize(ref, tq)) <= ACT_TOL[tq.dtype.value.split("_")[0]]


@needs_triton
@pytest.mark.parametrize("t,k,h", [(1, 1, 64), (7, 3, 50), (20, 8, 200)])
@pytest.mark.parametrize("with_map", [False, True])
def test_moe_sum_gathers_weighted_rows(t, k, h, with_map):
    """c as [P, H] rows in some order, ``rows`` [T, K] the row of each pair, router weights
    applied: the same as moe_sum of the pairs laid out [T, K, H] and weighted by hand."""
    g = torch.Generator().manual_seed(t * k)
    p = t * k
    perm = torch.randperm(p, generator=g)
    c_pairs = torch.randn(t, k, h, generator=g)
    w = torch.rand(t, k, generator=g)
    ids = emap = e_l = None
    if with_map:
        ids = torch.rand(t, 8, generator=g).argsort(dim=1)[:, :k].int()
        emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)
        c_pairs[(emap[ids.long()] < 0)] = float("nan")  # rows of non-local pairs: never written
        e_l = 4
    c = torch.empty(p, h)
    c[perm] = c_pairs.reshape(p, h)  # pair j lives at row perm[j]
    rows = perm.view(t, k).int()
    ref = moe_sum_ref(c_pairs * w.unsqueeze(-1), topk_ids=ids, expert_map=emap, num_local_experts=e_l)
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    out = poison_(torch.empty(t, h, device=DEVICE))
    moe_sum(dev(c), out, topk_ids=dev(ids), expert_map=dev(emap), num_local_experts=e_l, rows=dev(rows), weights=dev(w))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)


# ---- real shapes (GPU): the hardware's e4m3/bf16 conversions give the same bytes ----------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,k", [(1, 2048), (512, 4096), (4096, 7168)])
@pytest.mark.parametrize("name", QUANTS)
def test_quantize_exact_real_shapes(name, m, k):
    _run_quant(name, m, k, seed=m)


# Rows whose dynamic scale is not a normal float: tiny rows (a subnormal scale, whose reciprocal
# overflows) and a row holding inf (an infinite scale); the tile's quotients then take div_rn.
_EDGE_QUANTS = ["fp8_tensor", "fp8_token", "fp8_group128", "int8_tensor", "int8_token", "int8_group64"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 6, 512], ids=lambda m: f"{m}-rows")
@pytest.mark.parametrize("edge", ["tiny", "inf"])
@pytest.mark.parametrize("name", _EDGE_QUANTS)
def test_quantize_scales_that_are_not_normal_floats(name, edge, m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2048, generator=g) * 3
    if edge == "tiny":
        x[m // 2] *= 1e-40  # the row's (and a one-row tensor's) scale is subnormal
        if m > 1:
            x[0] *= 1e-30
    else:
        x[m // 2, 700] = float("inf")
    x = x.to(torch.bfloat16).to("cuda")
    tq = QUANTS[name]
    ref = quantize_activations_ref(x, tq)
    got = quantize_activations(x, tq, out=_poisoned_like(ref))
    _assert_same_bytes(got, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("row", [0, 300, 511])
@pytest.mark.parametrize("name", NAN_QUANTS)
def test_quantize_nan_as_the_reference_real_shapes(name, row):
    _run_nan(name, 512, 4096, row, 3000, seed=row + 1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("a2", A2)
@pytest.mark.parametrize("act,interleaved", ACT_CASES, ids=[f"{a.value}{'_il' if il else ''}" for a, il in ACT_CASES])
def test_act_and_quantize_real_shapes(act, interleaved, a2):
    _run_act(act, interleaved, a2, m=512 * 8, i=1536)


@pytest.mark.gpu
@needs_cuda
def test_moe_sum_real_shapes():
    c = torch.randn(512, 8, 4096, device="cuda", dtype=torch.bfloat16)
    out = moe_sum(c)
    torch.testing.assert_close(out.float(), moe_sum_ref(c), rtol=1e-2, atol=2e-2)


@needs_triton
@pytest.mark.parametrize("m", [0, 5, 37], ids=lambda m: f"{m}-rows")
@pytest.mark.parametrize("name", ["fp8_tensor", "int8_tensor"])
def test_per_tensor_with_a_known_amax(name, m):
    """``amax`` given (what GEMM1's epilogue raises): only the codes pass runs, and its bytes and
    scale equal the two-pass reference's when the amax is the tensor's; with no rows the scale is
    still written (from the amax given), not left as the buffer held it."""
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 96, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    tq = QUANTS[name]
    r = quantize_activations_ref(x, tq) if m else quantize_activations_ref(torch.ones(1, 96), tq)
    amax = x.float().abs().amax().reshape(1) if m else torch.full((1,), 2.5 * 448, device=DEVICE)
    out = _poisoned_like(QTensor(r.data[:m].to(DEVICE), (m, 96), scale=r.scale.to(DEVICE)))
    q = quantize_activations(x, tq, out=out, amax=amax.to(DEVICE))
    if m:
        _assert_same_bytes(q, r)
    else:
        want = 2.5 * 448 / (448.0 if tq.dtype is QDtype.FP8 else 127.0)
        assert q.scale.item() == pytest.approx(want, rel=1e-7)
    # the same abs-max as GEMM1's per-program slots (``ActEpilogue.amax_slots``): the max of int32 |bits|
    slots = torch.zeros(1100, dtype=torch.int32)  # more than one 1024-wide sweep of the slots
    slots[1050] = amax.view(torch.int32)[0]
    slots[3] = (amax / 3).view(torch.int32)[0]
    q2 = quantize_activations(x, tq, out=_poisoned_like(out), amax=slots.to(DEVICE))
    assert torch.equal(q2.data.view(torch.uint8).cpu(), q.data.view(torch.uint8).cpu())
    assert torch.equal(q2.scale.cpu(), q.scale.cpu())
