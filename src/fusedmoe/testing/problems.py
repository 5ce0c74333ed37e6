"""What tests and benchmarks share: random problems, poison, error metric, tolerances.

Tolerances are relative errors ``||out - ref|| / ||ref||`` against the float64
reference of the *same* scheme (so quantization error of the weights is not
counted, only the backend's own arithmetic: bf16 rounding of inputs,
intermediates and output, and the rare activation-quantization step that
flips because a backend's bf16 intermediate differs from the exact one).
The table is the one place these numbers live; each entry says why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MoEConfig
from ..quant import QuantScheme
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

    w13 = (randn(e, config.w13_rows, h) * s1).to(dt)
    w2 = (randn(e, h, i) * s2).to(dt)
    b13 = b2 = None
    if config.has_bias:
        b13 = (randn(e, config.w13_rows) * 0.1).to(dt)
        b2 = (randn(e, h) * 0.1).to(dt)
    x = randn(t, h).to(dt)
    ids, w = random_topk(t, e_glob, k, g, routing)
    if scheme.w1 is None:
        weights = ExpertWeights.from_float(w13, w2, scheme, b13=b13, b2=b2)
    else:
        weights = ExpertWeights.from_float(w13.float(), w2.float(), scheme, b13=b13, b2=b2, calib_x=randn(64, h))
    if expert_map is not None:
        expert_map = expert_map.to(dev)
    return Problem(config, scheme, x, ids, w, weights, expert_map)


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
