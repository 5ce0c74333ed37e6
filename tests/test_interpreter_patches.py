"""The interpreter patches do what they claim (bf16 dot, RNE/satfinite casts)."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the CPU interpreter patches")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(x_ptr, bf_ptr, f8_ptr, n: tl.constexpr):
    r = tl.arange(0, n)
    x = tl.load(x_ptr + r)
    tl.store(bf_ptr + r, x.to(tl.bfloat16))
    tl.store(f8_ptr + r, x.to(tl.float8e4nv))


def test_bf16_dot_is_right():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 32, generator=g).bfloat16()
    b = torch.randn(32, 16, generator=g).bfloat16()
    c = torch.full((16, 16), float("nan"))
    _dot_kernel[(1,)](a, b, c, 16, 16, 32)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def test_downcasts_round_like_the_gpu():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1024, generator=g) * 100
    x[:4] = torch.tensor([31.6, 126.3, 1000.0, -1e6])  # carries and saturation
    bf = torch.empty(1024, dtype=torch.bfloat16)
    f8 = torch.empty(1024, dtype=torch.float8_e4m3fn)
    _cast_kernel[(1,)](x, bf, f8, 1024)
    assert torch.equal(bf, x.bfloat16())
    assert torch.equal(f8.float(), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
