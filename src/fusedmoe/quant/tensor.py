"""``QTensor`` and the format-independent scale arithmetic.

A ``QTensor`` is a quantized operand: its stored ``data`` plus whatever the
format needs to dequantize it. ``shape`` is the logical (unpacked) shape;
``data`` may be packed (two int4/e2m1 values per uint8 along the last dim).

An ``Operand`` is what a kernel multiplies: a ``QTensor`` with the ``TensorQuant`` that says
how it was quantized (None: plain values in the model dtype).

``quant.formats`` holds ``quantize`` / ``dequantize``, which dispatch on ``TensorQuant.dtype``
to the format modules (fp8, int8, int4, mxfp4, nvfp4, mxfp8).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..errors import expect
from .scheme import Granularity, TensorQuant


@dataclass
class QTensor:
    """A quantized tensor of logical shape ``shape`` = [*B, N, K].

    data:         stored values (fp8/int8 [*B,N,K]; int4/fp4 packed uint8 [*B,N,K/2],
                  low nibble = even column)
    scale:        dequantization multiplier, shape per ``Granularity.scale_shape``
                  (e8m0 exponents as uint8 for MX formats, e4m3 for NVFP4)
    zero:         zero points (int4/int8 asymmetric), same shape as scale, uint8
    global_scale: fp32 [*B, 1, 1] second-level multiplier (NVFP4)
    g_idx:        int32 [*B, K] group of each input column (int4 act-order)
    """

    data: torch.Tensor
    shape: tuple[int, ...]
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> QTensor:
        def mv(t):
            return None if t is None else t.to(device)

        return replace(
            self,
            data=self.data.to(device),
            scale=mv(self.scale),
            zero=mv(self.zero),
            global_scale=mv(self.global_scale),
            g_idx=mv(self.g_idx),
        )

    def select(self, e: int) -> QTensor:
        """The slice of expert ``e`` (leading dim kept, size 1); shared scales pass through."""

        def pick(t):
            if t is None or t.dim() == 0 or t.shape[0] != self.shape[0]:
                return t
            return t[e : e + 1]

        return QTensor(
            data=self.data[e : e + 1],
            shape=(1, *self.shape[1:]),
            scale=pick(self.scale),
            zero=pick(self.zero),
            global_scale=pick(self.global_scale),
            g_idx=pick(self.g_idx),
        )

    @staticmethod
    def cat(parts: list[QTensor]) -> QTensor:
        """Expert slices (``select``'s inverse, or tensors quantized a few experts at a time so
        that fp32 copies stay small) joined along the leading dim. A field without that dim
        (a shared scale) is taken from the first part."""
        expect(len(parts) > 0, "parts", "at least one QTensor", len(parts))

        def join(name):
            ts = [getattr(q, name) for q in parts]
            if ts[0] is None or ts[0].dim() == 0 or ts[0].shape[0] != parts[0].shape[0]:
                return ts[0]
            return torch.cat(ts)

        shape = (sum(q.shape[0] for q in parts), *parts[0].shape[1:])
        return QTensor(join("data"), shape, join("scale"), join("zero"), join("global_scale"), join("g_idx"))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by field name (None fields left out)."""
        out = {"data": self.data}
        for k in ("scale", "zero", "global_scale", "g_idx"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class Operand:
    """A GEMM operand: the stored tensor (``q``) and how it is quantized (``quant``; None when
    ``q.data`` holds plain values in the model dtype). One argument instead of the data, the
    TensorQuant, the scale and the global scale passed side by side."""

    q: QTensor
    quant: TensorQuant | None = None

    @classmethod
    def of(cls, t: QTensor | torch.Tensor, quant: TensorQuant | None = None) -> Operand:
        """An operand from a ``QTensor`` or a plain tensor (logical shape = its shape)."""
        return cls(t if isinstance(t, QTensor) else QTensor(t, tuple(t.shape)), quant)

    @property
    def data(self) -> torch.Tensor:
        return self.q.data

    @property
    def scale(self) -> torch.Tensor | None:
        return self.q.scale

    @property
    def global_scale(self) -> torch.Tensor | None:
        return self.q.global_scale

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


class Format(Protocol):
    def quantize(
        self,
        x: torch.Tensor,
        tq: TensorQuant,
        *,
        scale: torch.Tensor | None = None,
        global_scale: torch.Tensor | None = None,
        g_idx: torch.Tensor | None = None,
    ) -> QTensor: ...

    def dequantize(self, q: QTensor, tq: TensorQuant, dtype: torch.dtype) -> torch.Tensor: ...


# ---- scale arithmetic shared by the formats ---------------------------------


def group_amax(x: torch.Tensor, gran: Granularity) -> torch.Tensor:
    """abs-max of ``x`` [*B, N, K] over each scale group, in the scale shape, float32."""
    a = x.abs().float()
    n, k = x.shape[-2], x.shape[-1]
    batch = x.shape[:-2]
    if x.numel() == 0:
        return torch.zeros(*batch, *gran.scale_shape(n, k), device=x.device)
    if gran.kind == "tensor":
        return a.amax(dim=(-2, -1), keepdim=True)
    if gran.kind in ("token", "channel"):
        return a.amax(dim=-1, keepdim=True)
    if gran.kind == "group":
        g = gran.group_size
        kg = -(-k // g)
        a = torch.nn.functional.pad(a, (0, kg * g - k))
        return a.view(*batch, n, kg, g).amax(dim=-1)
    bn, bk = gran.block_n, gran.block_k
    nb, kb = -(-n // bn), -(-k // bk)
    a = torch.nn.functional.pad(a, (0, kb * bk - k, 0, nb * bn - n))
    return a.view(*batch, nb, bn, kb, bk).amax(dim=(-3, -1))


def expand_scale(s: torch.Tensor, gran: Granularity, n: int, k: int) -> torch.Tensor:
    """Broadcast a scale of ``gran``'s shape back to [*B, N, K] (a view where possible)."""
    if gran.kind == "group":
        s = s.repeat_interleave(gran.group_size, dim=-1)[..., :k]
    elif gran.kind == "block":
        s = s.repeat_interleave(gran.block_n, dim=-2)[..., :n, :]
        s = s.repeat_interleave(gran.block_k, dim=-1)[..., :k]
    return s.expand(*s.shape[:-2], n, k)


def check_scale_shape(scale: torch.Tensor, x: torch.Tensor, gran: Granularity, name: str = "scale") -> torch.Tensor:
    """Validate a user-given (static) scale and reshape it to the canonical shape."""
    n, k = x.shape[-2], x.shape[-1]
    want = (*x.shape[:-2], *gran.scale_shape(n, k))
    if scale.numel() == 1 and gran.kind == "tensor":
        return scale.reshape(1, 1).expand(want).float() if len(want) > 2 else scale.reshape(want).float()
    expect(
        scale.numel() == _numel(want),
        name,
        f"{_numel(want)} elements for shape {want} ({gran!r})",
        tuple(scale.shape),
    )
    return scale.reshape(want)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
