"""The exact reference: what one MoE layer means, for every scheme.

Computed in ``dtype`` (float64 in tests, float32 elsewhere) from dequantized
weights, with activations quantized exactly where and how the scheme says::

    x_in  = x * w[t,k]        if the router weight is applied on input (K == 1)
    xq    = Q_a1(x_in)        over all T tokens (a per-tensor dynamic scale sees them all)
    h     = xq @ W13[e]^T + b13[e]
    a     = act(h)
    aq    = Q_a2(a)           over all (t, k) rows routed to local experts
    y     = aq @ W2[e]^T + b2[e]
    out[t] = sum_k w[t,k] * y  (or plain sum when weighted on input)

Pairs whose expert maps to -1 under ``expert_map`` contribute nothing. A pair whose id is
one of the ``identity_experts`` (E <= id < E + Z) contributes w[t,k] * x (unquantized).
Q(.) = dequantize(quantize(.)): the values a kernel would feed its GEMM.
Every backend is compared with this function; it is never a second copy in tests.
"""

from __future__ import annotations

import torch

from ..activations import apply_activation
from ..config import MoEConfig
from ..contract import TokenLayout, WeightedReduce
from ..quant import QTensor, QuantScheme, dequantize, fake_quantize
from ..weights import ExpertWeights
from .base import ALL_SCHEMES, Capabilities, Experts


def expert_ffn_rows(
    xq: torch.Tensor,
    expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    scheme: QuantScheme,
) -> torch.Tensor:
    """GEMM1 -> activation -> Q_a2 -> GEMM2 for rows ``xq`` [M, H] of local experts ``expert`` [M].

    ``w13``/``w2`` are the dequantized weights in the compute dtype. Returns [M, H].
    """
    dtype = w13.dtype
    m = xq.shape[0]
    inter = torch.empty(m, config.intermediate_size, dtype=dtype, device=xq.device)
    for e in torch.unique(expert).tolist():
        rows = (expert == e).nonzero(as_tuple=True)[0]
        h = xq[rows] @ w13[e].T
        if weights.b13 is not None:
            h = h + weights.b13[e].to(dtype)
        inter[rows] = apply_activation(h, config)
    aq = fake_quantize(inter, scheme.a2, dtype, **weights.act_scales("a2", scheme.a2))
    out = torch.empty(m, config.hidden_size, dtype=dtype, device=xq.device)
    for e in torch.unique(expert).tolist():
        rows = (expert == e).nonzero(as_tuple=True)[0]
        y = aq[rows] @ w2[e].T
        if weights.b2 is not None:
            y = y + weights.b2[e].to(dtype)
        out[rows] = y
    return out


def quantize_input(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    scheme: QuantScheme,
    dtype: torch.dtype,
) -> torch.Tensor:
    """x [T, H] -> Q_a1(x (* router weight when applied on input)) in ``dtype``."""
    x_in = x.to(dtype)
    if config.apply_router_weight_on_input:
        x_in = x_in * topk_weights.to(dtype).reshape(-1, 1)
    return fake_quantize(x_in, scheme.a1, dtype, **weights.act_scales("a1", scheme.a1))


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    scheme: QuantScheme,
    *,
    expert_map: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The MoE layer's output [T, H] in ``dtype`` (see the module docstring)."""
    xq = quantize_input(x, topk_weights, weights, config, scheme, dtype)
    out = routed_experts(xq, topk_ids, topk_weights, weights, config, scheme, expert_map, dtype)
    if config.identity_experts:
        chosen = (topk_ids >= config.num_experts).to(dtype)
        out += x.to(dtype) * (topk_weights.to(dtype) * chosen).sum(dim=1, keepdim=True)
    return out


def routed_experts(
    xq: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    scheme: QuantScheme,
    expert_map: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Everything after Q_a1: xq [T, H] (real values) -> weighted sum over K, [T, H]; the pairs
    of identity experts (ids >= E) are left to the caller."""
    t, h = xq.shape
    k = topk_ids.shape[1]
    out = torch.zeros(t, h, dtype=dtype, device=xq.device)
    if t == 0:
        return out
    w13, w2 = weights.dequantized(scheme, dtype)
    ids = topk_ids.long()
    routed = (ids < config.num_experts).reshape(-1)
    ids = ids.clamp(max=config.num_experts - 1)
    local = (expert_map.long()[ids] if expert_map is not None else ids).reshape(-1)
    tok = torch.arange(t, device=xq.device).repeat_interleave(k)
    keep = ((local >= 0) & routed).nonzero(as_tuple=True)[0]
    if keep.numel() == 0:
        return out
    y = expert_ffn_rows(xq[tok[keep]].to(dtype), local[keep], w13, w2, weights, config, scheme)
    if not config.apply_router_weight_on_input:
        y = y * topk_weights.reshape(-1)[keep].to(dtype).unsqueeze(1)
    out.index_add_(0, tok[keep], y)
    return out


def _activation_values(a: QTensor, scheme: QuantScheme, dtype: torch.dtype) -> torch.Tensor:
    return a.data.to(dtype) if scheme.a1 is None else dequantize(a, scheme.a1, dtype)


class ReferenceExperts(Experts):
    """PyTorch float32 math from dequantized weights; every scheme; the truth."""

    name = "reference"
    layout = TokenLayout.STANDARD
    reduce = WeightedReduce.NONE
    batched_twin = "reference_batched"
    capabilities = Capabilities(
        layouts=frozenset({TokenLayout.STANDARD}),
        schemes=ALL_SCHEMES,
        platforms=frozenset({"cpu", "cuda", "rocm", "xpu"}),
        note="float32 PyTorch from dequantized weights; checks every other backend",
    )
    compute_dtype = torch.float32

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        xq = _activation_values(a, self.scheme, self.compute_dtype)
        res = routed_experts(
            xq, topk.ids, topk.weights, weights, self.config, self.scheme, expert_map, self.compute_dtype
        )
        out.copy_(res)


class ReferenceBatchedExperts(ReferenceExperts):
    """The reference on the batched layout (unweighted rows; combine weights them)."""

    name = "reference_batched"
    layout = TokenLayout.BATCHED
    reduce = WeightedReduce.WEIGHT_AND_SUM
    batched_twin = None
    capabilities = Capabilities(
        layouts=frozenset({TokenLayout.BATCHED}),
        schemes=ALL_SCHEMES,
        platforms=frozenset({"cpu", "cuda", "rocm", "xpu"}),
        note="float32 PyTorch, batched layout",
        seed_names=("naive batched",),
    )

    def apply_batched(self, a, counts, weights, out, *, workspace=None):
        e_l, m = a.shape[0], a.shape[1]
        xq = _activation_values(a, self.scheme, self.compute_dtype).reshape(e_l * m, -1)
        slot = torch.arange(m, device=counts.device)
        valid = (slot.unsqueeze(0) < counts.unsqueeze(1)).reshape(-1).nonzero(as_tuple=True)[0]
        if valid.numel() == 0:
            return
        w13, w2 = weights.dequantized(self.scheme, self.compute_dtype)
        y = expert_ffn_rows(xq[valid], valid // m, w13, w2, weights, self.config, self.scheme)
        out.reshape(e_l * m, -1)[valid] = y.to(out.dtype)
