"""``ExpertWeights``: the weights of all local experts with their scales.

W13 is [E, 2I, H] (or [E, I, H] for non-gated activations), W2 is [E, H, I],
each a ``QTensor`` (an unquantized one has only ``data``). Static activation
scales (a1_scale, a2_scale) and NVFP4 activation global scales live here too,
because they come from the checkpoint with the weights.

``layout`` names the backend layout the tensors were converted to; the
reference layout is the one described above, and every conversion must
round-trip to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .errors import UnsupportedError, expect
from .quant import QTensor, QuantScheme, dequantize, quantize
from .quant.scheme import shape_supported
from .quant.tensor import group_amax


@dataclass
class ExpertWeights:
    w13: QTensor
    w2: QTensor
    b13: torch.Tensor | None = None  # [E, 2I]
    b2: torch.Tensor | None = None  # [E, H]
    a1_scale: torch.Tensor | None = None  # static activation scales (scheme a1/a2 not dynamic)
    a2_scale: torch.Tensor | None = None
    a1_global_scale: torch.Tensor | None = None  # NVFP4 activations
    a2_global_scale: torch.Tensor | None = None
    layout: str = "reference"

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def device(self) -> torch.device:
        return self.w13.data.device

    def to(self, device) -> ExpertWeights:
        def mv(t):
            return None if t is None else t.to(device)

        return replace(
            self,
            w13=self.w13.to(device),
            w2=self.w2.to(device),
            b13=mv(self.b13),
            b2=mv(self.b2),
            a1_scale=mv(self.a1_scale),
            a2_scale=mv(self.a2_scale),
            a1_global_scale=mv(self.a1_global_scale),
            a2_global_scale=mv(self.a2_global_scale),
        )

    def act_scales(self, operand: str, tq) -> dict:
        """Quantization arguments of activation ``operand`` ('a1' or 'a2') from the checkpoint:
        its scale when ``tq`` is static, and its global scale (NVFP4). Empty for dynamic
        schemes and unquantized activations; every backend and dispatcher takes them here."""
        kw = {}
        if tq is None:
            return kw
        scale = getattr(self, f"{operand}_scale")
        if not tq.dynamic and scale is not None:
            kw["scale"] = scale
        gscale = getattr(self, f"{operand}_global_scale")
        if gscale is not None:
            kw["global_scale"] = gscale
        return kw

    def dequantized(self, scheme: QuantScheme, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(W13, W2) as real numbers in ``dtype``, reference layout."""
        expect(self.layout == "reference", "ExpertWeights.layout", "'reference'", self.layout)
        if scheme.w1 is None:
            return self.w13.data.to(dtype), self.w2.data.to(dtype)
        return dequantize(self.w13, scheme.w1, dtype), dequantize(self.w2, scheme.w2, dtype)

    @classmethod
    def from_float(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        scheme: QuantScheme,
        *,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        calib_x: torch.Tensor | None = None,
        g_idx13: torch.Tensor | None = None,
        g_idx2: torch.Tensor | None = None,
    ) -> ExpertWeights:
        """Quantize float weights as ``scheme`` says (what an offline quantizer would store).

        Static activation scales (and NVFP4 activation global scales) are
        calibrated on ``calib_x`` [T, H] (the a2 scale from a generous bound);
        act-order int4 takes per-expert ``g_idx`` [E, K], random if not given.
        """
        for name, w in (("w13", w13), ("w2", w2)):
            ok = isinstance(w, torch.Tensor) and w.dim() == 3 and w.is_floating_point()
            expect(ok, name, "a floating-point tensor [E, N, K]", getattr(w, "shape", type(w)))
        expect(w2.shape[0] == w13.shape[0], "w2", f"{w13.shape[0]} experts as w13 has", tuple(w2.shape))
        want = f"[E, H, I] = [{w13.shape[0]}, {w13.shape[2]}, I] with w13 [E, 2I or I, H] = {tuple(w13.shape)}"
        ok = w2.shape[:2] == (w13.shape[0], w13.shape[2]) and w13.shape[1] in (w2.shape[2], 2 * w2.shape[2])
        expect(ok, "w2", want, tuple(w2.shape))
        why = shape_supported(scheme, w13.shape[2], w2.shape[2])
        if why is not None:
            raise UnsupportedError(f"w13/w2: expected sizes the scheme {scheme.name} can store: {why}")
        if scheme.w1 is None:
            return cls(w13=QTensor(w13, tuple(w13.shape)), w2=QTensor(w2, tuple(w2.shape)), b13=b13, b2=b2)
        if scheme.w1.act_order and g_idx13 is None:
            g_idx13 = random_g_idx(w13.shape[0], w13.shape[-1], scheme.w1.granularity.group_size, w13.device)
            g_idx2 = random_g_idx(w2.shape[0], w2.shape[-1], scheme.w2.granularity.group_size, w2.device)
        q13 = quantize(w13, scheme.w1, g_idx=g_idx13)
        q2 = quantize(w2, scheme.w2, g_idx=g_idx2)
        out = cls(w13=q13, w2=q2, b13=b13, b2=b2)
        for name, tq in (("a1", scheme.a1), ("a2", scheme.a2)):
            if tq is None:
                continue
            if calib_x is None:
                calib_x = torch.randn(16, w13.shape[-1], device=w13.device)
            # a2 sees the activation output, whose size is of the order of x's for random weights
            amax = group_amax(calib_x.float(), tq.granularity.__class__.tensor()).reshape(1)
            # a static scale of 0 (all-zero calibration) would make every output 0: one host read, once
            expect(bool(torch.isfinite(amax).all() and (amax > 0).all()), "calib_x", "finite, not all zero", amax)
            amax = amax * (4.0 if name == "a2" else 1.0)
            if not tq.dynamic:
                from .quant.linear import FP8_MAX, INT8_MAX

                qmax = FP8_MAX if tq.dtype.value.startswith("fp8") else INT8_MAX
                setattr(out, f"{name}_scale", (amax / qmax).reshape(1, 1))
            if tq.has_global_scale:
                from .quant.fp4 import nvfp4_global_scale

                setattr(out, f"{name}_global_scale", nvfp4_global_scale(amax).reshape(1, 1))
        return out


def expert_matrix(q: QTensor, tq, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Local expert ``e`` of a reference-layout operand as real numbers [N, K] in ``dtype`` (``tq``
    None: plain values): one expert's float copy, never all of them (DeepSeek-V3's W13 + W2 in
    float64 take 90 GB for the 256 experts, 350 MB for one)."""
    if tq is None:
        return q.data[e].to(dtype)
    return dequantize(q.select(e), tq, dtype)[0]


def random_g_idx(num_experts: int, k: int, group: int, device="cpu") -> torch.Tensor:
    """An act-order group map per expert: group i // g of a random column permutation."""
    expect(k % group == 0, "K", f"a multiple of the int4 group size {group}", k)
    out = torch.empty(num_experts, k, dtype=torch.int32)
    for e in range(num_experts):
        perm = torch.randperm(k)
        out[e, perm] = (torch.arange(k) // group).to(torch.int32)
    return out.to(device)
