"""The PTX of the w4 GEMM's fast unpack (``kernels/_w4_unpack.py``), run on the CPU by a model of
its instructions (``ptx_model.py``) for every byte value, against the dequantization it replaces:
int4 (c - zero) * scale rounded once to bf16/fp16, e2m1 value * scale (exact). The GPU tests of
the GEMM (``test_kernels_gemm_w4.py``, gpu marker) run the same strings through ptxas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from ptx_model import _bf16_to_f64, _f16_to_f64, _f64_to_bf16, _f64_to_f16, run

from fusedmoe.kernels._w4_operands import _bf16_pair, _e2m1_bits
from fusedmoe.kernels._w4_unpack import e2m1_ptx, int4_ptx

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
CODEC = {"bf16": (_f64_to_bf16, _bf16_to_f64, 128.0), "f16": (_f64_to_f16, _f16_to_f64, 1024.0)}


def _pairs(rng: np.random.Generator, n: int):
    """Every byte value in both lanes of an instance (the two bytes of one register)."""
    b0 = np.tile(np.arange(256), n // 256 + 1)[:n]
    b1 = rng.permutation(b0)
    return b0.astype(np.uint32), b1.astype(np.uint32)


def _lanes(enc, x0, x1) -> np.ndarray:
    """Two values as one register of two 16-bit lanes (element 0 low)."""
    return enc(x0) | (enc(x1) << 16)


def _split(enc, dec, x):
    hi = enc(x)
    return hi, enc(x - dec(hi))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("split", [False, True], ids=["scale_16bit", "scale_split"])
def test_int4_unpack_matches_one_rounding(dtype, split):
    enc, dec, magic = CODEC[dtype]
    rng = np.random.default_rng(0)
    n = 4096
    b0, b1 = _pairs(rng, n)
    zero = rng.integers(0, 16, size=(2, 2, n)).astype(np.float64)  # [half lo/hi, element, n]
    # scales: GPTQ-like magnitudes; not 16-bit values unless the scale is stored as one
    s = rng.uniform(1e-4, 2e-2, size=(2, 2, n))
    if not split:
        s = dec(enc(s))
    ins = [b0 | (b1 << 8)]
    ins += [_lanes(enc, -(magic + zero[h, 0]), -(magic + zero[h, 1])) for h in range(2)]
    hi_parts = [[_split(enc, dec, s[h, e]) for e in range(2)] for h in range(2)]
    ins += [hi_parts[h][0][0] | (hi_parts[h][1][0] << 16) for h in range(2)]
    if split:
        ins += [hi_parts[h][0][1] | (hi_parts[h][1][1] << 16) for h in range(2)]
    lo, hi = run(int4_ptx(dtype, split), ins, 2)
    for h, out in enumerate((lo, hi)):
        for e, byte in enumerate((b0, b1)):
            code = ((byte >> (4 * h)) & 0xF).astype(np.float64)
            want = (code - zero[h, e]) * s[h, e]
            got = dec((out >> (16 * e)) & 0xFFFF)
            if not split:
                np.testing.assert_array_equal(got, dec(enc(want)))  # the product, rounded once
            else:
                # s_hi + s_lo carries ~16 bits of the scale: at most a hair over half a unit in
                # the last place of the rounded product; in fp16 s_lo of a scale below ~0.1 is
                # subnormal (spacing 2^-24): |c - zero| <= 15 times half of that on top
                ulp = np.abs(dec(enc(want))) * (2.0**-7 if dtype == "bf16" else 2.0**-10)
                sub = 0.0 if dtype == "bf16" else 15 * 2.0**-25 * 2
                assert np.all(np.abs(got - want) <= 0.5 * ulp * (1 + 2.0**-5) + sub)
                assert np.mean(got == dec(enc(want))) > (0.99 if dtype == "bf16" else 0.97)


def _e2m1_scales(rng: np.random.Generator, shape, two_muls: bool = True):
    """e8m0 scales over the range weights use and both ends of bf16's, and e4m3 values (NVFP4);
    at most 2 for the one-multiply form."""
    pow2 = 2.0 ** rng.integers(-126, 126 if two_muls else 2, size=shape).astype(np.float64)
    e4m3 = torch.randint(0, 126 if two_muls else 65, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return [np.where(s == 0, 1.0, s) for s in (pow2, e4m3.double().numpy())]


def _assert_e2m1(got: np.ndarray, byte: np.ndarray, high: int, s: np.ndarray):
    want = E2M1[(byte >> (4 * high)) & 0xF] * s
    ok = np.abs(want) < 2.0**127  # products past bf16's range are not asked for
    np.testing.assert_array_equal(got[ok], want[ok])
    assert np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))  # -0 stays -0


def _operand(s: np.ndarray, two_muls: bool) -> np.ndarray:
    """The scale the kernel passes: 2^126 folded in for the one-multiply form (which it takes
    only when every scale is <= 2, ``W4Tensor.e2m1_one_mul``)."""
    return s if two_muls else s * 2.0**126


@pytest.mark.parametrize("two_muls", [True, False], ids=["two_muls", "one_mul"])
def test_e2m1_unpack_is_exact(two_muls):
    """The tensor cores' form: two bytes an instance, bf16 pairs out."""
    rng = np.random.default_rng(1)
    n = 4096
    b0, b1 = _pairs(rng, n)
    for s in _e2m1_scales(rng, (2, 2, n), two_muls):
        t = _operand(s, two_muls)
        ins = [b0 | (b1 << 8)] + [_lanes(_f64_to_bf16, t[h, 0], t[h, 1]) for h in range(2)]
        for h, out in enumerate(run(e2m1_ptx(two_muls=two_muls), ins, 2)):
            for e, byte in enumerate((b0, b1)):
                _assert_e2m1(_bf16_to_f64((out >> (16 * e)) & 0xFFFF), byte, h, s[h, e])


@pytest.mark.parametrize("two_muls", [True, False], ids=["two_muls", "one_mul"])
def test_e2m1_unpack_f32_is_exact(two_muls):
    """The FMA path's form: one word (four bytes of a W row) an instance, eight fp32 values out,
    one scale per half."""
    rng = np.random.default_rng(2)
    n = 4096
    b0, b1 = _pairs(rng, n)
    b2, b3 = rng.permutation(b0), rng.permutation(b1)
    for s in _e2m1_scales(rng, (2, n), two_muls):
        t = _operand(s, two_muls)
        ins = [b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)] + [_lanes(_f64_to_bf16, t[h], t[h]) for h in range(2)]
        outs = run(e2m1_ptx("f32", two_muls), ins, 8)
        for h in range(2):
            for e, byte in enumerate((b0, b1, b2, b3)):
                _assert_e2m1(outs[4 * h + e].view(np.float32).astype(np.float64), byte, h, s[h])


def test_model_rejects_what_ptxas_rejects():
    """fma with an immediate float operand does not assemble (ptxas: 'Arguments mismatch')."""
    with pytest.raises(AssertionError, match="immediate"):
        run("{ fma.rn.bf16x2 $0, $1, 0x3F803F80, $1; }", [np.zeros(2, dtype=np.uint32)], 1)


@triton.jit
def _scale_bits_kernel(s_ptr, bits_ptr, pair_ptr, W_FMT: tl.constexpr, SPLIT: tl.constexpr):
    offs = tl.arange(0, 256)
    bits = _e2m1_bits(tl.load(s_ptr + offs), W_FMT, SPLIT)
    tl.store(bits_ptr + offs, bits)
    tl.store(pair_ptr + offs, _bf16_pair(bits))


@pytest.mark.parametrize(("w_fmt", "split"), [("mxfp4", True), ("mxfp4", False), ("nvfp4", True)])
def test_scale_bits_are_the_decoded_scale_in_bf16(w_fmt, split):
    """The scale operand's bf16 bits, made from the stored code by integer work (MXFP4) or from the
    decoded scale (NVFP4), equal the float decode's (the scale, or 2^126 times it where
    ``e2m1_one_mul`` holds: e8m0 codes <= 128) for every code; the pair holds them in both lanes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    bits, pair = torch.empty(256, dtype=torch.int32), torch.empty(256, dtype=torch.int32)
    # MXFP4 takes the stored codes, NVFP4 its decoded scales
    s_in = codes if w_fmt == "mxfp4" else codes.view(torch.float8_e4m3fn).float()
    _scale_bits_kernel[(1,)](s_in, bits, pair, W_FMT=w_fmt, SPLIT=split)
    if w_fmt == "mxfp4":
        s = torch.where(codes == 0, 0.0, torch.exp2(codes.double() - 127))  # e8m0_to_f32 flushes code 0
    else:
        s = codes.view(torch.float8_e4m3fn).double()
    want = (s if split else s * 2.0**126).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    keep = torch.ones(256, dtype=torch.bool) if split else codes <= 128
    if w_fmt == "nvfp4":
        keep &= ~s.isnan()
    assert torch.equal(bits[keep] & 0xFFFF, want[keep])
    assert torch.equal(pair[keep], (want[keep] | (want[keep] << 16)).int())
