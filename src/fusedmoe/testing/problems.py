"""What tests and benchmarks share: random problems, poison, error metric, tolerances.

Tolerances are relative errors ``||out - ref|| / ||ref||`` against the float64
reference of the *same* scheme (so quantization error of the weights is not
counted, only the backend's own arithmetic: bf16 rounding of inputs,
intermediates and output, and the rare activation-quantization step that
flips because a backend's bf16 intermediate differs from the exact one).
The table is the one place these numbers live; each entry says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import MoEConfig
from ..quant import QTensor, QuantScheme
from ..weights import ExpertWeights

# bf16 has 8 bits of mantissa: one rounding costs ~2^-9 = 2e-3 relative per element,
# and a layer rounds x, h, the activation and the output. fp16: 2^-12.
_BASE = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}

# Extra error a scheme adds when a backend's bf16 intermediate makes a2 round to a
# neighbouring quantization step (step size relative to the value).
_SCHEME_EXTRA = {
    "unquantized": 0.0,
    "fp8": 4e-2,  # e4m3: 3 mantissa bits, a flip costs up to 12.5% of one element
    "int8": 2e-2,
    "wna16": 0.0,  # activations are not quantized
    "mxfp4": 0.0,
    "nvfp4": 0.0,
}
_ACT_QUANT_EXTRA = {"mxfp8": 4e-2, "nvfp4": 1.5e-1}  # e2m1 steps are up to 1/3 of a value


def tolerance(scheme: QuantScheme, dtype: torch.dtype) -> float:
    """Max relative error of a backend against the float64 reference of ``scheme``."""
    tol = _BASE[dtype] + _SCHEME_EXTRA.get(scheme.family, 0.0)
    if scheme.a1 is not None:
        tol += _ACT_QUANT_EXTRA.get(scheme.a1.dtype.value, 0.0)
    return tol


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if out has NaN/Inf (never passes)."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    denom = r.norm().item()
    if denom == 0:
        return o.norm().item()
    return ((o - r).norm() / denom).item()


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats) or a sentinel (ints) so unwritten elements show."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-(2**30) if t.dtype in (torch.int32, torch.int64) else -1)


def all_written(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.is_floating_point() else True


@dataclass
class Problem:
    """One random MoE problem: inputs, routing and weights for ``config`` x ``scheme``."""

    config: MoEConfig
    scheme: QuantScheme
    x: torch.Tensor  # [T, H] model dtype
    topk_ids: torch.Tensor  # [T, K] int32
    topk_weights: torch.Tensor  # [T, K] float32
    weights: ExpertWeights
    expert_map: torch.Tensor | None = None

    def reference(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        from ..experts.reference import moe_reference

        return moe_reference(
            self.x,
            self.topk_ids,
            self.topk_weights,
            self.weights,
            self.config,
            self.scheme,
            expert_map=self.expert_map,
            dtype=dtype,
        )


def random_topk(
    t: int, e: int, k: int, generator: torch.Generator, routing: str = "random"
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk ids [T, K] (distinct per row) and positive weights.

    routing: 'random' | 'one_expert' (every token's first choice is expert 0) |
    'skip_last' (expert E-1 gets no token, needs K < E).
    """
    dev = generator.device
    scores = torch.rand(t, e, generator=generator, device=dev)
    if routing == "one_expert":
        scores[:, 0] = 2.0
    elif routing == "skip_last":
        scores[:, e - 1] = -1.0
    ids = scores.topk(k, dim=1).indices.to(torch.int32)
    # not renormalized: with K = 1 renormalized weights are all 1, which hides where
    # (input or output) a backend applies them
    w = torch.rand(t, k, generator=generator, device=dev) * 0.9 + 0.1
    return ids, w.float()


def make_problem(
    config: MoEConfig,
    scheme: QuantScheme,
    t: int,
    *,
    seed: int = 0,
    routing: str = "random",
    device: str | torch.device = "cpu",
    expert_map: torch.Tensor | None = None,
    num_local_experts: int | None = None,
    weight_scale: float | None = None,
) -> Problem:
    """Fresh random inputs (never zeros) for a layer; weights quantized by ``scheme``.

    Weights are N(0, 1/sqrt(fan_in)) so activations keep unit size through the layer.
    With ``expert_map``, weights exist for the ``num_local_experts`` local experts only.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    e_glob, k, h, i = config.num_experts, config.top_k, config.hidden_size, config.intermediate_size
    e = num_local_experts or e_glob
    dt = config.dtype
    s1 = weight_scale or h**-0.5
    s2 = weight_scale or i**-0.5

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    w13 = _draw_experts(randn, (e, config.w13_rows, h), s1, dt, dev)
    w2 = _draw_experts(randn, (e, h, i), s2, dt, dev)
    b13 = b2 = None
    if config.has_bias:
        b13 = (randn(e, config.w13_rows) * 0.1).to(dt)
        b2 = (randn(e, h) * 0.1).to(dt)
    x = randn(t, h).to(dt)
    ids, w = random_topk(t, e_glob, k, g, routing)
    if scheme.w1 is None:
        weights = ExpertWeights.from_float(w13, w2, scheme, b13=b13, b2=b2)
    else:
        weights = _quantize_experts(w13, w2, scheme, b13, b2, randn(64, h))
    if expert_map is not None:
        expert_map = expert_map.to(dev)
    return Problem(config, scheme, x, ids, w, weights, expert_map)


# Values drawn or quantized at once: slabs of whole experts of at most 2^24 float32 values
# (64 MiB), so no float copy of every expert exists (DeepSeek-V3's W13 in float32: 30 GB).
# A problem below it is one slab: the same random stream as a single draw.
_SLAB_VALUES = 1 << 24
# Python with torch, fusedmoe and the allocator's slack: ~0.7 GiB resident before the first weight.
_PROCESS_BYTES = 3 << 28


def _slabs(num_experts: int, per_expert: int) -> range:
    return range(0, num_experts, max(1, _SLAB_VALUES // max(per_expert, 1)))


def _draw_experts(randn, shape: tuple[int, int, int], scale: float, dtype: torch.dtype, device) -> torch.Tensor:
    """N(0, scale^2) weights ``shape`` = [E, N, K] in ``dtype``, drawn slab by slab."""
    e, n, k = shape
    out = torch.empty(shape, dtype=dtype, device=device)
    slabs = _slabs(e, n * k)
    for s0 in slabs:
        s1 = min(e, s0 + slabs.step)
        out[s0:s1] = (randn(s1 - s0, n, k) * scale).to(dtype)
    return out


def _quantize_experts(w13, w2, scheme: QuantScheme, b13, b2, calib_x) -> ExpertWeights:
    """``ExpertWeights.from_float`` of the model-dtype weights, slab by slab into tensors allocated
    once (every quantized field has the experts as its leading dim)."""
    e = w13.shape[0]
    slabs = _slabs(e, w13[0].numel() + w2[0].numel())
    out = None
    for s0 in slabs:
        s1 = min(e, s0 + slabs.step)
        part = ExpertWeights.from_float(w13[s0:s1].float(), w2[s0:s1].float(), scheme, calib_x=calib_x)
        if s1 - s0 == e:
            out = part
            break
        if out is None:
            out = replace(part, w13=_alloc_experts(part.w13, e), w2=_alloc_experts(part.w2, e))
        for name in ("w13", "w2"):
            dst, src = getattr(out, name).tensors(), getattr(part, name).tensors()
            for field, t in src.items():
                dst[field][s0:s1] = t
    out.b13, out.b2 = b13, b2
    return out


def _alloc_experts(q: QTensor, num_experts: int) -> QTensor:
    """An uninitialised ``q`` for ``num_experts`` experts (each tensor's other dims and dtype)."""
    t = {k: v.new_empty(num_experts, *v.shape[1:]) for k, v in q.tensors().items()}
    return QTensor(t.pop("data"), (num_experts, *q.shape[1:]), **t)


def problem_bytes(config: MoEConfig, scheme: QuantScheme, t: int) -> int:
    """Host bytes ``make_problem`` + one forward + the float64 reference take at their peak, about:
    the process itself, the weights in the model dtype, their quantized copy, one slab of float32
    draws, the larger operand of one expert in float64 (three temporaries when dequantized), and
    the [T*K, 2I + I + H] float64 activations. Mixtral-8x7B bf16 at T = 8 (``fusedmoe run``):
    4.3 GiB estimated, a peak resident set of 3.9 GiB measured (2026-11-25, 2-core CPU)."""
    e, h, i, k = config.num_experts, config.hidden_size, config.intermediate_size, config.top_k
    per_expert = config.w13_rows * h + h * i
    total = _PROCESS_BYTES + e * per_expert * config.dtype.itemsize
    if scheme.w1 is not None:
        for tq, n, kk in ((scheme.w1, config.w13_rows, h), (scheme.w2, h, i)):
            sn, sk = tq.granularity.scale_shape(n, kk)
            total += e * (n * kk * tq.dtype.bits // 8 + sn * sk * (4 if tq.symmetric else 5) + 4 * kk * tq.act_order)
    total += 4 * min(e * per_expert, _SLAB_VALUES)
    total += (1 if scheme.w1 is None else 3) * 8 * max(config.w13_rows * h, h * i)
    total += 8 * t * k * (config.w13_rows + i + h) + 8 * t * h * 2
    return total


@dataclass(frozen=True)
class Case:
    """A labelled shape for the edge-case families every kernel test runs: T = 0 and 1, T smaller
    than a tile, odd H and I, prime E, K = 1 and K = E, an expert without tokens, all tokens on
    one expert, T*K not a multiple of the block."""

    label: str
    t: int
    e: int
    k: int
    h: int
    i: int
    routing: str = "random"

    def config(self, **kw) -> MoEConfig:
        return MoEConfig(num_experts=self.e, top_k=self.k, hidden_size=self.h, intermediate_size=self.i, **kw)


# Tiny shapes for the CPU (and the Triton interpreter). H and I are multiples of 32 where a
# packed or MX format needs it; 'odd' shapes use schemes that allow them.
EDGE_CASES = [
    Case("T0", 0, 4, 2, 64, 32),
    Case("T1", 1, 4, 2, 64, 32),
    Case("T_lt_tile", 5, 4, 2, 64, 32),
    Case("K1", 9, 4, 1, 64, 32),
    Case("K_eq_E", 6, 3, 3, 64, 32),
    Case("prime_E", 13, 7, 2, 64, 32),
    Case("empty_expert", 10, 5, 2, 64, 32, routing="skip_last"),
    Case("one_expert", 12, 4, 1, 64, 32, routing="one_expert"),
    Case("TK_not_multiple", 11, 6, 3, 64, 32),
]
# Odd sizes: any scheme whose formats allow them (see ``quant.shape_supported``).
ODD_CASES = [Case("odd_H_I", 7, 5, 2, 71, 37), Case("unaligned_H_I", 6, 5, 2, 96, 80)]
