"""Helpers shared by the kernel families: where kernels run, and jit decode/encode helpers."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True under the Triton interpreter (``TRITON_INTERPRET=1``, read when Python starts)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- jit helpers: decoding stored formats (used by the GEMM and the quantizers) -------------


@triton.jit
def unpack_nibbles(row_ptrs, row_ok, k0, K, stride_k, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """4-bit codes (int32 [R, BLOCK_K]) of columns k0.. of rows packed two per byte along K
    (low nibble = even column). Loads whole bytes, [R, BLOCK_K / 2], so K-contiguous rows
    vectorise; K and k0 are even."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = row_ok[:, None] & (kb < K // 2)[None, :]
    byte = tl.load(row_ptrs[:, None] + kb[None, :] * stride_k, mask=mask, other=0).to(tl.int32)
    return tl.reshape(tl.join(byte & 0xF, (byte >> 4) & 0xF), [R, BLOCK_K])


@triton.jit
def e2m1_to_f32(code):
    """e2m1 code (int32; bit 3 = sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6) -> float32.

    The three magnitude bits, placed as fp16's two low exponent bits and top mantissa
    bit, are the value times 2^-14 (exponent 0 being fp16's subnormal 0.5 * 2^-14): four
    integer ops and one multiply instead of a decode with selects.
    """
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_to_f32(s):
    """e8m0 exponent (uint8) -> 2^(s - 127), exactly, by placing s in the float32 exponent.

    s = 0 (2^-127, below float32's normal range) gives 0, as a GPU flushing subnormals would.
    """
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
