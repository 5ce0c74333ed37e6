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

Pairs whose id is outside [0, E), or whose expert maps outside [0, E_local) under
``expert_map`` (-1: another rank's), contribute nothing (``metadata.TopK``); the one exception
is a layer's ``identity_experts``: a pair whose id is one of them (E <= id < E + Z) contributes
w[t,k] * x (unquantized).
Q(.) = dequantize(quantize(.)): the values a kernel would feed its GEMM.
Every backend is compared with this function; it is never a second copy in tests.

Memory: each expert's weights are dequantized when its rows come up, one expert at a time
and only the experts hit, so the float copy of all experts never exists (DeepSeek-V3 in
float64: 350 MB for one expert against 90 GB for the 256).

Deterministic mode (``deterministic``, ``FUSEDMOE_DETERMINISTIC=1`` when built): GEMMs run
over fixed tiles of ``DETERMINISTIC_ROWS`` rows (``batch_invariant_mm``), so a token's
output does not depend on how many rows its expert got in the batch (fp32 MKL sgemm
differs by ~7e-7 between a 1-row and a many-row call otherwise).
"""

from __future__ import annotations

import torch

from .. import env
from ..activations import apply_activation
from ..config import MoEConfig
from ..contract import TokenLayout, WeightedReduce
from ..errors import expect
from ..metadata import local_expert_ids
from ..quant import QTensor, QuantScheme, dequantize, fake_quantize
from ..weights import ExpertWeights, expert_matrix
from .base import ALL_SCHEMES, Capabilities, Experts

# Rows per GEMM call in deterministic mode: MKL sgemm measured batch-invariant over fixed
# 8/16/32-row calls (every [i:j] slice of 40 rows, 2 threads); 16 pads a lone decode token
# 16x, a cost only this mode pays.
DETERMINISTIC_ROWS = 16


def batch_invariant_mm(a: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """a @ w_t in calls of exactly ``DETERMINISTIC_ROWS`` rows (the last tile zero-padded)."""
    m = a.shape[0]
    pad = -m % DETERMINISTIC_ROWS
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    return torch.cat([t @ w_t for t in a.split(DETERMINISTIC_ROWS)])[:m]


def expert_ffn_rows(
    xq: torch.Tensor,
    expert: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    scheme: QuantScheme,
    mm=torch.matmul,
) -> torch.Tensor:
    """GEMM1 -> activation -> Q_a2 -> GEMM2 for rows ``xq`` [M, H] of local experts ``expert`` [M]
    (each in [0, E_l)), in xq's dtype; each expert's weights dequantized when its rows come up
    (see the module docstring). ``mm(a, w_t)``: the GEMM. Returns [M, H]."""
    dtype = xq.dtype
    groups = [(e, (expert == e).nonzero(as_tuple=True)[0]) for e in torch.unique(expert).tolist()]

    def gemm(a, w, tq, bias, n, activate=False):
        """a @ W_e^T (+ b_e) for each expert e's rows of ``a`` (then the activation): [M, n]."""
        out = torch.empty(a.shape[0], n, dtype=dtype, device=a.device)
        for e, rows in groups:
            y = mm(a[rows], expert_matrix(w, tq, e, dtype).T)
            if bias is not None:
                y = y + bias[e].to(dtype)
            out[rows] = apply_activation(y, config) if activate else y
        return out

    inter = gemm(xq, weights.w13, scheme.w1, weights.b13, config.intermediate_size, activate=True)
    aq = fake_quantize(inter, scheme.a2, dtype, **weights.act_scales("a2", scheme.a2))
    return gemm(aq, weights.w2, scheme.w2, weights.b2, config.hidden_size)


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
    deterministic: bool = False,
) -> torch.Tensor:
    """The MoE layer's output [T, H] in ``dtype`` (see the module docstring)."""
    xq = quantize_input(x, topk_weights, weights, config, scheme, dtype)
    out = routed_experts(xq, topk_ids, topk_weights, weights, config, scheme, expert_map, dtype, deterministic)
    if config.identity_experts:
        ids = topk_ids.long()
        chosen = ((ids >= config.num_experts) & (ids < config.num_experts + config.identity_experts)).to(dtype)
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
    deterministic: bool = False,
) -> torch.Tensor:
    """Everything after Q_a1: xq [T, H] (real values) -> weighted sum over K, [T, H]; the pairs
    of identity experts (ids >= E) are left to the caller."""
    t, h = xq.shape
    k = topk_ids.shape[1]
    out = torch.zeros(t, h, dtype=dtype, device=xq.device)
    if t == 0:
        return out
    expect(weights.layout == "reference", "weights.layout", "'reference'", weights.layout)
    local = local_expert_ids(topk_ids, expert_map, weights.num_experts).reshape(-1)
    tok = torch.arange(t, device=xq.device).repeat_interleave(k)
    keep = (local >= 0).nonzero(as_tuple=True)[0]
    if keep.numel() == 0:
        return out
    mm = batch_invariant_mm if deterministic else torch.matmul
    y = expert_ffn_rows(xq[tok[keep]].to(dtype), local[keep], weights, config, scheme, mm)
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
    batched_twin = "reference_batched"
    capabilities = Capabilities(
        layouts=frozenset({TokenLayout.STANDARD}),
        schemes=ALL_SCHEMES,
        platforms=frozenset({"cpu", "cuda", "rocm", "xpu"}),
        note="float32 PyTorch from dequantized weights; checks every other backend",
    )
    compute_dtype = torch.float32
    # batch-invariant GEMMs (see the module docstring); MoEKernel(deterministic=...) sets it too
    deterministic: bool = False

    def __init__(self, config, scheme) -> None:
        super().__init__(config, scheme)
        self.deterministic = env.deterministic()

    @property
    def _mm(self):
        return batch_invariant_mm if self.deterministic else torch.matmul

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        xq = _activation_values(a, self.scheme, self.compute_dtype)
        res = routed_experts(
            xq, topk.ids, topk.weights, weights, self.config, self.scheme, expert_map, self.compute_dtype,
            self.deterministic,
        )  # fmt: skip
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
        y = expert_ffn_rows(xq[valid], valid // m, weights, self.config, self.scheme, self._mm)
        out.reshape(e_l * m, -1)[valid] = y.to(out.dtype)
