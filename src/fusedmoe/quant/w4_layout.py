"""The w4 kernel layout of 4-bit weights (int4, MXFP4, NVFP4): ``to_w4`` and its exact inverse.

The reference layout (``quant.tensor``) packs columns 2j and 2j+1 of a row into byte j (low
nibble first). A kernel that splits such bytes gets [BN, BK/2, 2] and must interleave the two
halves (join + reshape) into [BN, BK] before the dot: a register shuffle, and a layout that the
compiler cannot carry straight into the dot operand. The w4 layout packs along K by *blocks*
of ``pack_block`` (PK) columns instead::

    block b = columns [b*PK, (b+1)*PK) of a row;  byte j of the block (j < PK/2) holds
    column b*PK + j in its low nibble and column b*PK + PK/2 + j in its high nibble

so one [BN, PK/2] byte tile gives two [BN, PK/2] operands by ``& 0xF`` and ``>> 4``: each
multiplies its own half of the A tile (two dots per block into one accumulator), no shuffle.
PK is chosen so a half (PK/2 columns) lies inside one scale group, or covers whole groups:
then each half takes one scale per row (``half_block``). The kernel's K step is a multiple of PK.

What ``to_w4`` stores (``W4Tensor``, a ``QTensor`` whose ``layout`` says so):

    data   int32 [E, N, Kp/8]   the packed bytes (4 per word; the kernel reads them as uint8
                                [E, N, Kp/2]); int32, so that code reading it as the reference
                                layout (uint8 [E, N, K/2]) fails on shapes instead of computing
                                with the wrong nibbles
    scale  [E, N, Kp/g]         as given (fp32 / e8m0 codes / e4m3), zero-padded groups
    zero   uint8 [E, N, Kp/g]   int4 zero points, as given (padded with 8)
    global_scale                NVFP4, untouched
    perm   int32 [E, Kp]        act-order only: column of the reference layout at each position
    g_idx  int32 [E, Kp]        act-order only: group of each stored position, j // g (so
                                checks that act-order weights carry a group map still pass)

Kp is K rounded up to PK; the padded columns hold code 0 with scale 0 (their products are 0;
the kernel also masks A there). Act-order (GPTQ desc_act, ``g_idx``): each expert's columns
are sorted by group (stable), so group i is positions [i*g, (i+1)*g) as without act-order,
and the kernel gathers A's columns through ``perm``. That needs every group to hold exactly
g columns (GPTQ's own maps do); ``convertible`` says why not otherwise.

``from_w4(to_w4(q))`` equals ``q`` bit for bit (tested), g_idx included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import expect
from .fp4 import pack_nibbles, unpack_nibbles
from .scheme import QDtype, TensorQuant
from .tensor import QTensor

LAYOUT = "w4_kblock"
W4_DTYPES = (QDtype.INT4, QDtype.MXFP4, QDtype.NVFP4)
W4_FORMATS = {QDtype.INT4: "int4", QDtype.MXFP4: "mxfp4", QDtype.NVFP4: "nvfp4"}  # the kernel's names
MIN_HALF = 16  # tl.dot's smallest K for 16-bit operands: a half block is one dot


@dataclass
class W4Tensor(QTensor):
    """A 4-bit ``QTensor`` in the w4 kernel layout (module docstring). ``shape`` stays logical."""

    pack_block: int = 128
    perm: torch.Tensor | None = None
    group_size: int = 0
    w_fmt: str = "int4"  # "int4" | "mxfp4" | "nvfp4" (the kernel's name of the 4-bit format)
    # e2m1 formats: every scale times 2^126 is a bf16 value (scales <= 2; ``e2m1_one_mul``), so
    # the kernel's unpack multiplies once instead of twice. Set by ``to_w4`` when the weights are
    # converted; False (two multiplies, right for any scale) where nobody looked.
    e2m1_one_mul: bool = False
    layout: str = LAYOUT

    @property
    def half_block(self) -> int:
        return self.pack_block // 2

    @property
    def k_padded(self) -> int:
        return self.data.shape[-1] * 8

    def bytes_u8(self) -> torch.Tensor:
        """The packed bytes as the kernel reads them, uint8 [E, N, Kp/2] (a view)."""
        return self.data.view(torch.uint8)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = super().tensors()
        if self.perm is not None:
            out["perm"] = self.perm
        return out

    def to(self, device) -> W4Tensor:
        moved = super().to(device)
        return replace(moved, perm=None if self.perm is None else self.perm.to(device))

    def select(self, e: int) -> W4Tensor:
        one = super().select(e)
        perm = None if self.perm is None else self.perm[e : e + 1]
        extra = {"pack_block": self.pack_block, "perm": perm, "group_size": self.group_size, "w_fmt": self.w_fmt,
                 "e2m1_one_mul": self.e2m1_one_mul}  # fmt: skip
        return W4Tensor(**one.__dict__, **extra)


def default_pack_block(tq: TensorQuant) -> int:
    """PK for weights quantized as ``tq``; K is padded to a multiple of it.

    A half block (PK/2) of min(group, 64) columns, so each half takes one scale per row: int4
    g128 PK 128, MXFP4 (group 32) PK 64. NVFP4's group of 16 would make 16-column dots and
    16-byte loads; halves of two groups (PK 64, scales broadcast per group) measured faster on
    an H100 (Qwen3-30B-A3B at T = 4096: GEMM1 0.91 vs 1.10 ms, GEMM2 0.54 vs 0.58 ms; T = 1:
    29 vs 33 us and 18 vs 20 us). MXFP4 with PK 128 was faster at T = 1 (Mixtral GEMM1 112 vs
    133 us: the FMA path steps one pack block) but slower from T = 256 (Qwen3 GEMM2 at T = 1024:
    300 vs 215 us), so it keeps 64.
    """
    g = tq.granularity.group_size
    if g < 32:
        return 4 * g
    return 2 * min(g, 64)


def convertible(tq: TensorQuant | None, q: QTensor | None = None, pack_block: int | None = None) -> str | None:
    """None if weights quantized as ``tq`` (and, given, the tensor ``q``) can take the w4 layout."""
    if tq is None or tq.dtype not in W4_DTYPES:
        return f"w4 layout is for {[d.value for d in W4_DTYPES]} weights, got {None if tq is None else tq.dtype}"
    if tq.granularity.kind != "group":
        return f"w4 layout needs group scales, got {tq.granularity!r}"
    g = tq.granularity.group_size
    if g & (g - 1) or g < MIN_HALF:
        return f"w4 layout needs a power-of-2 group >= {MIN_HALF}, got {g}"
    pk = pack_block or default_pack_block(tq)
    half = pk // 2
    if pk & (pk - 1) or half < MIN_HALF or (g % half and half % g):
        return f"pack_block {pk}: a power of 2 whose half (>= {MIN_HALF}) divides or is a multiple of the group {g}"
    if q is not None and tq.act_order:
        if q.g_idx is None:
            return "act-order weights without g_idx"
        rows = q.g_idx.reshape(-1, q.shape[-1]).long()
        counts = torch.zeros(rows.shape[0], q.shape[-1] // g, dtype=torch.int64, device=rows.device)
        counts.scatter_add_(1, rows, torch.ones_like(rows))
        if not bool((counts == g).all()):
            return f"act-order groups of unequal sizes (every group must hold {g} columns)"
    return None


def _pad_last(t: torch.Tensor, size: int, fill: int = 0) -> torch.Tensor:
    """``t`` with its last dim padded to ``size`` with the byte/value ``fill`` (any dtype, fp8 included)."""
    if t.shape[-1] == size:
        return t.contiguous()
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    out = raw.new_full((*t.shape[:-1], size), fill)
    out[..., : t.shape[-1]] = raw
    return out.view(t.dtype) if t.element_size() == 1 else out


def _block_order(kp: int, pk: int, device) -> torch.Tensor:
    """Reference column of each (byte, nibble) slot, in byte order: [Kp] = lo0, hi0, lo1, hi1, ...

    Byte j of block b holds columns b*PK + j (low) and b*PK + PK/2 + j (high).
    """
    b = torch.arange(kp // pk, device=device)[:, None] * pk
    j = torch.arange(pk // 2, device=device)[None, :]
    return torch.stack([b + j, b + j + pk // 2], dim=-1).reshape(-1)


def to_w4(q: QTensor, tq: TensorQuant, pack_block: int | None = None) -> W4Tensor:
    """``q`` (reference layout, [E, N, K]) in the w4 kernel layout (module docstring)."""
    why = convertible(tq, q, pack_block)
    expect(why is None, "to_w4", "weights the w4 layout can hold", why)
    expect(len(q.shape) == 3, "q", "an [E, N, K] weight", q.shape)
    e, n, k = q.shape
    g = tq.granularity.group_size
    pk = pack_block or default_pack_block(tq)
    kp = -(-k // pk) * pk
    codes = unpack_nibbles(q.data)  # uint8 [E, N, K]
    perm = None
    if tq.act_order:
        perm = torch.sort(q.g_idx.to(torch.int64), dim=-1, stable=True).indices  # [E, K]
        codes = torch.gather(codes, -1, perm[:, None, :].expand(e, n, k))
        perm = _pad_last(perm.to(torch.int32), kp)
    g_idx = None if perm is None else (torch.arange(kp, dtype=torch.int32, device=perm.device) // g).expand(e, kp)
    codes = _pad_last(codes, kp)[..., _block_order(kp, pk, codes.device)]
    data = pack_nibbles(codes).view(torch.int32)
    scale = _pad_last(q.scale, kp // g)
    zero = None if q.zero is None else _pad_last(q.zero, kp // g, fill=8)
    w_fmt = W4_FORMATS[tq.dtype]
    return W4Tensor(
        data=data,
        shape=tuple(q.shape),
        scale=scale,
        zero=zero,
        global_scale=q.global_scale,
        g_idx=None if g_idx is None else g_idx.contiguous(),
        pack_block=pk,
        perm=perm,
        group_size=g,
        w_fmt=w_fmt,
        e2m1_one_mul=w_fmt != "int4" and e2m1_one_mul(scale, w_fmt),
    )


def e2m1_one_mul(scale: torch.Tensor, w_fmt: str) -> bool:
    """Whether every e2m1 scale times 2^126 is a bf16 value, i.e. the scale is at most 2 (e8m0
    codes <= 128; e4m3 values <= 2): one host sync, once, when the weights are converted."""
    if scale.numel() == 0:
        return True
    if w_fmt == "mxfp4":
        return int(scale.view(torch.uint8).max()) <= 128
    return float(scale.view(torch.float8_e4m3fn).float().abs().max()) <= 2.0


def from_w4(w: W4Tensor) -> QTensor:
    """The exact inverse of ``to_w4``: the reference-layout ``QTensor``."""
    e, n, k = w.shape
    kp, pk, g = w.k_padded, w.pack_block, w.group_size
    slots = unpack_nibbles(w.bytes_u8())  # [E, N, Kp] in byte order
    codes = torch.empty_like(slots)
    codes[..., _block_order(kp, pk, slots.device)] = slots
    codes = codes[..., :k]
    g_idx = None
    if w.perm is not None:
        perm = w.perm[..., :k].long()
        unsorted = torch.empty_like(codes)
        unsorted.scatter_(-1, perm[:, None, :].expand(e, n, k), codes)
        codes = unsorted
        g_idx = torch.empty(e, k, dtype=torch.int32, device=perm.device)
        groups = torch.arange(k, device=perm.device, dtype=torch.int32) // g
        g_idx.scatter_(-1, perm, groups.expand(e, k).contiguous())
    return QTensor(
        data=pack_nibbles(codes),
        shape=tuple(w.shape),
        scale=w.scale[..., : k // g].contiguous(),
        zero=None if w.zero is None else w.zero[..., : k // g].contiguous(),
        global_scale=w.global_scale,
        g_idx=g_idx,
    )


def as_w4(q: QTensor, tq: TensorQuant, perm: torch.Tensor | None) -> W4Tensor:
    """A ``W4Tensor`` over tensors already in the w4 layout that arrive as a plain ``QTensor`` (the
    ``fusedmoe::moe_forward`` op passes tensors, not Python objects): the metadata ``to_w4`` sets
    from the scheme (its default pack block: the only one ``prepare_weights`` uses) and ``perm``;
    ``e2m1_one_mul`` stays False (finding it needs a host sync, which a call must not make)."""
    w_fmt = W4_FORMATS[tq.dtype]
    extra = dict(pack_block=default_pack_block(tq), perm=perm, group_size=tq.granularity.group_size, w_fmt=w_fmt)
    return W4Tensor(**{k: getattr(q, k) for k in ("data", "shape", "scale", "zero", "global_scale", "g_idx")}, **extra)


def is_w4(w: object) -> bool:
    """Whether ``w`` is a weight in the w4 layout."""
    return getattr(w, "layout", None) == LAYOUT


def to_w4_weights(weights, scheme, pack_block: int | None = None):
    """``ExpertWeights`` with W13 and W2 in the w4 layout (``layout`` = LAYOUT): the backend's
    ``prepare_weights`` for 4-bit schemes that ``convertible`` accepts (check it first)."""
    expect(weights.layout == "reference", "weights.layout", "'reference'", weights.layout)
    w13 = to_w4(weights.w13, scheme.w1, pack_block)
    w2 = to_w4(weights.w2, scheme.w2, pack_block)
    return replace(weights, w13=w13, w2=w2, layout=LAYOUT)


def from_w4_weights(weights):
    """The inverse of ``to_w4_weights`` (``restore_weights``): reference layout, bit for bit."""
    expect(weights.layout == LAYOUT, "weights.layout", repr(LAYOUT), weights.layout)
    return replace(weights, w13=from_w4(weights.w13), w2=from_w4(weights.w2), layout="reference")
