"""A transformers experts module on fusedmoe: what it computes, and a lean runner for it.

transformers 5 keeps a block's routed experts as 3-D parameters of one ``*Experts`` module
decorated with ``use_experts_implementation``, whose flags say how to read them::

    has_gate             gate_up_proj [E, 2I, H]; else up_proj [E, I, H] (non-gated activation)
    is_transposed        gate_up_proj [E, H, 2I] and down_proj [E, I, H] instead of
                         [E, 2I, H] and [E, H, I]
    is_concatenated      gate rows, then up rows; else interleaved (gpt-oss)
    has_bias             gate_up_proj_bias [E, 2I] (up_proj_bias), down_proj_bias [E, H]
    has_post_expert_norm post_expert_norm(expert output), before the router weight

The activation is ``act_fn(gate) * up`` (transformers' default ``_apply_gate``) or the
class's own ``_apply_gate``, recognised by its code (``hf_source.code_key``; the table
``_GATES`` names a class with each). ``read_experts`` turns a module into an
``ExpertsSpec``: the weights are *views* of the parameters (a transposed layout is a
strided view, which every backend takes), never copies.

``ExpertsRunner`` is what runs per call: the kernel (``oracle.build_kernel``, once), the
weights (padded / converted / quantized once, when the backend or ``quantize`` asks), and a
``__call__`` that does no more than a dtype and shape check, a ``TopK`` (0.4 us) and the
kernel's own run: 2.3 us per call on top of the kernel, with the freshness check below
(0.5 us), measured on a 2-core CPU (1 thread, Qwen3-MoE tiny, 2026-11-25). No config is
built, no oracle asked, nothing validated but shapes. ``bind_runner`` caches one on the
module (``module.__dict__``, so it goes with the module) keyed on the parameters'
(data_ptr, version): moving, casting or replacing a parameter builds a new one at the next
call. (An in-place change through ``.data`` bumps no version; the weights are views, so it
is seen anyway unless they were converted.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import Activation, MoEConfig
from ..errors import expect
from ..metadata import TopK
from ..oracle.build import build_kernel
from ..oracle.padding import pad_weights
from ..platform import Platform
from ..quant import QuantScheme
from ..weights import ExpertWeights
from .hf_source import code_key

__all__ = ["ExpertsRunner", "ExpertsSpec", "RunOptions", "activation_of", "bind_runner", "read_experts"]

_RUNNER = "_fusedmoe_runner"

# transformers activation modules/functions by class or function name -> (gated, non-gated) activation
_ACTS = {
    "SiLUActivation": (Activation.SILU, Activation.SILU_NO_MUL),
    "SiLU": (Activation.SILU, Activation.SILU_NO_MUL),
    "silu": (Activation.SILU, Activation.SILU_NO_MUL),
    "GELUActivation": (Activation.GELU, Activation.GELU_NO_MUL),
    "gelu": (Activation.GELU, Activation.GELU_NO_MUL),
    "GELUTanh": (Activation.GELU_TANH, None),
    "PytorchGELUTanh": (Activation.GELU_TANH, None),
    "NewGELUActivation": (Activation.GELU_TANH, None),
    "ReLU": (None, Activation.RELU_NO_MUL),
    "relu": (None, Activation.RELU_NO_MUL),
    "ReLUSquaredActivation": (None, Activation.RELU2_NO_MUL),
}


def activation_of(act_fn: object, where: str, gated: bool = True) -> Activation:
    """fusedmoe's activation for ``act_fn`` (an ``ACT2FN`` entry, module or function)."""
    name = getattr(act_fn, "__name__", type(act_fn).__name__)
    if name == "GELU":  # torch.nn.GELU: exact or tanh
        tanh = getattr(act_fn, "approximate", "none") == "tanh"
        acts = (Activation.GELU_TANH, None) if tanh else (Activation.GELU, Activation.GELU_NO_MUL)
    else:
        acts = _ACTS.get(name, (None, None))
    act = acts[0 if gated else 1]
    kinds = sorted(n for n, a in _ACTS.items() if a[0 if gated else 1] is not None)
    expect(act is not None, f"{where}.act_fn", f"one of {kinds} ({'gated' if gated else 'non-gated'})", name)
    return act


def _silu_gate(m, where: str) -> None:
    act = activation_of(m.act_fn, where)
    expect(act is Activation.SILU, f"{where}.act_fn", "SiLU (the clamped gate is a SwiGLU)", type(m.act_fn).__name__)


def _softcapped(m, where: str) -> dict:
    """Inkling-2: act_fn(gate, up) = cap(gate) * sigmoid(gate) * cap(up), cap(v) = c tanh(v / c)."""
    act = m.act_fn
    expect(code_key(type(act)) == _SOFTCAP_SWIGLU_KEY, f"{where}.act_fn", "a SoftcappedSwiGLU", type(act).__name__)
    for cap in (act.gate_softcap, act.up_softcap):
        expect(code_key(type(cap)) == _SOFTCAP_KEY, f"{where}.act_fn caps", "c * tanh(v / c)", type(cap).__name__)
    return dict(
        activation=Activation.SILU_SOFTCAP, swiglu_limit=act.gate_softcap.softcap, swiglu_alpha=act.up_softcap.softcap
    )


def _clamped_silu(m, where: str, limit: float, post: bool = False) -> dict:
    _silu_gate(m, where)
    if limit == float("inf"):
        return dict(activation=Activation.SILU)
    return dict(activation=Activation.SILU_CLAMP_POST if post else Activation.SILU_CLAMP, swiglu_limit=float(limit))


# Classes' own ``_apply_gate``, by code key. Each entry names one class whose method has it.
_GATES: dict[str, Callable[[object, str], dict]] = {
    # GptOssExperts: interleaved gate/up, (up + 1) * gate * sigmoid(alpha gate), both clamped
    "03f0f0858112": lambda m, w: dict(activation=Activation.SWIGLUOAI, swiglu_alpha=m.alpha, swiglu_limit=m.limit),
    # OpenAIPrivacyFilterExperts: the same on [gate; up]
    "6973d1428fba": lambda m, w: dict(activation=Activation.SWIGLUOAI, swiglu_alpha=m.alpha, swiglu_limit=m.limit),
    # MiniMaxM3VLExperts: the same, parameters named swiglu_*
    "217552fa9c79": lambda m, w: dict(
        activation=Activation.SWIGLUOAI, swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit
    ),
    # DeepseekV4Experts: act_fn(min(gate, limit)) * clamp(up, +-limit)
    "8a8702472bdc": lambda m, w: _clamped_silu(m, w, m.limit),
    # HYV4Experts, Glm5NextTextExperts: silu(min(gate, swiglu_limit)) * clamp(up, +-swiglu_limit)
    "f22f05c10179": lambda m, w: dict(activation=Activation.SILU_CLAMP, swiglu_limit=float(m.swiglu_limit)),
    # BeamExperts: act_fn(gate) * up computed in float32 (the default, rounded once less)
    "c03299e2dffe": lambda m, w: dict(activation=activation_of(m.act_fn, w)),
    # Inkling2Experts: act_fn(gate, up), a soft-capped SwiGLU
    "f99202f01776": _softcapped,
    # Step3p7Experts: min(act_fn(gate), limit) * clamp(up, +-limit); no limit (inf) is plain SwiGLU
    "a5d542a6195c": lambda m, w: _clamped_silu(m, w, m.limit, post=True),
}
_SOFTCAP_SWIGLU_KEY = "20938d4b76c0"  # Inkling2SoftcappedSwiGLU
_SOFTCAP_KEY = "ef8046154aee"  # Inkling2Softcap


def _gate_activation(m, where: str, gated: bool) -> dict:
    fn = getattr(type(m), "_apply_gate", None)
    if not gated or fn is None or getattr(fn, "__qualname__", "") == "_default_apply_gate":
        return dict(activation=activation_of(m.act_fn, where, gated))
    key = code_key(fn)
    expect(
        key in _GATES,
        f"{where}._apply_gate",
        "transformers' act_fn(gate) * up or a gate fusedmoe knows (gpt-oss, DeepSeek-V4, Inkling-2, ...)",
        f"{fn.__qualname__} (code key {key})",
    )
    return _GATES[key](m, where)


@dataclass
class ExpertsSpec:
    """The routed experts of one block, in fusedmoe's terms.

    w13 [E, 2I, H] (or [E, I, H], non-gated), w2 [E, H, I], b13, b2: views or tensors.
    act: ``MoEConfig`` keyword arguments of the activation. post_norm: applied to each
    expert's output before its router weight, or None. params: the module's parameter
    names the weights view (their (data_ptr, version) key a cached runner).
    """

    kind: str
    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    interleaved: bool = False
    act: dict = field(default_factory=lambda: {"activation": Activation.SILU})
    identity_experts: int = 0
    apply_router_weight_on_input: bool = False
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    params: tuple[str, ...] = ()

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    def config(self, top_k: int) -> MoEConfig:
        """The layer's ``MoEConfig`` for ``top_k`` experts per token (1 per (token, expert)
        pair with a post-expert norm, see ``ExpertsRunner``)."""
        return MoEConfig(
            num_experts=self.num_experts,
            top_k=1 if self.post_norm is not None else top_k,
            hidden_size=self.hidden_size,
            intermediate_size=self.w2.shape[2],
            has_bias=self.b13 is not None,
            gate_up_interleaved=self.interleaved,
            identity_experts=self.identity_experts,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            dtype=self.w13.dtype,
            **self.act,
        )

    def weights(self) -> ExpertWeights:
        return ExpertWeights.from_float(self.w13, self.w2, QuantScheme.unquantized(), b13=self.b13, b2=self.b2)


def _param(m, name: str, where: str) -> torch.Tensor:
    p = getattr(m, name, None)
    expect(isinstance(p, torch.Tensor), f"{where}.{name}", "a tensor (a transformers 5 experts module)", type(p))
    return p.detach()


def read_experts(m: torch.nn.Module) -> ExpertsSpec:
    """The ``ExpertsSpec`` of a ``use_experts_implementation`` experts module (module docstring)."""
    where = type(m).__name__
    expect(
        not getattr(m, "_is_expert_parallel", False),
        f"{where}._is_expert_parallel",
        "False (transformers' expert parallelism sends sentinel ids fusedmoe does not take)",
    )
    gated = bool(getattr(m, "has_gate", True))
    names = ["gate_up_proj" if gated else "up_proj", "down_proj"]
    if getattr(m, "has_bias", False):
        names += [f"{names[0]}_bias", "down_proj_bias"]
    w13, w2 = _param(m, names[0], where), _param(m, names[1], where)
    expect(w13.dim() == 3 and w2.dim() == 3, f"{where}.{names[0]}/down_proj", "3-D tensors", (w13.dim(), w2.dim()))
    if getattr(m, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    e, rows, h = w13.shape
    inter = w2.shape[2]
    expect(
        rows == (2 if gated else 1) * inter and tuple(w2.shape[:2]) == (e, h),
        f"{where} weights",
        f"{names[0]} [E, {'2I' if gated else 'I'}, H] and down_proj [E, H, I] after the layout flags",
        (tuple(w13.shape), tuple(w2.shape)),
    )
    b13 = b2 = None
    if len(names) > 2:
        b13, b2 = _param(m, names[2], where), _param(m, names[3], where)
    post = m.post_expert_norm if getattr(m, "has_post_expert_norm", False) else None
    return ExpertsSpec(
        kind=where,
        w13=w13,
        w2=w2,
        b13=b13,
        b2=b2,
        interleaved=gated and not getattr(m, "is_concatenated", True),
        act=_gate_activation(m, where, gated),
        post_norm=post,
        params=tuple(names),
    )


@dataclass(frozen=True)
class RunOptions:
    """How experts run: the backend ("auto": the oracle's choice), an optional scheme to
    quantize unquantized weights to (once, when the runner is built), the platform."""

    backend: str = "auto"
    quantize: QuantScheme | None = None
    platform: Platform | None = None


class ExpertsRunner:
    """One experts module's kernel and weights: ``runner(x [T, H], ids [T, K], weights [T, K])``
    -> [T, H] in x's dtype (see the module docstring).

    With a post-expert norm each (token, expert) pair runs as a token of its own (top-1,
    weight 1), is normalised, then weighted and summed in float32, as transformers does.
    """

    def __init__(self, spec: ExpertsSpec, top_k: int, options: RunOptions) -> None:
        config = spec.config(top_k)
        weights = spec.weights()
        scheme = options.quantize or QuantScheme.unquantized()
        if options.quantize is not None:
            expect(
                scheme.a1 is None or scheme.a1.dynamic,
                "quantize",
                "a scheme with dynamic activation scales (nothing calibrates static ones)",
                scheme.name,
            )
            w13, w2 = spec.w13.float().contiguous(), spec.w2.float().contiguous()
            weights = ExpertWeights.from_float(w13, w2, scheme, b13=spec.b13, b2=spec.b2)
        kernel = build_kernel(config, scheme, backend=options.backend, platform=options.platform)
        weights = pad_weights(weights, config, scheme, kernel.choice.align)
        self.weights = kernel.experts.prepare_weights(weights)
        self.kernel = kernel
        self.options = options
        self.top_k = top_k
        self.hidden = config.hidden_size
        self.dtype = config.dtype
        self.pad = kernel.config.hidden_size - config.hidden_size
        self.post_norm = spec.post_norm
        self.params = spec.params
        self.key: tuple = ()

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
            expect(False, "experts inputs", f"x [T, {self.hidden}], ids and weights [T, K]", (x.shape, ids.shape))
        dtype = x.dtype
        if dtype != self.dtype:
            x = x.to(self.dtype)
        if self.post_norm is None:
            out = self._run(x, ids, weights)
        else:
            t, k = ids.shape
            ones = torch.ones(t * k, 1, dtype=torch.float32, device=x.device)
            y = self.post_norm(self._run(x.repeat_interleave(k, dim=0), ids.reshape(-1, 1), ones))
            out = (y.view(t, k, -1).float() * weights.unsqueeze(-1).float()).sum(dim=1).to(self.dtype)
        return out if dtype == self.dtype else out.to(dtype)

    def _run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.pad:
            x = F.pad(x, (0, self.pad))
        out = self.kernel(x.contiguous(), TopK(ids, weights), self.weights)
        return out[:, : self.hidden] if self.pad else out

    def fresh(self, m: torch.nn.Module, top_k: int, options: RunOptions) -> bool:
        """Still right for module ``m``'s parameters, ``top_k`` and ``options``?"""
        return self.options is options and self.top_k == top_k and self.key == _param_key(m, self.params)


def _param_key(m: torch.nn.Module, names: tuple[str, ...]) -> tuple:
    params = m._parameters
    key = []
    for n in names:
        p = params.get(n)
        if p is None:
            return ()
        key += (p.data_ptr(), p._version)
    return tuple(key)


def bind_runner(m: torch.nn.Module, top_k: int, options: RunOptions) -> ExpertsRunner:
    """The runner cached on experts module ``m`` (built now if missing or stale): a transformers
    experts module, or any module with an ``experts_spec()`` method (``hf_moe.OwnedExperts``)."""
    runner = m.__dict__.get(_RUNNER)
    if runner is None or not runner.fresh(m, top_k, options):
        spec = m.experts_spec() if hasattr(type(m), "experts_spec") else read_experts(m)
        runner = ExpertsRunner(spec, top_k, options)
        runner.key = _param_key(m, runner.params)
        m.__dict__[_RUNNER] = runner
    return runner
