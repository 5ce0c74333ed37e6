"""transformers routers in fusedmoe's terms: router module -> ``Routing``.

A ``Routing`` is what ``RouterConfig.route`` needs: the config (scoring, renormalization,
groups, scaling, soft-cap, ...), how the logits are made (the router's Linear weight and
bias, in float32 or in the weight's dtype, times a scale) and the correction bias. A
router is recognised by its code key (``hf_source.code_key``): ``ROUTERS`` maps each key to
a recipe that reads the router's (and its block's) attributes; the comment on each names a
class with that code (modular copies share it: DeepSeek-V3's router serves 18 models).

What the code of each does, with fusedmoe's equivalent where it is not literal:

- top-k of the logits, then softmax over those k = softmax + renormalize (gpt-oss, Granite,
  Aria, JetMoE, Cohere2); sigmoid over the top-k logits = sigmoid, top-k (Llama-4, Cohere2).
- a denominator ``sum + 1e-20`` (or ``+ 1e-6``, ``+ 1e-15``, ``clamp(min=1e-12)``) = the
  renormalization (fusedmoe clamps the sum at the smallest normal float): equal in float32
  unless the k weights sum below the epsilon.
- groups masked with 0.0 instead of -inf: the same choice when every kept score is > 0
  (softmax scores); with a sigmoid plus a correction bias (AXK-2) a kept choice may be
  negative, so that router is not mapped.
- logits in the model dtype are rounded as transformers rounds them (``fp32=False`` casts x
  to the weight's dtype, a no-op in the model); ``fp32=True`` casts both to float32.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import expect
from ..metadata import TopK
from ..routing import RouterConfig
from .hf_source import code_key

__all__ = ["ROUTERS", "Routing", "routing_of"]


@dataclass
class Routing:
    """A block's routing: logits = logit_scale * (x @ weight^T + bias) (``logits_fn`` instead
    when set), then ``config.route(logits, correction_bias)``; or ``topk_fn(hidden_states)``,
    the model's own router giving a ``TopK`` (capacity routing fusedmoe does not compute)."""

    config: RouterConfig | None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    fp32: bool = False
    logit_scale: float = 1.0
    correction_bias: torch.Tensor | None = None
    logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    topk_fn: Callable[[torch.Tensor], TopK] | None = None


def get(obj: object, name: str, where: str):
    """``obj.<name>`` (a dotted path), or a ``FusedMoEError`` naming ``where.<name>``."""
    for part in name.split("."):
        expect(hasattr(obj, part), f"{where}.{name}", "an attribute this router/block recipe reads")
        obj = getattr(obj, part)
    return obj


def _config(r, where: str, scoring: str, renormalize=False, scale=1.0, **kw) -> RouterConfig:
    return RouterConfig(
        num_experts=int(get(r, "num_experts", where)),
        top_k=int(get(r, "top_k", where)),
        scoring=scoring,
        renormalize=bool(renormalize),
        routed_scaling_factor=float(scale),
        **kw,
    )


def _linear(r, where: str, scoring: str, *, fp32=False, weight="weight", bias=None, **kw) -> Routing:
    """A router whose logits are one Linear of x."""
    return Routing(
        _config(r, where, scoring, **kw),
        weight=get(r, weight, where),
        bias=None if bias is None else get(r, bias, where),
        fp32=fp32,
    )


def _groups(r, where: str, score: str | None = None) -> dict:
    return dict(num_expert_group=get(r, "num_group", where), topk_group=get(r, "topk_group", where), group_score=score)


def _biased(routing: Routing, bias: torch.Tensor | None) -> Routing:
    routing.correction_bias = None if bias is None else bias.detach()
    return routing


def _deepseek_v3(r, b, w):
    """sigmoid; choice + correction bias, groups by their two best; renormalize iff
    norm_topk_prob; times routed_scaling_factor. Logits in float32."""
    rt = _linear(r, w, "sigmoid", fp32=True, renormalize=get(r, "norm_topk_prob", w),
                 scale=get(r, "routed_scaling_factor", w), **_groups(r, w))  # fmt: skip
    return _biased(rt, get(r, "e_score_correction_bias", w))


def _beam(r, b, w):
    """DeepSeek-V3's router without the scaling factor (the block multiplies the output)."""
    rt = _linear(r, w, "sigmoid", fp32=True, renormalize=get(r, "norm_topk_prob", w), **_groups(r, w))
    return _biased(rt, get(r, "e_score_correction_bias", w))


def _deepseek_v2(r, b, w):
    """softmax; greedy or group-limited greedy (a group scores its best); no renormalization;
    times routed_scaling_factor. Logits in float32."""
    method = get(r, "topk_method", w)
    methods = ("greedy", "group_limited_greedy")
    expect(method in methods, f"{w}.topk_method", f"one of {methods}", method)
    groups = _groups(r, w) if method == "group_limited_greedy" else {}  # no bias: a group scores its best
    return _linear(r, w, "softmax", fp32=True, scale=get(r, "routed_scaling_factor", w), **groups)


def _mistral4(r, b, w, fp32=False, renormalize=None):
    """softmax; groups by their two best scores, no correction bias; renormalize; scale."""
    norm = get(r, "norm_topk_prob", w) if renormalize is None else renormalize
    return _linear(r, w, "softmax", fp32=fp32, renormalize=norm, scale=get(r, "routed_scaling_factor", w),
                   **_groups(r, w, "top2_sum"))  # fmt: skip


def _kolibri(r, b, w):
    """top-k of logits + correction bias, weights sigmoid(logit); renormalize iff norm_topk_prob."""
    rt = _linear(r, w, "sigmoid", fp32=True, renormalize=get(r, "norm_topk_prob", w), bias_on_logits=True)
    return _biased(rt, get(r, "e_score_correction_bias", w))


def _sigmoid_biased(r, w, bias, *, fp32=False, scale=1.0, weight="weight", **kw) -> Routing:
    """sigmoid; choice + correction bias (no groups); renormalize; scale."""
    rt = _linear(r, w, "sigmoid", fp32=fp32, renormalize=True, scale=scale, weight=weight, **kw)
    return _biased(rt, bias)


def _lfm2(r, b, w):
    """sigmoid, the block's expert_bias for the choice when use_expert_bias; renormalize iff
    norm_topk_prob (sum + 1e-6); routed_scaling_factor."""
    bias = get(b, "expert_bias", w) if get(r, "use_expert_bias", w) else None
    rt = _linear(r, w, "sigmoid", renormalize=get(r, "norm_topk_prob", w), scale=get(r, "routed_scaling_factor", w))
    return _biased(rt, bias)


def _laguna(r, b, w):
    """c * tanh(logits / c) when router_logit_softcapping c > 0; then sigmoid + bias, renormalize."""
    cap = float(get(r, "router_logit_softcapping", w))
    return _sigmoid_biased(r, w, get(r, "e_score_correction_bias", w), logit_softcap=cap if cap > 0 else None)


def _muse(r, b, w):
    """logits * output_multiplier, sigmoid + bias, renormalize (sum + 1e-15), scale. float32."""
    rt = _sigmoid_biased(r, w, get(r, "e_score_correction_bias", w), fp32=True,
                         scale=get(r, "routed_scaling_factor", w))  # fmt: skip
    rt.logit_scale = float(get(r, "output_multiplier", w))
    return rt


def _scored(r, b, w):
    """score_fn (ACT2FN[scoring_func]; sigmoid only) + bias, renormalize, scale. float32."""
    fn = type(get(r, "score_fn", w)).__name__
    expect(fn in ("Sigmoid", "SigmoidActivation"), f"{w}.score_fn", "sigmoid (fusedmoe scores with it)", fn)
    return _sigmoid_biased(r, w, get(r, "e_score_correction_bias", w), fp32=True,
                           scale=get(r, "routed_scaling_factor", w))  # fmt: skip


def _ernie(r, b, w):
    """softmax; choice + moe_statics.e_score_correction_bias [1, E]; renormalize (sum clamped
    at moe_norm_min). float32."""
    statics = get(r, "moe_statics", w)
    expect(code_key(type(statics)) == "053c666a6316", f"{w}.moe_statics", "scores + bias (Ernie4_5_MoeStatics)")
    rt = _linear(r, w, "softmax", fp32=True, renormalize=True)
    return _biased(rt, get(statics, "e_score_correction_bias", w).reshape(-1))


def _cohere2(r, b, w):
    """top-k of logits, then softmax over them (= softmax, renormalize) or sigmoid
    (renormalize iff norm_topk_prob), per expert_selection_fn."""
    fn = get(r, "expert_selection_fn", w)
    expect(fn in ("softmax", "sigmoid"), f"{w}.expert_selection_fn", "softmax or sigmoid", fn)
    norm = True if fn == "softmax" else get(r, "norm_topk_prob", w)
    return _linear(r, w, fn, renormalize=norm)


def _phimoe(r, b, w):
    """sparsemixer (module function of the router's file) with eps = router_jitter_noise."""
    fn = getattr(sys.modules[type(r).__module__], "sparsemixer", None)
    expect(fn is not None and code_key(fn) == "34d6107b66ef", f"{w} sparsemixer", "PhiMoE's sparsemixer")
    eps = float(get(r, "router_jitter_noise", w))
    return _linear(r, w, "sparsemixer", bias="bias" if r.bias is not None else None, sparsemixer_eps=eps)


def _longcat(r, b, w):
    """classifier.weight (its bias unused) in float32; softmax; choice + bias; no
    renormalization; routed_scaling_factor. Identity experts are among the n_routed_experts."""
    e, k = int(get(r, "n_routed_experts", w)), int(get(r, "top_k", w))
    config = RouterConfig(
        e, k, scoring="softmax", renormalize=False, routed_scaling_factor=float(get(r, "routed_scaling_factor", w))
    )
    routing = Routing(config, weight=get(r, "classifier.weight", w), fp32=True)
    return _biased(routing, get(r, "e_score_correction_bias", w))


def _privacy(r, b, w):
    """gpt-oss's router in float32, weights divided by top_k (the block multiplies them back)."""
    k = int(get(r, "top_k", w))
    return _linear(r, w, "softmax", fp32=True, bias="bias", renormalize=True, scale=1.0 / k)


def _plain(scoring: str, norm: bool | str = True, **kw) -> Callable[..., Routing]:
    """A Linear, ``scoring``, top-k; renormalized when ``norm`` is True or names a true attribute."""

    def recipe(r, b, w):
        return _linear(r, w, scoring, renormalize=get(r, norm, w) if isinstance(norm, str) else norm, **kw)

    return recipe


def _biased_by(owner: str, attr: str, scale: str | None = None, **kw) -> Callable[..., Routing]:
    """sigmoid + the correction bias ``attr`` of the router ("r") or its block ("b"), renormalize,
    times the router attribute ``scale``."""

    def recipe(r, b, w):
        s = 1.0 if scale is None else get(r, scale, w)
        return _sigmoid_biased(r, w, get(r if owner == "r" else b, attr, w), scale=s, **kw)

    return recipe


# Router code key -> recipe(router, block, where) -> Routing. The comment names a class with the code.
ROUTERS: dict[str, Callable[..., Routing]] = {
    "525e78e7bd38": _deepseek_v3,  # DeepseekV3TopkRouter (and Glm4Moe, Dots1, KimiLinear, NemotronH, ...)
    "1892e52b5cb1": _beam,  # BeamTopKRouter
    "a65e9d8e4f61": _deepseek_v2,  # DeepseekV2TopkRouter (DeepseekOcr2, UnlimitedOcr)
    "43617d85251c": _mistral4,  # Mistral4TopkRouter: logits in the model dtype
    "a96010a1024e": lambda r, b, w: _mistral4(r, b, w, fp32=True, renormalize=True),  # MistralLarge4TextTopkRouter
    "51cf25b4eb5c": _kolibri,  # Kolibri1TopKRouter
    "fb3071501912": _plain("softmax", "norm_topk_prob"),  # Qwen2MoeTopKRouter (Qwen3-MoE, OLMoE, Mellum, ...)
    "27717c89f6e7": _plain("softmax", "norm_topk_prob", fp32=True),  # LaraMiniTopKRouter
    "d30a28ec913a": _plain("softmax"),  # Qwen3VLMoeTextTopKRouter (Qwen3.5-MoE, Qwen3-Omni)
    "c85441190b5c": _plain("softmax"),  # MixtralTopKRouter (MiniMax)
    "86524d221f38": _plain("softmax"),  # GraniteMoeTopKRouter: top-k of the logits, then softmax
    "d8ff4553b6f8": _plain("softmax"),  # AriaTextTopKRouter: the same
    "0b73b4f05658": _plain("softmax", weight="layer.weight"),  # JetMoeTopKGating: the same
    "98e66b4a7ec8": _plain("softmax", weight="wg.weight"),  # HunYuanMoEV1Gate: float32 when wg's weight is
    "18e47a9f1830": _plain("softmax", bias="bias"),  # GptOssTopKRouter: the same, with a bias
    "e7070777fdaa": _plain("softmax", False),  # JambaTopKRouter: no renormalization
    "53b38353f9ad": _plain("sigmoid", "norm_topk_prob", fp32=True),  # FlintTopKRouter
    "f9b0888504a7": _plain("sigmoid", False),  # Llama4Router: sigmoid of the top-k logits
    "659c36604dc6": _privacy,  # OpenAIPrivacyFilterTopKRouter
    "92e21e812234": _ernie,  # Ernie4_5_MoeTopKRouter (and Ernie4_5_VLMoe's)
    "bea4b200fd08": _cohere2,  # Cohere2MoeTopKRouter
    "9f2e5ce3467c": _biased_by("r", "e_score_correction_bias"),  # MiniMaxM3VLTopKRouter, Step3p7TopKRouter
    "7ced838f58f9": _biased_by("b", "e_score_correction_bias"),  # MiniMaxM2TopKRouter
    "0dfc8e1362a1": _biased_by("b", "e_score_correction_bias", "router_scaling_factor", fp32=True),  # HYV3TopKRouter
    "c47dba6dd472": _biased_by("b", "expert_bias", "route_scale", weight="gate.weight"),  # AfmoeTokenChoiceRouter
    "910d124f2e7f": _scored,  # Inkling2TopKRouter
    "70ce25928034": _muse,  # MuseSparkTopkRouter
    "19db7e0a9531": _laguna,  # LagunaTopKRouter
    "e4df4abcb420": _lfm2,  # Lfm2MoeTopKRouter
    "51dd0ec98a11": _phimoe,  # PhimoeTopKRouter
    "efc08a5351c3": _longcat,  # LongcatFlashTopkRouter
}


def routing_of(router: torch.nn.Module, block: torch.nn.Module) -> Routing:
    """The ``Routing`` of ``router`` (a child of ``block``); a ``FusedMoEError`` naming the router
    class when its code is not one of ``ROUTERS`` or an attribute it reads is missing or wrong."""
    where = type(router).__name__
    key = code_key(type(router))
    expect(key in ROUTERS, f"{where}.forward", "a router whose code fusedmoe knows", f"code key {key}")
    return ROUTERS[key](router, block, where)
