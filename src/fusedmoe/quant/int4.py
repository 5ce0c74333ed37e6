"""INT4 weights with per-group scales, and the GPTQ / AWQ / compressed-tensors packers.

Canonical storage (what ``quantize`` returns and every packer converts to and from)::

    data   uint8 [*B, N, K/2]   unsigned codes c in 0..15, column 2j in the low nibble
    scale  fp32  [*B, N, G]     G = K/g (any Granularity works; group(g) is the usual one)
    zero   uint8 [*B, N, G]     asymmetric only; None means the symmetric zero 8
    g_idx  int32 [*B, K]        act-order only: the group of input column k

    x ~= (c - zero) * scale[group(k)]

Symmetric (GPTQ, ``TensorQuant.symmetric``): q = c - 8 in [-8, 7] and::

    scale = amax / 7.5  (= 2 amax / 15),   c = clamp(round(x / scale) + 8, 0, 15)

This is GPTQ's own rule (AutoGPTQ ``auto_gptq/quantization/quantizer.py``,
``find_params`` with sym=True: xmin = -xmax, scale = (xmax - xmin) / 15,
zero = 8). It uses all 16 levels and only +amax clips (7.5 -> 7), by half a
step, so every element is within scale/2 = amax/15. amax/7 never clips but has
a worst case of amax/14 and leaves code 0 unused.

Asymmetric (AWQ-style zero points, ``symmetric=False``), GPTQ's asymmetric rule,
which widens the range to contain 0 so that 0 is exact and the zero point is an
integer code::

    lo = min(0, min(group)),  hi = max(0, max(group))
    scale = (hi - lo) / 15,   zero = round(-lo / scale),   c = clamp(round(x / scale) + zero, 0, 15)

Error <= scale/2. An all-zero group gets scale 1 (both rules) and zero 8.

Act-order (``TensorQuant.act_order``, GPTQ desc_act): the group of column k is
``g_idx[k]``, so groups are not contiguous; scales stay [*B, N, G] indexed by
group id. With no g_idx given, the identity map k // g is used and stored.

Checkpoint packers, each a pair of pure functions that are exact inverses on the
checkpoint side (``pack(unpack(ckpt)) == ckpt`` bit for bit; the other way round
also holds when the scales are representable in the checkpoint's scale dtype).
Shapes are per expert [N, K] (N = out features); leading batch dims pass through.

GPTQ (v1 checkpoints; checked against AutoGPTQ
``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` ``QuantLinear.pack`` and
AutoAWQ ``awq/utils/packing_utils.py`` ``pack_exllama``)::

    qweight int32 [K/8, N]   packed along K: nibble i (bits 4i..4i+3) of word j = row 8j + i
    qzeros  int32 [G, N/8]   packed along N, same nibble order, storing zero - 1
    scales  fp16  [G, N]
    g_idx   int32 [K]

    The "- 1" is the v1 format's quirk (kernels add 1 back). A zero of 0 is stored
    as nibble 15 and read back as 0 here; AutoGPTQ's kernels would read 16, which
    is why GPTQModel introduced v2. Symmetric checkpoints store 7 (0x77777777).

AWQ (GEMM format; checked against AutoAWQ ``awq/utils/packing_utils.py``:
``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``, ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``)::

    qweight int32 [K, N/8]   packed along N: nibble i of word j = column 8j + AWQ_ORDER[i]
    qzeros  int32 [G, N/8]   same order, the zero itself (no - 1)
    scales  fp16  [G, N]

compressed-tensors "pack-quantized" (checked against the installed
``compressed_tensors/compressors/pack_quantized/helpers.py`` ``pack_to_int32``:
signed q + 8, element i at bits 4i of word i // 8, zero-padded)::

    weight_packed     int32 [N, ceil(K/8)]   packed along K (codes c, since c = q + 8)
    weight_scale            [N, G]
    weight_zero_point int32 [ceil(N/8), G]   asymmetric only, packed along N, storing zero
    weight_g_idx      int32 [K]              act-order only
    weight_shape      int64 [2]              (N, K)
"""

from __future__ import annotations

import torch

from ..errors import expect
from .fp4 import compute_dtype, ieee_div, pack_nibbles, unpack_nibbles
from .scheme import TensorQuant
from .tensor import QTensor, check_scale_shape, expand_scale, group_amax

QMAX = 15
SYM_ZERO = 8
SYM_DIV = 7.5  # scale = amax / 7.5, GPTQ's symmetric rule (see the module docstring)

SEQ_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits in nibble AWQ_REVERSE_ORDER[c]


# ---- quantize / dequantize --------------------------------------------------------


def _group_index(x: torch.Tensor, tq: TensorQuant, g_idx: torch.Tensor | None) -> torch.Tensor | None:
    """The validated act-order map as int32 [*B, K], or None without act-order."""
    if not tq.act_order:
        expect(g_idx is None, "g_idx", "None unless TensorQuant.act_order")
        return None
    batch, k = tuple(x.shape[:-2]), x.shape[-1]
    g = tq.granularity.group_size
    if g_idx is None:
        g_idx = torch.arange(k, device=x.device) // g
    g_idx = g_idx.to(x.device)
    if g_idx.dim() == 1 and batch:
        g_idx = g_idx.expand(*batch, k)
    expect(tuple(g_idx.shape) == (*batch, k), "g_idx", f"shape {(*batch, k)}", tuple(g_idx.shape))
    expect(bool(((g_idx >= 0) & (g_idx < k // g)).all()), "g_idx", f"group ids in [0, {k // g})")
    return g_idx.to(torch.int32).contiguous()


def _gather(s: torch.Tensor, g_idx: torch.Tensor, n: int) -> torch.Tensor:
    """[*B, N, G] -> [*B, N, K] with column k taking group g_idx[k]."""
    idx = g_idx.long().unsqueeze(-2).expand(*g_idx.shape[:-1], n, g_idx.shape[-1])
    return s.gather(-1, idx)


def _group_max(a: torch.Tensor, tq: TensorQuant, g_idx: torch.Tensor | None) -> torch.Tensor:
    """max of the non-negative ``a`` [*B, N, K] over each group, in the scale shape."""
    if g_idx is None:
        return group_amax(a, tq.granularity)
    groups = a.shape[-1] // tq.granularity.group_size
    idx = g_idx.long().unsqueeze(-2).expand_as(a)
    out = a.new_zeros(*a.shape[:-1], groups)
    return out.scatter_reduce(-1, idx, a, reduce="amax")


class _Int4:
    def quantize(self, x, tq, *, scale=None, global_scale=None, g_idx=None) -> QTensor:
        expect(global_scale is None, "global_scale", "None for int4")
        n, k = x.shape[-2], x.shape[-1]
        expect(k % 2 == 0, "x", "an even last dim (K) to pack two int4 per byte", tuple(x.shape))
        if tq.granularity.kind == "group":
            g = tq.granularity.group_size
            expect(
                k % g == 0,
                "x",
                f"a last dim (K) that is a multiple of the int4 group size {g}",
                tuple(x.shape),
            )
        gi = _group_index(x, tq, g_idx)

        def expand(s: torch.Tensor) -> torch.Tensor:
            return _gather(s, gi, n) if gi is not None else expand_scale(s, tq.granularity, n, k)

        xf = x.float()
        if scale is not None:
            scale = check_scale_shape(scale, x, tq.granularity).float()
        if tq.symmetric:
            zero = None
            if scale is None:
                amax = _group_max(xf.abs(), tq, gi)
                scale = torch.where(amax > 0, ieee_div(amax, SYM_DIV), torch.ones_like(amax))
            z = torch.full_like(scale, SYM_ZERO)
        else:
            hi = _group_max(xf.clamp(min=0), tq, gi)
            lo = -_group_max((-xf).clamp(min=0), tq, gi)
            span = hi - lo
            if scale is None:
                scale = torch.where(span > 0, ieee_div(span, QMAX), torch.ones_like(span))
            z = torch.where(span > 0, torch.round(-lo / scale).clamp(0, QMAX), torch.full_like(span, SYM_ZERO))
            zero = z.to(torch.uint8)
        c = (torch.round(xf / expand(scale)) + expand(z)).clamp_(0, QMAX).to(torch.uint8)
        return QTensor(data=pack_nibbles(c), shape=tuple(x.shape), scale=scale, zero=zero, g_idx=gi)

    def dequantize(self, q: QTensor, tq: TensorQuant, dtype: torch.dtype) -> torch.Tensor:
        n, k = q.shape[-2], q.shape[-1]
        ct = compute_dtype(dtype)
        s = q.scale.to(ct)
        z = torch.full_like(s, SYM_ZERO) if q.zero is None else q.zero.to(ct)
        if q.g_idx is not None:
            z, s = _gather(z, q.g_idx, n), _gather(s, q.g_idx, n)
        else:
            z, s = expand_scale(z, tq.granularity, n, k), expand_scale(s, tq.granularity, n, k)
        return ((unpack_nibbles(q.data).to(ct) - z) * s).to(dtype)


int4 = _Int4()


# ---- int32 words of eight nibbles ---------------------------------------------------


def _inverse(order: tuple[int, ...]) -> list[int]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


def pack_int32(c: torch.Tensor, order: tuple[int, ...] = SEQ_ORDER) -> torch.Tensor:
    """Codes [..., M] (0..15) -> int32 [..., ceil(M/8)]: nibble i of word j = c[8j + order[i]].

    The last word is zero-padded. Words are two's-complement int32 (a code >= 8 in
    nibble 7 makes the word negative), as checkpoints store them.
    """
    m = c.shape[-1]
    c = torch.nn.functional.pad(c.to(torch.int64) & 0xF, (0, -m % 8))
    c = c.unflatten(-1, (-1, 8))[..., list(order)]
    shifts = torch.arange(0, 32, 4, device=c.device, dtype=torch.int64)
    w = (c << shifts).sum(dim=-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def unpack_int32(w: torch.Tensor, m: int, order: tuple[int, ...] = SEQ_ORDER) -> torch.Tensor:
    """Inverse of ``pack_int32``: int32 [..., ceil(M/8)] -> int64 codes [..., M]."""
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int64)
    nib = ((w.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & 0xF
    return nib[..., _inverse(order)].flatten(-2)[..., :m]


# ---- checkpoint packers -------------------------------------------------------------


def _parts(q: QTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int64 [*B,N,K], scale [*B,N,G], zero int64 [*B,N,G]) of a per-row-group QTensor."""
    n, k = q.shape[-2], q.shape[-1]
    expect(
        q.scale is not None and q.scale.shape[-2] == n and k % q.scale.shape[-1] == 0,
        "q.scale",
        f"a group or channel scale [*B, {n}, G] with G dividing K={k}",
        None if q.scale is None else tuple(q.scale.shape),
    )
    zero = torch.full(q.scale.shape, SYM_ZERO, dtype=torch.int64, device=q.scale.device)
    if q.zero is not None:
        zero = q.zero.to(torch.int64)
    return unpack_nibbles(q.data).to(torch.int64), q.scale, zero


def _canonical(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    symmetric: bool,
    what: str,
) -> QTensor:
    k = codes.shape[-1]
    g = k if group_size in (-1, 0) else group_size
    expect(
        scale.shape[-1] == -(-k // g),
        f"{what} scales",
        f"{-(-k // g)} groups for K={k}, group_size={g}",
        tuple(scale.shape),
    )
    if symmetric:
        expect(
            bool((zero == SYM_ZERO).all()),
            f"{what} zeros",
            "all 8 for a symmetric checkpoint (symmetric=False keeps them)",
        )
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if bool((g_idx == torch.arange(k, device=g_idx.device) // g).all()):
            g_idx = None
    return QTensor(
        data=pack_nibbles(codes.to(torch.uint8)),
        shape=tuple(codes.shape),
        scale=scale.float(),
        zero=None if symmetric else zero.to(torch.uint8),
        g_idx=None if g_idx is None else g_idx.contiguous(),
    )


def _expect_multiple_of_8(n: int, k: int, what: str) -> None:
    expect(n % 8 == 0 and k % 8 == 0, what, "N and K multiples of 8 (eight nibbles per int32)", (n, k))


def pack_gptq(q: QTensor, scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Canonical int4 [*B, N, K] -> GPTQ v1 ``qweight``, ``qzeros``, ``scales``, ``g_idx``."""
    codes, scale, zero = _parts(q)
    n, k = q.shape[-2], q.shape[-1]
    _expect_multiple_of_8(n, k, "pack_gptq q.shape")
    g_idx = q.g_idx
    if g_idx is None:
        g_idx = (torch.arange(k, device=codes.device) // (k // scale.shape[-1])).to(torch.int32)
        g_idx = g_idx.expand(*codes.shape[:-2], k)
    return {
        "qweight": pack_int32(codes).transpose(-1, -2).contiguous(),
        "qzeros": pack_int32((zero - 1).transpose(-1, -2)),
        "scales": scale.transpose(-1, -2).to(scale_dtype).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    *,
    symmetric: bool = True,
) -> QTensor:
    """GPTQ v1 tensors -> canonical int4. ``group_size`` -1 means one group per row.

    ``g_idx`` equal to k // group_size is dropped (no act-order); symmetric=True
    checks every zero is 8 and stores none.
    """
    k, n = qweight.shape[-2] * 8, qweight.shape[-1]
    codes = unpack_int32(qweight.transpose(-1, -2), k)
    zero = ((unpack_int32(qzeros, n) + 1) & 0xF).transpose(-1, -2)
    return _canonical(codes, scales.transpose(-1, -2), zero, g_idx, group_size, symmetric, "gptq")


def pack_awq(q: QTensor, scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Canonical int4 [*B, N, K] -> AWQ GEMM tensors ``qweight``, ``qzeros``, ``scales``."""
    expect(q.g_idx is None, "q.g_idx", "None: AWQ checkpoints have no act-order")
    codes, scale, zero = _parts(q)
    _expect_multiple_of_8(q.shape[-2], q.shape[-1], "pack_awq q.shape")
    return {
        "qweight": pack_int32(codes.transpose(-1, -2), AWQ_ORDER),
        "qzeros": pack_int32(zero.transpose(-1, -2), AWQ_ORDER),
        "scales": scale.transpose(-1, -2).to(scale_dtype).contiguous(),
    }


def unpack_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    *,
    symmetric: bool = False,
) -> QTensor:
    """AWQ GEMM tensors -> canonical int4 (zero points kept unless symmetric=True)."""
    n = qweight.shape[-1] * 8
    codes = unpack_int32(qweight, n, AWQ_ORDER).transpose(-1, -2)
    zero = unpack_int32(qzeros, n, AWQ_ORDER).transpose(-1, -2)
    return _canonical(codes, scales.transpose(-1, -2), zero, None, group_size, symmetric, "awq")


def pack_compressed_tensors(q: QTensor, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Canonical int4 -> compressed-tensors pack-quantized ``weight_*`` tensors.

    Written here rather than calling compressed-tensors, so it needs no extra
    package; tests compare it with the library's ``pack_to_int32``.
    """
    codes, scale, zero = _parts(q)
    out = {
        "weight_packed": pack_int32(codes),
        "weight_scale": scale.to(scale_dtype).contiguous(),
        "weight_shape": torch.tensor(q.shape[-2:], dtype=torch.int64),
    }
    if q.zero is not None:
        out["weight_zero_point"] = pack_int32(zero.transpose(-1, -2)).transpose(-1, -2).contiguous()
    if q.g_idx is not None:
        out["weight_g_idx"] = q.g_idx
    return out


def unpack_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int],
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> QTensor:
    """compressed-tensors pack-quantized tensors -> canonical int4 (group size = K / G)."""
    n, k = (int(d) for d in tuple(weight_shape)[-2:])
    codes = unpack_int32(weight_packed, k)
    g = k // weight_scale.shape[-1]
    if weight_zero_point is None:
        zero = torch.full(weight_scale.shape, SYM_ZERO, dtype=torch.int64, device=weight_scale.device)
    else:
        zero = unpack_int32(weight_zero_point.transpose(-1, -2), n).transpose(-1, -2)
    return _canonical(codes, weight_scale, zero, weight_g_idx, g, weight_zero_point is None, "compressed-tensors")
