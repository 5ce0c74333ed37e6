"""FP4 (e2m1) and the two formats built on it: MXFP4 and NVFP4.

e2m1 codec
    A 4-bit code is ``s e e m``: bit 3 the sign, bits 0-2 an index into the
    magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Encoding rounds to nearest with
    ties to the even code (values: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4) and saturates at +-6: e2m1 has no Inf or NaN,
    so Inf and NaN inputs encode as +-6. Two codes share a byte along the
    last dim, the even column in the low nibble (``pack_nibbles``; int4 uses
    the same helper).

MXFP4 (OCP Microscaling v1.0), group 32 along K::

    X  = 2^(floor(log2(amax(group))) - 2)        2 = emax of e2m1 (6 = 1.5 * 2^2)
    q  = e2m1(x / X)                             saturating, so amax/X in [4, 8) clips to 6
    x ~= e2m1_value(q) * X

    X is stored as its e8m0 code s = log2(X) + 127 (uint8, value 2^(s-127)),
    clamped to [0, 254] (255 is NaN). floor(log2(.)) is taken exactly with
    ``frexp``, not ``log2``, which rounds up just below a power of two. An
    all-zero group gets s = 127 (X = 1), the same rule as fp8/int8's scale 1.

NVFP4, group 16 along K, two-level scale::

    global_scale = amax(tensor) / (448 * 6)      fp32 [*B, 1, 1]; 1 when amax == 0
    block_scale  = e4m3(amax(block) / 6 / global_scale)        float8_e4m3fn
    q  = e2m1(x / (fp32(block_scale) * global_scale))
    x ~= e2m1_value(q) * fp32(block_scale) * global_scale

    The division uses the e4m3-*rounded* block scale, so what the kernel
    multiplies back is exactly what the quantizer divided by. A block whose
    scale is 0 (all zero, or too small for e4m3) stores code 0. Given
    (static) global scales are honoured, and then amax(block)/6/global_scale
    may exceed 448: the block scale saturates at 448 and the values at +-6.

K must be a multiple of the group; there are no partial MX/NV groups.
"""

from __future__ import annotations

import torch

from ..errors import expect
from .scheme import Granularity, TensorQuant
from .tensor import QTensor, check_scale_shape, expand_scale, group_amax

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
MXFP4_EMAX = 2  # largest e2m1 magnitude is 1.5 * 2^2
NVFP4_GLOBAL_DIV = E4M3_MAX * E2M1_MAX  # 2688

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Code c (0..7) is the number of rounding boundaries (midpoints of neighbours) that
# |x| is above. At a tie the even code wins: |x| = 0.75 must pass the 0.75 boundary
# (up to code 2) but |x| = 1.25 must not pass 1.25 (stays at code 2). So the
# boundaries below an even code are nudged one fp32 ulp down, and every test is
# then a strict ">", which is what bucketize(right=False) counts.
_E2M1_BOUNDS = [(0.25, False), (0.75, True), (1.25, False), (1.75, True)]
_E2M1_BOUNDS += [(2.5, False), (3.5, True), (5.0, False)]


def _e2m1_boundaries(device: torch.device) -> torch.Tensor:
    b = torch.tensor([v for v, _ in _E2M1_BOUNDS], dtype=torch.float32, device=device)
    to_even = torch.tensor([t for _, t in _E2M1_BOUNDS], device=device)
    return torch.where(to_even, torch.nextafter(b, torch.zeros_like(b)), b)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8, 0..15) of ``x``: round to nearest even, saturate at +-6."""
    mag = torch.bucketize(x.float().abs(), _e2m1_boundaries(x.device)).to(torch.uint8)
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of 4-bit e2m1 codes (any integer dtype, 0..15)."""
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=code.device)
    lut = torch.cat([mags, -mags])
    return lut[code.long()].to(dtype)


def pack_nibbles(code: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] of 4-bit codes -> uint8 [..., K/2], column 2j low nibble, 2j+1 high."""
    expect(code.shape[-1] % 2 == 0, "code", "an even last dim to pack two per byte", tuple(code.shape))
    c = code.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 [..., K/2] -> uint8 [..., K]."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


# ---- e8m0 shared exponents (also used by mxfp8) ---------------------------------


def mx_scale_code(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """e8m0 code (uint8) of the OCP MX scale 2^(floor(log2(amax)) - emax_elem); 127 if amax == 0."""
    _, e = torch.frexp(amax.float())  # amax = m * 2^e, m in [0.5, 1): floor(log2) = e - 1
    shared = torch.where(amax > 0, e - 1 - emax_elem, torch.zeros_like(e))
    return (shared.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 value 2^(code - 127) of e8m0 codes; code 255 is NaN."""
    c = code.view(torch.uint8) if code.dtype == torch.float8_e8m0fnu else code
    v = torch.exp2(c.float() - E8M0_BIAS)
    return torch.where(c == 255, torch.full_like(v, float("nan")), v)


def e8m0_reciprocal(code: torch.Tensor) -> torch.Tensor:
    """1 / 2^(code - 127) exactly (2^127 and 2^-127 are both representable in fp32)."""
    return torch.exp2(E8M0_BIAS - code.float())


def mx_static_code(scale: torch.Tensor, x: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """A given MX scale as e8m0 codes: uint8 / float8_e8m0fnu codes, or float powers of two."""
    scale = check_scale_shape(scale, x, tq.granularity)
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    m, e = torch.frexp(scale.float())
    expect(
        bool(((m == 0.5) & (e - 1).abs().le(E8M0_BIAS)).all()),
        "scale",
        "uint8 e8m0 codes or powers of two in [2^-127, 2^127]",
    )
    return (e - 1 + E8M0_BIAS).to(torch.uint8)


def ieee_div(a: torch.Tensor, c: float) -> torch.Tensor:
    """``a / c`` correctly rounded on every device.

    CUDA turns division by a Python scalar into multiplication by its reciprocal,
    which is an ulp off now and then, so CPU and GPU quantizers would disagree on
    scales (and then on bytes). Dividing by a tensor keeps IEEE division.
    """
    return a / torch.full_like(a, c)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dequantize in fp64 for an fp64 result (exact), else in fp32; round once at the end."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_group_multiple(x: torch.Tensor, tq: TensorQuant) -> None:
    g = tq.granularity.group_size
    expect(
        x.shape[-1] % g == 0,
        "x",
        f"a last dim (K) that is a multiple of the {tq.dtype.value} group size {g}",
        tuple(x.shape),
    )


# ---- MXFP4 -------------------------------------------------------------------------


class MXFormat:
    """An OCP MX format: ``emax`` of its element type, e8m0 scales; MXFP4 here, MXFP8 in ``mxfp8``.

    A subclass says how scaled fp32 values become stored codes (``encode``) and back (``decode``).
    """

    name: str
    emax: int

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def quantize(self, x, tq, *, scale=None, global_scale=None, g_idx=None) -> QTensor:
        expect(global_scale is None, "global_scale", f"None for {self.name}")
        expect(g_idx is None, "g_idx", f"None for {self.name}")
        check_group_multiple(x, tq)
        n, k = x.shape[-2], x.shape[-1]
        if scale is None:
            code = mx_scale_code(group_amax(x, tq.granularity), self.emax)
        else:
            code = mx_static_code(scale, x, tq)
        y = x.float() * expand_scale(e8m0_reciprocal(code), tq.granularity, n, k)
        return QTensor(data=self.encode(y), shape=tuple(x.shape), scale=code)

    def dequantize(self, q: QTensor, tq: TensorQuant, dtype: torch.dtype) -> torch.Tensor:
        n, k = q.shape[-2], q.shape[-1]
        ct = compute_dtype(dtype)
        s = expand_scale(e8m0_decode(q.scale).to(ct), tq.granularity, n, k)
        return (self.decode(q.data, ct) * s).to(dtype)


class _MXFP4(MXFormat):
    name, emax = "mxfp4", MXFP4_EMAX

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        return pack_nibbles(e2m1_encode(y))

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return e2m1_decode(unpack_nibbles(data), dtype)


# ---- NVFP4 -------------------------------------------------------------------------


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """The NVFP4 global (dequantization) scale amax / (448 * 6), fp32; 1 where amax == 0."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(a > 0, ieee_div(a, NVFP4_GLOBAL_DIV), torch.ones_like(a))


def _global_scale_for(x: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    want = (*x.shape[:-2], 1, 1)
    if global_scale is None:
        return nvfp4_global_scale(group_amax(x, Granularity.tensor()))  # T = 0 gives 1
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if gs.numel() == 1:
        return gs.reshape(1, 1).expand(want) if len(want) > 2 else gs.reshape(want)
    n = 1
    for d in want:
        n *= d
    expect(gs.numel() == n, "global_scale", f"1 or {n} elements for shape {want}", tuple(gs.shape))
    return gs.reshape(want)


class _NVFP4:
    def quantize(self, x, tq, *, scale=None, global_scale=None, g_idx=None) -> QTensor:
        expect(g_idx is None, "g_idx", "None for nvfp4")
        check_group_multiple(x, tq)
        n, k = x.shape[-2], x.shape[-1]
        xf = x.float()
        gs = _global_scale_for(x, global_scale)
        if scale is None:
            sb = group_amax(xf, tq.granularity) / (E2M1_MAX * gs)
        else:
            expect(global_scale is not None, "global_scale", "given with a static nvfp4 block scale")
            sb = check_scale_shape(scale, x, tq.granularity).float()
        sb = sb.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        d = expand_scale(sb.float() * gs, tq.granularity, n, k)
        y = torch.where(d > 0, xf / d, torch.zeros_like(xf))
        return QTensor(
            data=pack_nibbles(e2m1_encode(y)),
            shape=tuple(x.shape),
            scale=sb,
            global_scale=gs.contiguous(),
        )

    def dequantize(self, q: QTensor, tq: TensorQuant, dtype: torch.dtype) -> torch.Tensor:
        n, k = q.shape[-2], q.shape[-1]
        ct = compute_dtype(dtype)
        d = expand_scale((q.scale.float() * q.global_scale.float()).to(ct), tq.granularity, n, k)
        return (e2m1_decode(unpack_nibbles(q.data), ct) * d).to(dtype)


mxfp4 = _MXFP4()
nvfp4 = _NVFP4()
