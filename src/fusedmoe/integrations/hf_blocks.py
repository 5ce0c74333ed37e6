"""Read a Hugging Face transformers MoE block and say what fusedmoe needs to compute it.

``extract(block) -> HFMoE`` takes a block *instance* (transformers 5.x layout,
where the routed experts are fused 3-D parameters of one ``*Experts`` module)
and returns its ``MoEConfig``, ``RouterConfig``, ``ExpertWeights`` in the
reference layout (W13 [E, 2I, H], W2 [E, H, I], biases b13 [E, 2I], b2 [E, H]),
the router's Linear (weight [E, H], bias [E]), DeepSeek-V3's correction bias
and the shared expert. ``moe_forward(hf, x)`` computes the block's output
from those with ``route`` + ``moe_reference`` + the shared expert::

    logits = x @ router_weight^T (+ router_bias)
    out    = moe_reference(x, route(logits), weights) (+ shared_expert(x))

What each supported block does (read from the installed transformers source):

- ``MixtralSparseMoeBlock``: softmax, top-k, always renormalized.
- ``Qwen3MoeSparseMoeBlock``, ``OlmoeSparseMoeBlock``: softmax, top-k,
  renormalized iff ``gate.norm_topk_prob``.
- ``Qwen2MoeSparseMoeBlock``: the same, plus a shared expert (gate/up/down
  MLP) multiplied by ``sigmoid(shared_expert_gate(x))`` and added.
- ``DeepseekV2Moe``: softmax, greedy or group-limited greedy (group score =
  max), no renormalization, ``routed_scaling_factor``; shared experts added.
- ``DeepseekV3MoE``: sigmoid, correction bias for the choice only, grouped
  top-k (group score = sum of the two best biased scores), renormalized iff
  ``norm_topk_prob``, then ``routed_scaling_factor``; shared experts added.
  (transformers divides by sum + 1e-20, ``route`` by the sum: the same in
  float32 unless the sum is below 1e-13.)
- ``GptOssMLP``: router Linear with bias, top-k of the logits then softmax
  over those k (= softmax + renormalize); experts ``gate_up_proj`` [E, H, 2I]
  with gate/up interleaved along 2I, ``down_proj`` [E, I, H], both with
  biases; swigluoai: gate = min(gate, limit), up = clamp(up, -limit, limit),
  out = (up + 1) * gate * sigmoid(alpha * gate).

The experts' layout flags set by transformers' ``use_experts_implementation``
(``is_transposed``, ``is_concatenated``, ``has_bias``) say how to read the 3-D
parameters. Tensors are detached from the module (views, or copies where a
transpose is needed). transformers is not imported: blocks are recognised by
class name, so this module costs nothing when transformers is absent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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

__all__ = ["HFMoE", "SharedExpert", "extract", "moe_forward", "SUPPORTED_BLOCKS"]

# transformers activation classes (``ACT2FN[config.hidden_act]``) -> fusedmoe's gated activation
_ACTIVATIONS = {
    "SiLUActivation": Activation.SILU,
    "SiLU": Activation.SILU,
    "GELUActivation": Activation.GELU,
    "GELU": Activation.GELU,
    "GELUTanh": Activation.GELU_TANH,
    "NewGELUActivation": Activation.GELU_TANH,
}


def _activation(act_fn: object, where: str) -> Activation:
    name = type(act_fn).__name__
    if name == "GELU":
        approx = getattr(act_fn, "approximate", "none")
        return Activation.GELU_TANH if approx == "tanh" else Activation.GELU
    expect(name in _ACTIVATIONS, f"{where}.act_fn", f"one of {sorted(_ACTIVATIONS)}", name)
    return _ACTIVATIONS[name]


def _get(obj: object, name: str, where: str):
    expect(hasattr(obj, name), f"{where}.{name}", "an attribute of a transformers 5.x MoE block")
    v = getattr(obj, name)
    return v.detach() if isinstance(v, torch.Tensor) else v


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
        lins = {n: _get(mlp, n, where) for n in ("gate_proj", "up_proj", "down_proj")}
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
            activation=_activation(_get(mlp, "act_fn", where), where),
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


def _experts(experts: object, where: str, num_experts: int, hidden: int):
    """(w13 [E, 2I, H], w2 [E, H, I], b13, b2, interleaved) from a fused ``*Experts`` module."""
    expect(
        not isinstance(experts, torch.nn.ModuleList),
        f"{where}",
        "fused 3-D expert parameters (transformers >= 5); a ModuleList of experts is not supported",
    )
    expect(getattr(experts, "has_gate", True), f"{where}.has_gate", "True (gated experts)")
    expect(
        not getattr(experts, "has_post_expert_norm", False),
        f"{where}.has_post_expert_norm",
        "False",
    )
    w13 = _get(experts, "gate_up_proj", where)
    w2 = _get(experts, "down_proj", where)
    expect(w13.dim() == 3 and w2.dim() == 3, f"{where}.gate_up_proj/down_proj", "3-D tensors")
    if getattr(experts, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    w13, w2 = w13.contiguous(), w2.contiguous()
    inter = w2.shape[2]
    expect(
        tuple(w13.shape) == (num_experts, 2 * inter, hidden),
        f"{where}.gate_up_proj",
        f"[E, 2I, H] = {(num_experts, 2 * inter, hidden)} after the layout flags",
        tuple(w13.shape),
    )
    b13 = b2 = None
    if getattr(experts, "has_bias", False):
        b13 = _get(experts, "gate_up_proj_bias", where)
        b2 = _get(experts, "down_proj_bias", where)
    interleaved = not getattr(experts, "is_concatenated", True)
    return w13, w2, b13, b2, interleaved


def _default_gate(experts: object, where: str) -> Activation:
    """The activation of experts that use transformers' default ``act_fn(gate) * up``."""
    gate_fn = getattr(type(experts), "_apply_gate", None)
    expect(
        gate_fn is None or gate_fn.__name__ == "_default_apply_gate",
        f"{where}._apply_gate",
        "transformers' default act_fn(gate) * up",
        getattr(gate_fn, "__qualname__", gate_fn),
    )
    return _activation(_get(experts, "act_fn", where), where)


def _build(
    block: object,
    router: RouterConfig,
    router_weight: torch.Tensor,
    activation: Activation,
    *,
    router_bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    shared_expert: SharedExpert | None = None,
    **config_kw,
) -> HFMoE:
    kind = type(block).__name__
    e, h = router_weight.shape
    expect(e == router.num_experts, f"{kind} router weight", f"{router.num_experts} rows", e)
    w13, w2, b13, b2, interleaved = _experts(_get(block, "experts", kind), f"{kind}.experts", e, h)
    config = MoEConfig(
        num_experts=e,
        top_k=router.top_k,
        hidden_size=h,
        intermediate_size=w2.shape[2],
        activation=activation,
        has_bias=b13 is not None,
        gate_up_interleaved=interleaved,
        dtype=w13.dtype,
        **config_kw,
    )
    scheme = QuantScheme.unquantized()
    weights = ExpertWeights.from_float(w13, w2, scheme, b13=b13, b2=b2)
    check_weights(weights, config, scheme)
    return HFMoE(
        kind=kind,
        config=config,
        router=router,
        weights=weights,
        router_weight=router_weight,
        router_bias=router_bias,
        correction_bias=correction_bias,
        shared_expert=shared_expert,
    )


def _softmax_topk(block: object, renormalize: bool | None = None, shared=None) -> HFMoE:
    """Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE: ``block.gate`` is a softmax top-k router."""
    kind = type(block).__name__
    expect(
        not (block.training and getattr(block, "jitter_noise", 0)),
        f"{kind}.jitter_noise",
        "0 or the block in eval mode (router jitter is random)",
    )
    gate = _get(block, "gate", kind)
    if renormalize is None:
        renormalize = bool(_get(gate, "norm_topk_prob", f"{kind}.gate"))
    router = RouterConfig(
        num_experts=_get(gate, "num_experts", f"{kind}.gate"),
        top_k=_get(gate, "top_k", f"{kind}.gate"),
        scoring="softmax",
        renormalize=renormalize,
    )
    experts = _get(block, "experts", kind)
    return _build(
        block,
        router,
        _get(gate, "weight", f"{kind}.gate"),
        _default_gate(experts, f"{kind}.experts"),
        shared_expert=shared,
    )


def _mixtral(block) -> HFMoE:
    return _softmax_topk(block, renormalize=True)


def _qwen_like(block) -> HFMoE:
    return _softmax_topk(block)


def _qwen2_moe(block) -> HFMoE:
    kind = type(block).__name__
    shared = SharedExpert.from_mlp(
        _get(block, "shared_expert", kind),
        f"{kind}.shared_expert",
        gate=_get(block, "shared_expert_gate", kind),
    )
    return _softmax_topk(block, shared=shared)


def _deepseek_v2(block) -> HFMoE:
    kind = type(block).__name__
    gate = _get(block, "gate", kind)
    method = _get(gate, "topk_method", f"{kind}.gate")
    methods = ("greedy", "group_limited_greedy")
    expect(method in methods, f"{kind}.gate.topk_method", f"one of {methods}", method)
    grouped = method == "group_limited_greedy"
    router = RouterConfig(
        num_experts=_get(gate, "num_experts", f"{kind}.gate"),
        top_k=_get(gate, "top_k", f"{kind}.gate"),
        scoring="softmax",
        renormalize=False,
        num_expert_group=_get(gate, "num_group", f"{kind}.gate") if grouped else None,
        topk_group=_get(gate, "topk_group", f"{kind}.gate") if grouped else None,
        routed_scaling_factor=float(_get(gate, "routed_scaling_factor", f"{kind}.gate")),
    )
    return _build(
        block,
        router,
        _get(gate, "weight", f"{kind}.gate"),
        _default_gate(_get(block, "experts", kind), f"{kind}.experts"),
        shared_expert=SharedExpert.from_mlp(_get(block, "shared_experts", kind), f"{kind}.shared_experts"),
    )


def _deepseek_v3(block) -> HFMoE:
    kind = type(block).__name__
    gate = _get(block, "gate", kind)
    where = f"{kind}.gate"
    router = RouterConfig(
        num_experts=_get(gate, "num_experts", where),
        top_k=_get(gate, "top_k", where),
        scoring="sigmoid",
        renormalize=bool(_get(gate, "norm_topk_prob", where)),
        num_expert_group=_get(gate, "num_group", where),
        topk_group=_get(gate, "topk_group", where),
        routed_scaling_factor=float(_get(gate, "routed_scaling_factor", where)),
    )
    return _build(
        block,
        router,
        _get(gate, "weight", where),
        _default_gate(_get(block, "experts", kind), f"{kind}.experts"),
        correction_bias=_get(gate, "e_score_correction_bias", where),
        shared_expert=SharedExpert.from_mlp(_get(block, "shared_experts", kind), f"{kind}.shared_experts"),
    )


def _gpt_oss(block) -> HFMoE:
    kind = type(block).__name__
    gate = _get(block, "router", kind)
    experts = _get(block, "experts", kind)
    where = f"{kind}.router"
    router = RouterConfig(
        num_experts=_get(gate, "num_experts", where),
        top_k=_get(gate, "top_k", where),
        scoring="softmax",
        renormalize=True,
    )
    expect(
        getattr(experts, "has_bias", False) and not getattr(experts, "is_concatenated", True),
        f"{kind}.experts",
        "biased experts with gate/up interleaved (has_bias=True, is_concatenated=False)",
    )
    return _build(
        block,
        router,
        _get(gate, "weight", where),
        Activation.SWIGLUOAI,
        router_bias=_get(gate, "bias", where),
        swiglu_alpha=float(_get(experts, "alpha", f"{kind}.experts")),
        swiglu_limit=float(_get(experts, "limit", f"{kind}.experts")),
    )


SUPPORTED_BLOCKS: dict[str, Callable[[object], HFMoE]] = {
    "MixtralSparseMoeBlock": _mixtral,
    "Qwen2MoeSparseMoeBlock": _qwen2_moe,
    "Qwen3MoeSparseMoeBlock": _qwen_like,
    "OlmoeSparseMoeBlock": _qwen_like,
    "DeepseekV2Moe": _deepseek_v2,
    "DeepseekV3MoE": _deepseek_v3,
    "GptOssMLP": _gpt_oss,
}


def extract(block: object) -> HFMoE:
    """Read a transformers MoE block instance (one of ``SUPPORTED_BLOCKS``)."""
    kind = type(block).__name__
    expect(kind in SUPPORTED_BLOCKS, "block", f"one of {sorted(SUPPORTED_BLOCKS)}", kind)
    return SUPPORTED_BLOCKS[kind](block)


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
