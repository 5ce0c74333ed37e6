"""Quantization formats: codecs, round-trip bounds, hand-computed bytes, packers.

Each format is checked three ways:
  * against an independent implementation: numpy group reductions + ml_dtypes
    casts (torch has no float -> float4_e2m1fn_x2 cast: "copy_kernel not
    implemented"), torch's float8 casts, compressed-tensors' packers;
  * against a per-element error bound derived from the format's step size;
  * against small tensors whose codes, scales and packed words are written out.
Inputs are seeded random normals with per-row magnitudes spread over 2^-8..2^8,
so groups see different exponents; zeros only in the zero-tensor test.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fusedmoe.errors import FusedMoEError
from fusedmoe.quant import Granularity as Gr
from fusedmoe.quant import QDtype, QTensor, QuantScheme, TensorQuant, dequantize, quantize
from fusedmoe.quant.fp4 import (
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    mx_scale_code,
    pack_nibbles,
    unpack_nibbles,
)
from fusedmoe.quant.int4 import (
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)
from fusedmoe.quant.scheme import all_schemes
from fusedmoe.weights import ExpertWeights

E4M3, E2M1 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn
SLACK = 1 + 1e-5  # fp32 rounding of x / scale and of the dequantized product


def within(err, bound, x):
    """err <= bound, give or take the fp32 rounding of x / scale (2^-24 |x|, taken as 2^-20)."""
    return bool((err <= bound * SLACK + np.abs(x) * 2.0**-20).all())


def rand(*shape, seed=0, spread=8):
    """N(0,1) with each row scaled by 2^u, u uniform in [-spread, spread]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return x * torch.exp2(torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=g).float())


def i32(words):
    """Hex words as written (0x87654321) -> int32 two's complement."""
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


# ---- numpy reference of the scale grouping (independent of tensor.group_amax) --------


def ref_index(n, k, gran, g_idx=None):
    """(row, col) index into the [.., Sn, Sk] scale for every element of [N, K]."""
    r, c = np.arange(n), np.arange(k) if g_idx is None else np.asarray(g_idx)
    if gran.kind == "tensor":
        r, c = r * 0, c * 0
    elif gran.kind in ("token", "channel"):
        c = c * 0
    elif gran.kind == "group" and g_idx is None:
        c = c // gran.group_size
    elif gran.kind == "block":
        r, c = r // gran.block_n, c // gran.block_k
    return np.broadcast_to(r[:, None], (n, k)), np.broadcast_to(c[None, :], (n, k))


def ref_reduce(x, gran, g_idx=None):
    """max of x (numpy [B, N, K], non-negative) per scale group -> [B, Sn, Sk]."""
    b, n, k = x.shape
    sn, sk = gran.scale_shape(n, k)
    out = np.zeros((b, sn, sk), x.dtype)
    for i in range(b):
        np.maximum.at(out[i], ref_index(n, k, gran, None if g_idx is None else g_idx[i]), x[i])
    return out


def ref_expand(s, gran, n, k, g_idx=None):
    return np.stack([s[i][ref_index(n, k, gran, None if g_idx is None else g_idx[i])] for i in range(len(s))])


def e2m1_half_step(y):
    """Largest |y - e2m1(y)|: half the gap at |y|, or the saturation error above 6."""
    m = np.abs(y)
    return np.where(m < 2, 0.25, np.where(m < 4, 0.5, np.where(m <= 6, 1.0, m - 6)))


def e4m3_half_step(y):
    m = np.abs(y)
    return np.where(m > 448, m - 448, np.maximum(m * 2.0**-4, 2.0**-10))


# ---- fp8 / int8, every granularity ------------------------------------------------------

GRANS = [
    Gr.tensor(),
    Gr.token(),
    Gr.channel(),
    Gr.group(128),  # K=200: one full group and a partial one of 72
    Gr.block(128, 128),
    Gr.block(64, 32),  # N=150, K=200 are not multiples of either
]


@pytest.mark.parametrize("gran", GRANS, ids=repr)
@pytest.mark.parametrize("dtype", [QDtype.FP8, QDtype.INT8], ids=lambda d: d.value)
def test_linear_matches_reference_and_bound(dtype, gran):
    x = rand(2, 150, 200, seed=1)
    tq = TensorQuant(dtype, gran)
    q = quantize(x, tq)
    xn = x.numpy()
    qmax = np.float32(448 if dtype is QDtype.FP8 else 127)
    amax = ref_reduce(np.abs(xn), gran)
    want_scale = np.where(amax > 0, amax / qmax, 1).astype(np.float32)
    np.testing.assert_array_equal(q.scale.numpy(), want_scale)
    s = ref_expand(want_scale, gran, 150, 200)
    y = np.clip(xn / s, -qmax, qmax)
    if dtype is QDtype.FP8:
        assert q.data.dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(q.data.view(torch.uint8).numpy(), y.astype(E4M3).view(np.uint8))
        torch_cast = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(q.data.view(torch.uint8), torch_cast)
        bound = np.maximum(np.abs(xn) * 2.0**-4, s * 2.0**-10)  # 3 mantissa bits; subnormal step 2^-9
    else:
        np.testing.assert_array_equal(q.data.numpy(), np.round(y).astype(np.int8))  # half to even
        bound = s / 2
    err = np.abs(dequantize(q, tq).numpy() - xn)
    assert within(err, bound, xn), float((err / bound).max())
    assert torch.equal(dequantize(q, tq, torch.float64), q.data.double() * torch.from_numpy(s).double())


def test_fp8_hand_computed():
    x = torch.tensor([[448.0, 17.0, 19.0, -0.5], [1.0, -448.0, 2.0**-9, 2.0**-10]])
    q = quantize(x, TensorQuant(QDtype.FP8, Gr.tensor()))
    assert q.scale.item() == 1.0
    # 17 and 19 are ties in [16, 32) (step 2): to the even mantissa, 16 and 20.
    # 2^-9 is the smallest subnormal; 2^-10 is half of it and ties to 0.
    want = [[448.0, 16.0, 20.0, -0.5], [1.0, -448.0, 2.0**-9, 0.0]]
    assert q.data.float().tolist() == want


def test_int8_hand_computed():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5], [254.0, -254.0, 1.0, 3.0]])
    q = quantize(x, TensorQuant(QDtype.INT8, Gr.channel()))
    assert q.scale.flatten().tolist() == [1.0, 2.0]
    assert q.data.tolist() == [[127, 0, 2, -2], [127, -127, 0, 2]]  # halves go to even
    q = quantize(torch.tensor([[127.0, 63.5, -3.0]]), TensorQuant(QDtype.INT8, Gr.group(2)))
    assert q.data.tolist() == [[127, 64, -127]]  # partial last group of one element
    assert q.scale.tolist() == [[1.0, np.float32(3) / np.float32(127)]]
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 7.0], [7.0, 8.0, 9.0]])
    q = quantize(x, TensorQuant(QDtype.INT8, Gr.block(2, 2)))
    assert torch.equal(q.scale, torch.tensor([[5.0, 7.0], [8.0, 9.0]]) / 127)
    assert q.data.tolist() == [[25, 51, 54], [102, 127, 127], [111, 127, 127]]


@pytest.mark.parametrize("dtype,qmax", [(QDtype.FP8, 448.0), (QDtype.INT8, 127.0)], ids=["fp8", "int8"])
def test_linear_static_scale_and_saturation(dtype, qmax):
    tq = TensorQuant(dtype, Gr.tensor())
    x = rand(3, 8, 16, seed=2, spread=0)
    q = quantize(x, tq, scale=torch.tensor(0.5 / qmax))  # amax ~3: most of it saturates
    assert torch.equal(q.scale, torch.full((3, 1, 1), 0.5 / qmax))
    dq = dequantize(q, tq)
    big = x.abs() > 0.5
    low = -128 if dtype is QDtype.INT8 else -448  # int8 stores -128 too
    want = torch.where(x[big] > 0, 0.5, np.float32(0.5 / qmax) * low)
    assert big.any() and torch.equal(dq[big], want)
    s, xs = 0.5 / qmax, x[~big]
    bound = torch.maximum(xs.abs() / 16, torch.tensor(s / 1024)) if dtype is QDtype.FP8 else s / 2
    assert ((dq[~big] - xs).abs() <= bound * SLACK).all()


# ---- e2m1 / e8m0 codecs -----------------------------------------------------------------


def test_e2m1_decode_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(E2M1).astype(np.float32)
    assert e2m1_decode(torch.from_numpy(codes)).tolist() == want.tolist()
    assert e2m1_decode(torch.tensor([0, 1, 7, 8, 9, 15])).tolist() == [0, 0.5, 6, -0.0, -0.5, -6]


def test_e2m1_encode_matches_ml_dtypes():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    special = ties + [6.0, 6.5, 7.0, 100.0, 1e30, 0.0, 1e-30, 0.2499, 0.2501, 5.0001]
    v = np.concatenate([np.array(special), -np.array(special), rand(4096, seed=3, spread=0).numpy() * 3])
    v = torch.tensor(v, dtype=torch.float32)
    assert e2m1_encode(v).tolist() == v.numpy().astype(E2M1).view(np.uint8).tolist()
    # by hand: ties to even code, saturation at +-6, sign bit 3 (so -0.1 -> 8)
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -7.0])
    assert e2m1_encode(v).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 15]


def test_nibble_packing():
    c = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    assert pack_nibbles(c).tolist() == [[0x21, 0x43, 0x0F]]  # even column in the low nibble
    r = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(r)), r)


def test_e8m0():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    via_torch = codes.view(torch.float8_e8m0fnu).float()
    got = e8m0_decode(codes)
    assert torch.equal(got.isnan(), via_torch.isnan()) and via_torch[255].isnan()
    assert torch.equal(got[:255], via_torch[:255])
    via_ml = codes.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(e8m0_decode(codes).numpy(), via_ml)
    # floor(log2(amax)) exactly, incl. just below a power of two, subnormals and clamping
    amax = np.array([1.0, 3.0, 4.0, np.nextafter(np.float32(2), 0), 0.3, 1e-45, 1e-39, 3e38, 448, 500], np.float32)
    for emax in (2, 8):
        want = np.clip(np.floor(np.log2(amax.astype(np.float64))) - emax, -127, 127) + 127
        assert mx_scale_code(torch.from_numpy(amax), emax).tolist() == want.astype(int).tolist()
    assert mx_scale_code(torch.zeros(1), 2).item() == 127  # all-zero group: scale 1


# ---- MXFP4 / MXFP8 / NVFP4 ----------------------------------------------------------------


def ref_mx(xn, emax):
    amax = ref_reduce(np.abs(xn).astype(np.float64), Gr.group(32))
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - emax, 0)
    e = np.clip(e, -127, 127)
    y = xn / ref_expand(np.exp2(e), Gr.group(32), *xn.shape[-2:]).astype(np.float32)
    return (e + 127).astype(np.uint8), y


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_matches_reference_and_bound(fmt):
    x = rand(2, 24, 256, seed=5)
    tq = TensorQuant(QDtype(fmt), Gr.group(32))
    q = quantize(x, tq)
    emax = 2 if fmt == "mxfp4" else 8
    code, y = ref_mx(x.numpy(), emax)
    np.testing.assert_array_equal(q.scale.numpy(), code)
    if fmt == "mxfp4":
        np.testing.assert_array_equal(unpack_nibbles(q.data).numpy(), y.astype(E2M1).view(np.uint8))
        bound = e2m1_half_step(y)
    else:
        want = np.clip(y, -448, 448).astype(E4M3).view(np.uint8)
        np.testing.assert_array_equal(q.data.view(torch.uint8).numpy(), want)
        bound = e4m3_half_step(y)
    scale = ref_expand(np.exp2(code.astype(np.float64) - 127), Gr.group(32), 24, 256)
    err = np.abs(dequantize(q, tq, torch.float64).numpy() - x.numpy())
    assert within(err, bound * scale, x.numpy())


def test_mxfp4_hand_computed():
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([3.0, 0.25, -1.0, 0.125, 0.375, 2.5, -2.75, 0.0])
    q = quantize(x, TensorQuant(QDtype.MXFP4, Gr.group(32)))
    # amax 3: floor(log2 3) - 2 = -1, X = 0.5 (code 126); x / X = 6, .5, -2, .25, .75, 5, -5.5, 0
    assert q.scale.tolist() == [[126]]
    assert unpack_nibbles(q.data)[0, :8].tolist() == [7, 1, 12, 0, 2, 6, 15, 0]
    assert q.data[0, :4].tolist() == [0x17, 0x0C, 0x62, 0x0F]


def test_mxfp8_hand_computed_and_saturation():
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([448.0, 17.0, -0.5])
    x[1, :2] = torch.tensor([500.0, 1.0])  # floor(log2 500) = 8 too: X = 1, 500 saturates
    q = quantize(x, TensorQuant(QDtype.MXFP8, Gr.group(32)))
    assert q.scale.tolist() == [[127], [127]]
    assert q.data[0, :3].float().tolist() == [448.0, 16.0, -0.5]
    assert q.data[1, :2].float().tolist() == [448.0, 1.0]


def test_nvfp4_matches_reference_and_bound():
    x = rand(2, 24, 128, seed=6)
    tq = TensorQuant(QDtype.NVFP4, Gr.group(16))
    q = quantize(x, tq)
    xn = x.numpy()
    gs = (np.abs(xn).max(axis=(1, 2), keepdims=True) / np.float32(2688)).astype(np.float32)
    np.testing.assert_array_equal(q.global_scale.numpy(), gs)
    sb = (ref_reduce(np.abs(xn), Gr.group(16)) / (np.float32(6) * gs)).astype(E4M3)
    assert q.scale.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(q.scale.view(torch.uint8).numpy(), sb.view(np.uint8))
    d = ref_expand(sb.astype(np.float32) * gs, Gr.group(16), 24, 128)
    y = xn / d
    np.testing.assert_array_equal(unpack_nibbles(q.data).numpy(), y.astype(E2M1).view(np.uint8))
    err = np.abs(dequantize(q, tq, torch.float64).numpy() - xn)
    assert within(err, e2m1_half_step(y) * d, xn)


def test_nvfp4_hand_computed():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([2688.0, 448.0, -224.0, 112.0])
    x[0, 16:19] = torch.tensor([6.0, -3.0, 1.75])
    q = quantize(x, TensorQuant(QDtype.NVFP4, Gr.group(16)))
    # global 2688 / 2688 = 1; block 0: 2688 / 6 = 448 -> values 6, 1, -0.5, 0.25 (tie -> 0)
    # block 1: 6 / 6 = 1 -> values 6, -3, 1.75 (tie -> 2)
    assert q.global_scale.tolist() == [[1.0]]
    assert q.scale.float().tolist() == [[448.0, 1.0]]
    codes = unpack_nibbles(q.data)[0]
    assert codes[:4].tolist() == [7, 2, 9, 0] and codes[16:19].tolist() == [7, 13, 4]


def test_nvfp4_static_global_scale_and_saturation():
    tq = TensorQuant(QDtype.NVFP4, Gr.group(16), dynamic=True)
    x = rand(8, 64, seed=7, spread=2)
    gs = torch.tensor([[0.01]])
    q = quantize(x, tq, global_scale=gs)
    assert torch.equal(q.global_scale, gs)
    want = (x.abs().view(8, 4, 16).amax(-1) / (6 * 0.01)).clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(q.scale.view(torch.uint8), want.view(torch.uint8))
    # a global scale far too small: block scales stop at 448, values at 6 * 448 * gs
    tiny = torch.tensor(1e-5)
    dq = dequantize(quantize(x, tq, global_scale=tiny), tq)
    top = 6 * (np.float32(448) * np.float32(1e-5))  # e2m1 max * (fp32(block) * global)
    big = x.abs() > top
    assert big.any() and torch.equal(dq[big], x[big].sign() * top)
    static = quantize(x, tq, scale=q.scale, global_scale=gs)
    assert torch.equal(static.data, q.data)
    with pytest.raises(FusedMoEError, match="global_scale"):
        quantize(x, tq, scale=q.scale)


def test_mx_static_scale_and_saturation():
    x = rand(4, 64, seed=8, spread=0)
    for fmt, top in (("mxfp4", 6.0), ("mxfp8", 448.0)):
        tq = TensorQuant(QDtype(fmt), Gr.group(32))
        code = torch.full((4, 2), 112, dtype=torch.uint8)  # X = 2^-15: most values saturate
        q = quantize(x, tq, scale=code)
        assert torch.equal(q.scale, code)
        dq = dequantize(q, tq)
        big = x.abs() >= top * 2.0**-15
        assert big.any() and torch.equal(dq[big], x[big].sign() * top * 2.0**-15)
        assert torch.equal(quantize(x, tq, scale=torch.full((4, 2), 2.0**-15)).scale, code)
        with pytest.raises(FusedMoEError, match="powers of two"):
            quantize(x, tq, scale=torch.full((4, 2), 0.3))


# ---- INT4 ---------------------------------------------------------------------------------


def random_g_idx(b, k, g, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([(torch.randperm(k, generator=gen) // g) for _ in range(b)]).to(torch.int32)


@pytest.mark.parametrize("act_order", [False, True], ids=["contiguous", "act_order"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "zp"])
def test_int4_matches_reference_and_bound(symmetric, act_order):
    b, n, k, g = 2, 16, 128, 32
    x = rand(b, n, k, seed=9)
    tq = TensorQuant(QDtype.INT4, Gr.group(g), symmetric=symmetric, act_order=act_order)
    gi = random_g_idx(b, k, g, seed=10) if act_order else None
    q = quantize(x, tq, g_idx=gi)
    xn, gin = x.numpy(), None if gi is None else gi.numpy()
    if symmetric:
        amax = ref_reduce(np.abs(xn), tq.granularity, gin)
        scale = np.where(amax > 0, amax / np.float32(7.5), 1).astype(np.float32)
        zero = np.full_like(scale, 8)
        assert q.zero is None
    else:
        hi = ref_reduce(np.maximum(xn, 0), tq.granularity, gin)
        lo = -ref_reduce(np.maximum(-xn, 0), tq.granularity, gin)
        scale = ((hi - lo) / np.float32(15)).astype(np.float32)
        zero = np.clip(np.round(-lo / scale), 0, 15)
        np.testing.assert_array_equal(q.zero.numpy(), zero.astype(np.uint8))
    np.testing.assert_array_equal(q.scale.numpy(), scale)
    s, z = ref_expand(scale, tq.granularity, n, k, gin), ref_expand(zero, tq.granularity, n, k, gin)
    codes = np.clip(np.round(xn / s) + z, 0, 15)
    np.testing.assert_array_equal(unpack_nibbles(q.data).numpy(), codes.astype(np.uint8))
    if act_order:
        assert torch.equal(q.g_idx, gi)
    err = np.abs(dequantize(q, tq, torch.float64).numpy() - xn)
    assert within(err, s / 2, xn)


def test_int4_hand_computed():
    x = torch.tensor([[7.5, -7.5, 1.0, 2.6, 0.0, 0.75, -3.75, 0.25]])
    q = quantize(x, TensorQuant(QDtype.INT4, Gr.group(4)))
    # group 0: scale 7.5/7.5 = 1, q = 8 (clips to 7), -8, 1, 3; group 1: scale 0.5,
    # q = 0, 1.5 -> 2, -7.5 -> -8, 0.5 -> 0 (halves to even); codes are q + 8
    assert q.scale.tolist() == [[1.0, 0.5]]
    assert q.data.tolist() == [[0x0F, 0xB9, 0xA8, 0x80]]
    x = torch.tensor([[-1.0, 0.0, 2.0, 6.5, 3.0, 7.5, 1.5, 6.0]])
    q = quantize(x, TensorQuant(QDtype.INT4, Gr.group(4), symmetric=False))
    # group 0: [-1, 6.5] -> scale 0.5, zero 2; group 1: range widened to [0, 7.5] -> zero 0
    assert q.scale.tolist() == [[0.5, 0.5]] and q.zero.tolist() == [[2, 0]]
    assert unpack_nibbles(q.data).tolist() == [[0, 2, 6, 15, 6, 15, 3, 12]]


def test_int4_static_scale_zero_tensor_and_errors():
    tq = TensorQuant(QDtype.INT4, Gr.group(16))
    x = rand(4, 32, seed=11, spread=0)
    q = quantize(x, tq, scale=torch.full((4, 2), 0.1))
    assert torch.equal(q.scale, torch.full((4, 2), 0.1))
    dq = dequantize(q, tq)
    assert torch.equal(dq[x > 0.75], torch.full_like(x[x > 0.75], np.float32(0.7)))  # code 15
    assert torch.equal(dq[x < -0.85], torch.full_like(x[x < -0.85], np.float32(-0.8)))  # code 0
    with pytest.raises(FusedMoEError, match="group size 16"):
        quantize(rand(4, 40), tq)
    with pytest.raises(FusedMoEError, match="g_idx"):
        quantize(x, tq, g_idx=torch.zeros(32, dtype=torch.int32))
    with pytest.raises(FusedMoEError, match="group ids"):
        quantize(x, TensorQuant(QDtype.INT4, Gr.group(16), act_order=True), g_idx=torch.full((32,), 2))


ZERO_CASES = {
    "fp8": (TensorQuant(QDtype.FP8, Gr.group(32)), {"scale": 1.0}),
    "int8": (TensorQuant(QDtype.INT8, Gr.block(16, 16)), {"scale": 1.0}),
    "int4": (TensorQuant(QDtype.INT4, Gr.group(32)), {"scale": 1.0}),
    "int4_zp": (TensorQuant(QDtype.INT4, Gr.group(32), symmetric=False), {"scale": 1.0, "zero": 8}),
    "mxfp4": (TensorQuant(QDtype.MXFP4, Gr.group(32)), {"scale": 127}),
    "mxfp8": (TensorQuant(QDtype.MXFP8, Gr.group(32)), {"scale": 127}),
    "nvfp4": (TensorQuant(QDtype.NVFP4, Gr.group(16)), {"scale": 0.0, "global_scale": 1.0}),
}


@pytest.mark.parametrize("name", list(ZERO_CASES))
def test_zero_tensor(name):
    tq, want = ZERO_CASES[name]
    q = quantize(torch.zeros(2, 8, 64), tq)
    for field, value in want.items():
        assert (getattr(q, field).float() == value).all(), field
    dq = dequantize(q, tq)
    assert torch.equal(dq, torch.zeros(2, 8, 64))


@pytest.mark.parametrize("name", list(ZERO_CASES))
def test_no_rows_and_one_row(name):
    """T = 0 and T = 1 activations (and N = 1 weights) go through every format."""
    tq, _ = ZERO_CASES[name]
    for x in (torch.zeros(0, 64), rand(1, 64, seed=19)):
        dq = dequantize(quantize(x, tq), tq)
        assert dq.shape == x.shape and torch.isfinite(dq).all()
        if len(x):
            assert ((dq - x).norm() / x.norm()).item() < 0.2


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ZERO_CASES))
def test_cuda_bytes_match_cpu(name):
    """Same bytes on both devices: CUDA divides by a Python scalar through its reciprocal
    (an ulp off now and then), so the formats divide by tensors (``ieee_div``)."""
    tq, _ = ZERO_CASES[name]
    x = rand(4, 64, 256, seed=20)
    cpu, gpu = quantize(x, tq).tensors(), quantize(x.cuda(), tq).tensors()
    for key, v in cpu.items():
        w = gpu[key].cpu()
        if v.dtype == torch.float8_e4m3fn:
            v, w = v.view(torch.uint8), w.view(torch.uint8)
        assert torch.equal(v, w), key


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4"])
def test_microscaled_k_must_be_whole_groups(fmt):
    tq = TensorQuant(QDtype(fmt), Gr.group(QDtype(fmt).fixed_group))
    with pytest.raises(FusedMoEError, match="multiple of the"):
        quantize(rand(4, 40), tq)


# ---- checkpoint packers ---------------------------------------------------------------------


def int4_tensor(symmetric, act_order, b=2, n=16, k=64, g=16, seed=12):
    tq = TensorQuant(QDtype.INT4, Gr.group(g), symmetric=symmetric, act_order=act_order)
    q = quantize(rand(b, n, k, seed=seed), tq, g_idx=random_g_idx(b, k, g, seed) if act_order else None)
    q.scale = q.scale.half().float()  # representable in the checkpoints' fp16 scales
    return q, tq


def assert_qtensor_equal(a: QTensor, b: QTensor):
    assert a.shape == b.shape
    for f in ("data", "scale", "zero", "g_idx"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        assert x is None or (x.dtype == y.dtype and torch.equal(x, y)), f


def hand_qtensor():
    """N = K = 8, one group; code[n, k] = (n + k) % 16, scale 1, symmetric."""
    c = (torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 16
    return QTensor(pack_nibbles(c), (8, 8), scale=torch.ones(8, 1))


def test_gptq_hand_packed():
    ck = pack_gptq(hand_qtensor())
    # qweight [K/8, N]: word n holds rows k = 0..7 of column n, row k in bits 4k..4k+3
    want = [0x76543210, 0x87654321, 0x98765432, 0xA9876543]
    want += [0xBA987654, 0xCBA98765, 0xDCBA9876, 0xEDCBA987]
    assert torch.equal(ck["qweight"], i32(want)[None])
    assert torch.equal(ck["qzeros"], i32([0x77777777])[None])  # zero 8 stored as 8 - 1
    assert ck["scales"].dtype == torch.float16 and ck["g_idx"].tolist() == [0] * 8


def test_awq_hand_packed():
    ck = pack_awq(hand_qtensor())
    # qweight [K, N/8]: row k packs columns n in AWQ order 0 2 4 6 1 3 5 7, code (n + k) % 16
    assert torch.equal(ck["qweight"][:2, 0], i32([0x75316420, 0x86427531]))
    assert torch.equal(ck["qzeros"], i32([0x88888888])[None])  # the zero itself


@pytest.mark.parametrize("case", ["sym", "zp", "sym_act_order"])
def test_gptq_round_trip(case):
    q, tq = int4_tensor(symmetric=case != "zp", act_order=case == "sym_act_order")
    ck = pack_gptq(q)
    assert ck["qweight"].shape == (2, 8, 16) and ck["qzeros"].shape == (2, 4, 2)
    # AutoGPTQ's torch dequant (qlinear_cuda_old.py forward): nibbles along K for
    # qweight, along N for qzeros, zeros + 1, scales and zeros picked by g_idx
    sh = torch.arange(0, 32, 4)
    w = ((ck["qweight"].long()[..., None, :] >> sh[:, None]) & 0xF).flatten(-3, -2)  # [B, K, N]
    z = ((ck["qzeros"].long()[..., None] >> sh) & 0xF).flatten(-2) + 1  # [B, G, N]
    gi = ck["g_idx"].long()
    for e in range(2):
        ref = (w[e] - z[e][gi[e]]) * ck["scales"][e][gi[e]].float()
        assert torch.equal(ref.T, dequantize(q, tq)[e])
    back = unpack_gptq(**ck, group_size=16, symmetric=case != "zp")
    assert_qtensor_equal(back, q)
    assert all(torch.equal(v, pack_gptq(back)[key]) for key, v in ck.items())
    # any int32 words are a valid asymmetric checkpoint: unpack then pack gives them back
    gen = torch.Generator().manual_seed(13)
    words = {
        "qweight": torch.randint(-(2**31), 2**31, (8, 16), generator=gen).to(torch.int32),
        "qzeros": torch.randint(-(2**31), 2**31, (4, 2), generator=gen).to(torch.int32),
        "scales": torch.rand(4, 16, generator=gen).half(),
        "g_idx": random_g_idx(1, 64, 16, seed=14)[0],
    }
    again = pack_gptq(unpack_gptq(**words, group_size=16, symmetric=False))
    assert all(torch.equal(v, again[key]) for key, v in words.items())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "zp"])
def test_awq_round_trip_and_autoawq_unpack(symmetric):
    q, _ = int4_tensor(symmetric, act_order=False)
    ck = pack_awq(q)
    assert ck["qweight"].shape == (2, 64, 2) and ck["qzeros"].shape == (2, 4, 2)
    assert_qtensor_equal(unpack_awq(**ck, group_size=16, symmetric=symmetric), q)
    # AutoAWQ's own unpack (awq/utils/packing_utils.py): shift out nibbles, then
    # reorder every 8 columns with its AWQ_REVERSE_ORDER
    nib = (ck["qweight"].long()[..., None] >> torch.arange(0, 32, 4)) & 0xF
    cols = (torch.arange(16).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]]).flatten()
    assert torch.equal(nib.flatten(-2)[..., cols], unpack_nibbles(q.data).long().transpose(-1, -2))
    gen = torch.Generator().manual_seed(15)
    words = {
        "qweight": torch.randint(-(2**31), 2**31, (64, 2), generator=gen).to(torch.int32),
        "qzeros": torch.randint(-(2**31), 2**31, (4, 2), generator=gen).to(torch.int32),
        "scales": torch.rand(4, 16, generator=gen).half(),
    }
    again = pack_awq(unpack_awq(**words, group_size=16))
    assert all(torch.equal(v, again[key]) for key, v in words.items())


@pytest.mark.parametrize("case", ["sym", "zp", "sym_act_order"])
def test_compressed_tensors_pack_quantized(case):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q, tq = int4_tensor(symmetric=case != "zp", act_order=case == "sym_act_order")
    ck = pack_compressed_tensors(q, scale_dtype=torch.float32)
    signed = (unpack_nibbles(q.data).to(torch.int16) - 8).to(torch.int8)
    assert torch.equal(ck["weight_packed"], helpers.pack_to_int32(signed, 4))
    # GPTQ packs the same nibbles along K, only transposed
    assert torch.equal(ck["weight_packed"], pack_gptq(q)["qweight"].transpose(-1, -2))
    if q.zero is not None:
        zp = (q.zero.to(torch.int16) - 8).to(torch.int8)
        assert torch.equal(ck["weight_zero_point"], helpers.pack_to_int32(zp, 4, packed_dim=0))
    assert torch.equal(helpers.unpack_from_int32(ck["weight_packed"], 4, torch.Size(q.shape)), signed)
    back = unpack_compressed_tensors(**ck)
    assert_qtensor_equal(back, q)
    if case != "sym_act_order":  # the library's decompress ignores g_idx
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        args = QuantizationArgs(num_bits=4, type="int", symmetric=tq.symmetric, strategy="group", group_size=16)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        for e in range(2):
            sd = {key: (v if key == "weight_shape" else v[e]) for key, v in ck.items()}
            got = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
            assert torch.equal(got.float(), dequantize(q, tq)[e])


# ---- through ExpertWeights ------------------------------------------------------------------

SCHEMES = [QuantScheme.int4_w4a16(128, act_order=True)] + [
    s for s in all_schemes() if s.w1 is not None and s.w1.dtype in (QDtype.MXFP4, QDtype.NVFP4)
]
# what each family's step allows on N(0,1) weights (relative Frobenius error, measured ~0.1)
MAX_REL = {"wna16": 0.13, "mxfp4": 0.13, "nvfp4": 0.11}


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_expert_weights_round_trip(scheme):
    e, h, i = 3, 256, 128
    w13, w2 = rand(e, 2 * i, h, seed=16, spread=0), rand(e, h, i, seed=17, spread=0)
    ew = ExpertWeights.from_float(w13, w2, scheme)
    d13, d2 = ew.dequantized(scheme, torch.bfloat16)
    assert d13.shape == w13.shape and d2.shape == w2.shape and d13.dtype == torch.bfloat16
    for d, w in ((d13, w13), (d2, w2)):
        assert ((d.float() - w).norm() / w.norm()).item() < MAX_REL[scheme.family]
    if scheme.w1.act_order:
        assert ew.w13.g_idx.shape == (e, h)
    if scheme.a1 is not None:  # activations: mxfp8 dynamic, or nvfp4 with the static global scale
        x = rand(5, h, seed=18, spread=0)
        gs = {"global_scale": ew.a1_global_scale} if scheme.a1.has_global_scale else {}
        qa = quantize(x, scheme.a1, **gs)
        if gs:
            assert torch.equal(qa.global_scale, ew.a1_global_scale)
        assert ((dequantize(qa, scheme.a1) - x).norm() / x.norm()).item() < 0.11


@pytest.mark.parametrize("scheme", [s for s in all_schemes() if s.w1 is not None], ids=lambda s: s.name)
def test_cat_joins_expert_slices_back(scheme):
    """``QTensor.cat`` is ``select``'s inverse: every stored field of every weight format has
    the expert dim (the GPU tests and the bench quantize a few experts at a time)."""
    g_idx = random_g_idx(3, 128, scheme.w1.granularity.group_size, seed=1) if scheme.w1.act_order else None
    q = quantize(torch.randn(3, 16, 128, generator=torch.Generator().manual_seed(0)), scheme.w1, g_idx=g_idx)
    back = QTensor.cat([q.select(e) for e in range(3)])
    assert back.shape == q.shape and back.tensors().keys() == q.tensors().keys()
    for name, t in q.tensors().items():
        assert torch.equal(back.tensors()[name].view(torch.uint8), t.view(torch.uint8)), name
    with pytest.raises(FusedMoEError, match="parts"):
        QTensor.cat([])
