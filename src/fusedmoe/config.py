"""Shapes and semantics of one MoE layer (``MoEConfig``) and how it is split
across ranks (``ParallelConfig``).

Letters used throughout fusedmoe: T tokens, E experts, K top-k, H hidden size,
I intermediate size (per tensor-parallel shard). W13 is [E, 2I, H] for gated
activations (gate rows then up rows, or interleaved for gpt-oss) and [E, I, H]
for the ``*_no_mul`` ones; W2 is [E, H, I].

Both configs are frozen dataclasses validated on construction; their repr
evaluates back to an equal object (``import torch`` and
``from fusedmoe.config import *`` in scope), so a bug report carries its repro.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .errors import expect

__all__ = ["Activation", "MoEConfig", "ParallelConfig", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Activation(str, enum.Enum):
    """The activation between the GEMMs. Gated ones take [gate | up] of width 2I."""

    SILU = "silu"  # silu(gate) * up
    GELU = "gelu"  # gelu(gate) * up, exact erf
    GELU_TANH = "gelu_tanh"  # gelu(gate, tanh approximation) * up
    SWIGLUOAI = "swigluoai"  # gpt-oss: clamp, gate*sigmoid(alpha*gate)*(up+1)
    SILU_CLAMP = "silu_clamp"  # DeepSeek-V4, GLM-5-Next, HY-V4: silu(min(gate, limit)) * clamp(up, +-limit)
    SILU_CLAMP_POST = "silu_clamp_post"  # Step-3.7: min(silu(gate), limit) * clamp(up, +-limit)
    SILU_SOFTCAP = "silu_softcap"  # Inkling-2: cap(gate, limit) * sigmoid(gate) * cap(up, alpha)
    SILU_NO_MUL = "silu_no_mul"  # silu(h), W13 has I rows
    GELU_NO_MUL = "gelu_no_mul"  # gelu(h)
    RELU_NO_MUL = "relu_no_mul"  # relu(h) (Switch Transformers)
    RELU2_NO_MUL = "relu2_no_mul"  # relu(h)^2

    def __repr__(self) -> str:
        return f"Activation.{self.name}"

    @property
    def is_gated(self) -> bool:
        return not self.value.endswith("_no_mul")


@dataclass(frozen=True)
class MoEConfig:
    """Shapes and semantics of one MoE layer.

    num_experts:      E, the global number of routed experts.
    top_k:            K, experts per token.
    hidden_size:      H.
    intermediate_size: I of this rank's shard (after tensor parallelism).
    activation:       an ``Activation`` (or its string value).
    has_bias:         biases on both GEMMs (b13 [E, 2I], b2 [E, H]).
    apply_router_weight_on_input: multiply x by its router weight before GEMM1
                      (needs top_k == 1) instead of weighting the output.
    gate_up_interleaved: W13 rows alternate gate, up (gpt-oss) instead of
                      [all gate rows; all up rows].
    swiglu_alpha / swiglu_limit: parameters of the bounded activations: ``swigluoai``
                      (alpha, limit), ``silu_clamp`` and ``silu_clamp_post`` (limit),
                      ``silu_softcap`` (the gate's cap is limit, up's cap is alpha;
                      cap(v, c) = c * tanh(v / c)).
    identity_experts: Z zero-compute experts after the E real ones (LongCat-Flash): a
                      top-k id in [E, E + Z) adds w * x to the output, no GEMM. The
                      router chooses among E + Z; the weights hold the E real experts.
    dtype:            the model (activation and output) dtype.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: Activation = Activation.SILU
    has_bias: bool = False
    apply_router_weight_on_input: bool = False
    gate_up_interleaved: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    identity_experts: int = 0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if isinstance(self.activation, str) and not isinstance(self.activation, Activation):
            names = [a.value for a in Activation]
            expect(self.activation in names, "MoEConfig.activation", f"one of {names}", self.activation)
            object.__setattr__(self, "activation", Activation(self.activation))
        for f in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            v = getattr(self, f)
            expect(isinstance(v, int) and v > 0, f"MoEConfig.{f}", "a positive int", v)
        z = self.identity_experts
        expect(
            isinstance(z, int) and not isinstance(z, bool) and z >= 0, "MoEConfig.identity_experts", "an int >= 0", z
        )
        expect(
            self.top_k <= self.num_experts + z,
            "MoEConfig.top_k",
            f"<= num_experts + identity_experts ({self.num_experts + z})",
            self.top_k,
        )
        expect(self.dtype in SUPPORTED_DTYPES, "MoEConfig.dtype", f"one of {SUPPORTED_DTYPES}", self.dtype)
        if self.apply_router_weight_on_input:
            expect(z == 0, "MoEConfig.identity_experts", "0 with apply_router_weight_on_input", z)
            expect(
                self.top_k == 1,
                "MoEConfig.apply_router_weight_on_input",
                "top_k == 1 (the weight of each (token, expert) pair would be mixed otherwise)",
                self.top_k,
            )
        if self.gate_up_interleaved:
            expect(
                self.activation.is_gated,
                "MoEConfig.gate_up_interleaved",
                "False for a non-gated activation",
                self.activation,
            )
        expect(self.swiglu_limit > 0, "MoEConfig.swiglu_limit", "> 0", self.swiglu_limit)
        if self.activation is Activation.SILU_SOFTCAP:
            expect(
                self.swiglu_alpha > 0,
                "MoEConfig.swiglu_alpha",
                "> 0 (the cap of up for silu_softcap)",
                self.swiglu_alpha,
            )

    @property
    def w13_rows(self) -> int:
        """Rows of W13 per expert: 2I for gated activations, I otherwise."""
        return 2 * self.intermediate_size if self.activation.is_gated else self.intermediate_size

    def replace(self, **changes) -> MoEConfig:
        from dataclasses import replace

        return replace(self, **changes)


_PLACEMENTS = ("linear", "round_robin")


@dataclass(frozen=True)
class ParallelConfig:
    """How a layer is split over ranks.

    Expert parallelism gives each of ``ep_size`` ranks a subset of experts
    (``placement``: 'linear' = contiguous ranges, 'round_robin' = e % ep_size);
    tensor parallelism splits I inside each expert. ``dispatcher`` names how
    tokens reach the experts ('local' when ep_size == 1).
    """

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    dispatcher: str = "local"
    placement: str = "linear"

    def __post_init__(self) -> None:
        for size, rank in (("tp_size", "tp_rank"), ("ep_size", "ep_rank"), ("dp_size", "dp_rank")):
            s, r = getattr(self, size), getattr(self, rank)
            expect(isinstance(s, int) and s >= 1, f"ParallelConfig.{size}", "an int >= 1", s)
            expect(isinstance(r, int) and 0 <= r < s, f"ParallelConfig.{rank}", f"in [0, {s})", r)
        expect(self.placement in _PLACEMENTS, "ParallelConfig.placement", f"one of {_PLACEMENTS}", self.placement)

    def local_experts(self, num_experts: int) -> list[int]:
        """Global ids of the experts this rank owns (uneven splits: first ranks get one more)."""
        expect(
            num_experts >= self.ep_size,
            "num_experts",
            f">= ep_size ({self.ep_size}) so every rank owns an expert",
            num_experts,
        )
        if self.placement == "round_robin":
            return list(range(self.ep_rank, num_experts, self.ep_size))
        base, extra = divmod(num_experts, self.ep_size)
        start = self.ep_rank * base + min(self.ep_rank, extra)
        count = base + (1 if self.ep_rank < extra else 0)
        return list(range(start, start + count))

    def expert_map(self, num_experts: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """int32 [E]: global expert id -> local id, or -1 where not local; None without EP."""
        if self.ep_size == 1:
            return None
        m = torch.full((num_experts,), -1, dtype=torch.int32)
        local = self.local_experts(num_experts)
        m[torch.tensor(local, dtype=torch.long)] = torch.arange(len(local), dtype=torch.int32)
        return m.to(device)
