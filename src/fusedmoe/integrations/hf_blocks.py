"""The float64 reference of a transformers MoE block: ``extract(block) -> HFMoE``, ``moe_forward``.

``extract`` reads a block instance through ``hf_moe.BLOCKS`` (the recipes ``patch`` uses) and
returns what the reference needs: the ``MoEConfig``, the ``RouterConfig`` (a block's scale of
the routed output folded into its ``routed_scaling_factor``), the experts' ``ExpertWeights``
in the reference layout (views of the block's parameters), the router Linear, the
correction bias and the shared expert as a ``SharedExpert`` (a gated MLP, optionally times
``sigmoid(x @ gate^T)``). ``moe_forward(hf, x)`` computes the block from those::

    logits = x @ router_weight^T (+ router_bias)
    out    = moe_reference(x, route(logits), weights) (+ shared_expert(x))

in float64 by default: the outside truth a patched block and the registry path are held
to. Blocks with more around their experts (latent projections, an output norm or bias,
product-key routing, the model's own router) are computed by ``patch`` but not here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..activations import apply_activation
from ..config import Activation, MoEConfig
from ..errors import expect
from ..experts.reference import moe_reference
from ..modular.validation import check_weights
from ..quant import QuantScheme
from ..routing import RouterConfig
from ..weights import ExpertWeights
from .hf_experts import activation_of, read_experts
from .hf_moe import BLOCKS, OwnedExperts
from .hf_routers import get
from .hf_source import code_key

__all__ = ["HFMoE", "SharedExpert", "extract", "moe_forward"]


@dataclass
class SharedExpert:
    """A dense gated MLP added to every token's output::

        y = (act(x @ gate_proj^T + gb) * (x @ up_proj^T + ub)) @ down_proj^T + db
        y = y * sigmoid(x @ gate_weight^T)      when gate_weight is set (Qwen2-MoE)

    gate_proj, up_proj [Is, H]; down_proj [H, Is]; gate_weight [1, H]; biases optional.
    """

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    activation: Activation = Activation.SILU
    gate_weight: torch.Tensor | None = None
    gate_proj_bias: torch.Tensor | None = None
    up_proj_bias: torch.Tensor | None = None
    down_proj_bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """x [T, H] -> [T, H] in ``dtype``."""

        def lin(a, w, b):
            return F.linear(a, w.to(dtype), None if b is None else b.to(dtype))

        xd = x.to(dtype)
        gate = lin(xd, self.gate_proj, self.gate_proj_bias)
        up = lin(xd, self.up_proj, self.up_proj_bias)
        inter = self.up_proj.shape[0]
        cfg = MoEConfig(
            num_experts=1,
            top_k=1,
            hidden_size=self.up_proj.shape[1],
            intermediate_size=inter,
            activation=self.activation,
        )
        y = lin(
            apply_activation(torch.cat([gate, up], dim=-1), cfg),
            self.down_proj,
            self.down_proj_bias,
        )
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(xd, self.gate_weight.to(dtype)))
        return y

    @classmethod
    def from_mlp(cls, mlp: object, where: str, gate: object | None = None) -> SharedExpert:
        """From a transformers MLP module with gate_proj/up_proj/down_proj Linears."""
        lins = {n: get(mlp, n, where) for n in ("gate_proj", "up_proj", "down_proj")}
        gate_weight = None
        if gate is not None:
            expect(gate.bias is None, f"{where} gate.bias", "None (a bias-free shared-expert gate)")
            gate_weight = gate.weight.detach()

        def bias(lin):
            return None if lin.bias is None else lin.bias.detach()

        return cls(
            gate_proj=lins["gate_proj"].weight.detach(),
            up_proj=lins["up_proj"].weight.detach(),
            down_proj=lins["down_proj"].weight.detach(),
            activation=activation_of(get(mlp, "act_fn", where), where),
            gate_weight=gate_weight,
            gate_proj_bias=bias(lins["gate_proj"]),
            up_proj_bias=bias(lins["up_proj"]),
            down_proj_bias=bias(lins["down_proj"]),
        )


@dataclass
class HFMoE:
    """What fusedmoe needs to compute one transformers MoE block.

    kind:            the block's class name.
    config:          shapes and activation (dtype = the block's parameter dtype).
    router:          how logits become a TopK.
    weights:         the routed experts in the reference layout (unquantized).
    router_weight:   [E, H], the router Linear's weight.
    router_bias:     [E] or None.
    correction_bias: [E] (DeepSeek-V3 ``e_score_correction_bias``) or None.
    shared_expert:   added to the routed output, or None.
    """

    kind: str
    config: MoEConfig
    router: RouterConfig
    weights: ExpertWeights
    router_weight: torch.Tensor
    router_bias: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    shared_expert: SharedExpert | None = None

    def router_logits(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """x [T, H] -> logits [T, E] in ``dtype``."""
        b = None if self.router_bias is None else self.router_bias.to(dtype)
        return F.linear(x.to(dtype), self.router_weight.to(dtype), b)


def _shared_expert(shared: list, kind: str) -> SharedExpert | None:
    expect(len(shared) <= 1, f"{kind} shared experts", "at most one (the reference adds one)", len(shared))
    if not shared:
        return None
    m = shared[0]
    if hasattr(m, "gate") and hasattr(m, "mlp"):  # hf_moe's sigmoid-gated shared expert (Qwen2-MoE)
        return SharedExpert.from_mlp(m.mlp, f"{kind}.shared_expert", gate=m.gate)
    return SharedExpert.from_mlp(m, f"{kind}.shared_experts")


def extract(block: torch.nn.Module) -> HFMoE:
    """What the float64 reference needs to compute ``block`` (module docstring)."""
    kind = type(block).__name__
    key = code_key(type(block))
    expect(key in BLOCKS, "block", "a MoE block whose code fusedmoe maps (hf_moe.BLOCKS)", f"{kind} (code key {key})")
    spec = BLOCKS[key](block, kind)
    r = spec.routing
    plain = r.config is not None and r.logits_fn is None and r.logit_scale == 1.0
    extras = (spec.pre, spec.post, spec.out_norm, spec.out_bias)
    expect(
        plain and all(e is None for e in extras), kind, "router Linear + experts + shared MLP (what the reference adds)"
    )
    experts = spec.experts.experts_spec() if isinstance(spec.experts, OwnedExperts) else read_experts(spec.experts)
    expect(experts.post_norm is None, f"{kind}.experts", "no post-expert norm (the reference has none)")
    router = replace(r.config, routed_scaling_factor=r.config.routed_scaling_factor * spec.routed_scale)
    config = experts.config(router.top_k)
    weights = experts.weights()
    check_weights(weights, config, QuantScheme.unquantized())
    return HFMoE(
        kind=kind,
        config=config,
        router=router,
        weights=weights,
        router_weight=r.weight.detach(),
        router_bias=None if r.bias is None else r.bias.detach(),
        correction_bias=r.correction_bias,
        shared_expert=_shared_expert(spec.shared, kind),
    )


def moe_forward(hf: HFMoE, hidden_states: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The block's output for ``hidden_states`` [B, S, H] or [T, H], computed in ``dtype``.

    (gpt-oss's block also returns its router scores; this returns the hidden states only.)
    """
    shape = hidden_states.shape
    h = hf.config.hidden_size
    expect(shape[-1] == h, "hidden_states", f"last dimension H = {h}", tuple(shape))
    x = hidden_states.reshape(-1, h)
    topk = hf.router.route(hf.router_logits(x, dtype), hf.correction_bias)
    out = moe_reference(x, topk.ids, topk.weights, hf.weights, hf.config, QuantScheme.unquantized(), dtype=dtype)
    if hf.shared_expert is not None:
        out = out + hf.shared_expert(x, dtype)
    return out.reshape(shape)
