"""Routing: router logits [T, E] -> ``TopK`` (ids int32 [T, K], weights float32 [T, K]).

``RouterConfig.route(..., fused=False)``, in plain PyTorch, is the reference every
fused routing kernel is checked against. Everything is computed in float32, whatever
the logits dtype::

    logits  = c * tanh(logits / c)         (logit_softcap c, Laguna; else unchanged)
    scores  = softmax(logits) over E      (scoring='softmax')
            | sigmoid(logits)              (scoring='sigmoid')
    choice  = scores + correction_bias     (DeepSeek-V3 ``e_score_correction_bias``; else scores)
            | logits + correction_bias     (bias_on_logits, Kolibri-1)
    grouped top-k (num_expert_group G, topk_group TG): the E experts form G
            contiguous groups of E/G; a group's score is the sum of its two
            largest ``choice`` values (group_score='top2_sum'; DeepSeek-V3, Mistral-4)
            or its largest one ('max', DeepSeek-V2); unset, 'top2_sum' when a
            correction bias is given, else 'max'. The TG best groups are kept
            and experts of the other groups cannot be chosen.
    ids     = the K experts with the largest ``choice``
    weights = scores[ids]                  (the *unbiased* scores)
            / sum(weights)                 (renormalize)
            * routed_scaling_factor

scoring='sparsemixer' (PhiMoE, inference form; K = 2, no groups or bias): the first
expert is the largest logit m1, weighted by softmax over the logits within
``sparsemixer_eps`` of it ((m1 - l) / max(|l|, m1) <= 2 eps); the second is the
largest of the others, m2, weighted the same way among the others within 2 eps of m2.

Tie-breaking is deterministic and documented: among equal values the lower id
wins, for experts and for groups alike (a stable descending sort, since
``torch.topk`` promises no order among ties). Each row of ``ids`` lists its
experts by decreasing ``choice`` (equal ones by increasing id).

softmax + renormalize equals gpt-oss's "top-k of the logits, then softmax over
those k". NaN logits give unspecified choices (the ids of a row stay distinct and in
[0, E)).

Two implementations: this one (``fused=False``; 6-25 small PyTorch kernels) and
``fusedmoe.kernels.route`` (one Triton launch; ``fused=True``), which gives the same
ids wherever no two choices are within float32 rounding of each other, and weights
within a few float32 ulps. ``fused=None`` (the default) takes the kernel when the
logits are on a CUDA device, there is no ``custom_fn``, E <= 1024
(``kernels.route.MAX_EXPERTS``) and ``FUSEDMOE_FUSED_ROUTING`` is not "0"; on the CPU
(the Triton interpreter included) it stays in PyTorch.

The fused kernel has no soft-cap, bias on logits, sparsemixer or group score other than
the default rule: with any of them the PyTorch path runs.

``custom_fn(logits, top_k) -> (weights [T, K], ids [T, K])`` replaces all of
the above (the other settings must keep their defaults). Its result's shapes and
dtypes are always checked; its values (ids in range and distinct per row, finite
weights) only with value checks on (``check_values=True`` or
``FUSEDMOE_CHECK_VALUES=1``), the policy of ``fusedmoe.modular.validation``: reading them
synchronises with the device, which would also break a ``torch.compile`` graph.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from . import env
from .errors import expect
from .metadata import TopK, int32_ids
from .modular.replay import LaunchPlans, logits_plan_key

__all__ = ["SCORINGS", "RouterConfig", "route"]


SCORINGS = ("softmax", "sigmoid", "sparsemixer")
GROUP_SCORES = ("max", "top2_sum")

CustomRoutingFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class RouterConfig:
    """How a layer turns router logits into a ``TopK`` (see the module docstring).

    num_experts:      E, the width of the logits.
    top_k:            K, experts per token (1 <= K <= E).
    scoring:          'softmax' or 'sigmoid'.
    renormalize:      divide the K weights of a token by their sum (default True: what
                      ``fused_moe`` and ``FusedMoE`` route with when given no router, and what
                      Mixtral, Qwen3 and gpt-oss do; False for DeepSeek-V2-style routers; the
                      default is False for 'sparsemixer', whose weights are its own).
    num_expert_group: G, number of expert groups for grouped top-k (None: no grouping).
    topk_group:       TG, groups kept per token (set together with G).
    routed_scaling_factor: multiplies the final weights (after renormalization).
    logit_softcap:    c: logits become c * tanh(logits / c) first (None: unchanged).
    bias_on_logits:   the correction bias is added to the logits for the choice, not to the scores.
    group_score:      'max' or 'top2_sum' (None: 'top2_sum' with a correction bias, else 'max').
    sparsemixer_eps:  the relative band of scoring='sparsemixer' (PhiMoE ``router_jitter_noise``).
    custom_fn:        ``custom_fn(logits, top_k) -> (weights, ids)`` replacing the rest.

    The repr evaluates back to an equal object; a ``custom_fn`` is written by
    its qualified name, so it must be in scope.
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool | None = None
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    logit_softcap: float | None = None
    bias_on_logits: bool = False
    group_score: str | None = None
    sparsemixer_eps: float = 0.01
    custom_fn: CustomRoutingFn | None = None

    def __post_init__(self) -> None:
        e, k = self.num_experts, self.top_k
        expect(_is_int(e) and e > 0, "RouterConfig.num_experts", "a positive int", e)
        expect(_is_int(k) and k > 0, "RouterConfig.top_k", "a positive int", k)
        expect(k <= e, "RouterConfig.top_k", f"<= num_experts ({e})", k)
        expect(self.scoring in SCORINGS, "RouterConfig.scoring", f"one of {SCORINGS}", self.scoring)
        if self.renormalize is None:  # the default: renormalize, except sparsemixer, whose weights are its own
            object.__setattr__(self, "renormalize", self.scoring != "sparsemixer")
        expect(
            isinstance(self.renormalize, bool),
            "RouterConfig.renormalize",
            "a bool",
            self.renormalize,
        )
        g, tg = self.num_expert_group, self.topk_group
        expect(
            (g is None) == (tg is None),
            "RouterConfig.num_expert_group/topk_group",
            "both set (grouped top-k) or both None",
            (g, tg),
        )
        if g is not None:
            expect(_is_int(g) and g > 0, "RouterConfig.num_expert_group", "a positive int", g)
            expect(e % g == 0, "RouterConfig.num_expert_group", f"a divisor of num_experts ({e})", g)
            expect(
                _is_int(tg) and 0 < tg <= g,
                "RouterConfig.topk_group",
                f"an int in [1, num_expert_group ({g})]",
                tg,
            )
            expect(
                k <= tg * (e // g),
                "RouterConfig.top_k",
                f"<= topk_group * experts per group ({tg} * {e // g}) so enough experts stay",
                k,
            )
        f = self.routed_scaling_factor
        expect(
            isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0,
            "RouterConfig.routed_scaling_factor",
            "a finite number > 0",
            f,
        )
        object.__setattr__(self, "routed_scaling_factor", float(f))
        self._check_extensions()
        if self.custom_fn is not None:
            expect(callable(self.custom_fn), "RouterConfig.custom_fn", "a callable", self.custom_fn)
            defaults = RouterConfig(num_experts=e, top_k=k)
            changed = [
                fl.name
                for fl in fields(self)
                if fl.name not in ("num_experts", "top_k", "custom_fn")
                and getattr(self, fl.name) != getattr(defaults, fl.name)
            ]
            expect(
                not changed,
                "RouterConfig.custom_fn",
                "the other routing settings at their defaults (custom_fn replaces them)",
                changed,
            )

    def _check_extensions(self) -> None:
        c = self.logit_softcap
        if c is not None:
            expect(_is_number(c) and math.isfinite(c) and c > 0, "RouterConfig.logit_softcap", "None or > 0", c)
            object.__setattr__(self, "logit_softcap", float(c))
        expect(isinstance(self.bias_on_logits, bool), "RouterConfig.bias_on_logits", "a bool", self.bias_on_logits)
        gs = self.group_score
        expect(gs is None or gs in GROUP_SCORES, "RouterConfig.group_score", f"None or one of {GROUP_SCORES}", gs)
        expect(gs is None or self.grouped, "RouterConfig.group_score", "None without grouped top-k", gs)
        eps = self.sparsemixer_eps
        expect(_is_number(eps) and math.isfinite(eps) and eps >= 0, "RouterConfig.sparsemixer_eps", ">= 0", eps)
        object.__setattr__(self, "sparsemixer_eps", float(eps))
        if self.scoring == "sparsemixer":
            expect(self.top_k == 2, "RouterConfig.top_k", "2 with scoring='sparsemixer'", self.top_k)
            expect(
                not (self.grouped or self.renormalize or self.bias_on_logits),
                "RouterConfig.scoring",
                "'sparsemixer' without grouped top-k, renormalize or bias_on_logits",
                self.scoring,
            )

    def __repr__(self) -> str:
        parts = []
        for fl in fields(self):
            v = getattr(self, fl.name)
            if fl.name == "custom_fn" and v is not None:
                parts.append(f"custom_fn={getattr(v, '__qualname__', repr(v))}")
            else:
                parts.append(f"{fl.name}={v!r}")
        return f"RouterConfig({', '.join(parts)})"

    @property
    def grouped(self) -> bool:
        return self.num_expert_group is not None

    def route(
        self,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
        *,
        check_values: bool = False,
        fused: bool | None = None,
        replay: bool = True,
        quantize=None,
    ) -> TopK:
        """router_logits [T, E] (any float dtype) -> TopK; correction_bias [E] or None.

        check_values: also check a ``custom_fn``'s result's values (a host sync; see the
        module docstring). ``FUSEDMOE_CHECK_VALUES=1`` turns it on too.
        fused: True runs the fused kernel (an error names what it cannot do), False the
        PyTorch reference, None picks as the module docstring says.
        replay: False: the routing kernel launched outside this router's plans (``MoEKernel.route_and_run``).
        quantize: with ``replay=False``, a one-pass quantization of the layer's input
        (``kernels.act_quant.ActQuantLaunch``) to run too: in the fused routing launch, or on its own.
        """
        if quantize is not None:  # (the replay path below is hot: no check there)
            expect(not replay, "quantize", "given with replay=False only")
        if fused is not False and replay:  # logits of a kind seen before: the fused kernel's launch plan
            replayed = _replayed(self, router_logits, correction_bias)
            if replayed is not None:
                return replayed
        logits = router_logits
        expect(
            isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.is_floating_point(),
            "router_logits",
            "a floating tensor [T, E]",
            getattr(logits, "shape", type(logits)),
        )
        expect(
            logits.shape[1] == self.num_experts,
            "router_logits",
            f"E = num_experts ({self.num_experts}) columns",
            tuple(logits.shape),
        )
        if correction_bias is not None:
            self._check_bias(correction_bias)
        if self._use_fused(logits, fused):
            from .kernels.route import fused_route

            if torch.compiler.is_compiling() or not replay:
                return fused_route(logits, self, correction_bias, quantize=quantize)
            ids, weights = _plans_of(self).call(
                logits_plan_key(logits, correction_bias),
                lambda: tuple(vars(fused_route(logits, self, correction_bias)).values()),
                (logits, correction_bias),
            )
            return TopK(ids, weights)
        if quantize is not None:  # routed in PyTorch: the quantization takes its own launch
            quantize.launch()
        if self.custom_fn is not None:
            return self._route_custom(logits, env.check_values(check_values))

        logits = logits.float()
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        if self.scoring == "sparsemixer":
            expect(correction_bias is None, "correction_bias", "None with scoring='sparsemixer'")
            return self._sparsemixer(logits)
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores
        if correction_bias is not None:
            bias = correction_bias.to(device=scores.device, dtype=torch.float32)
            choice = (logits if self.bias_on_logits else scores) + bias
        if self.grouped:
            two_best = self.group_score == "top2_sum" or (self.group_score is None and correction_bias is not None)
            choice = self._mask_groups(choice, two_best=two_best)
        ids = _topk_ids(choice, self.top_k)
        weights = scores.gather(1, ids)
        if self.renormalize:
            # clamp: scores that all underflow (sigmoid of logits below ~-88) give 0, not NaN
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return TopK(ids=ids.to(torch.int32).contiguous(), weights=weights.contiguous())

    def _check_bias(self, correction_bias) -> None:
        expect(self.custom_fn is None, "correction_bias", "None with a custom_fn")
        expect(
            isinstance(correction_bias, torch.Tensor)
            and tuple(correction_bias.shape) == (self.num_experts,)
            and correction_bias.is_floating_point(),
            "correction_bias",
            f"a floating tensor of shape ({self.num_experts},)",
            getattr(correction_bias, "shape", type(correction_bias)),
        )

    def _use_fused(self, logits: torch.Tensor, fused: bool | None) -> bool:
        expect(fused is None or isinstance(fused, bool), "fused", "None, True or False", fused)
        if fused is False:
            return False
        # auto: the cheap tests first, so on the CPU nothing below is imported or read
        if fused is None and (not logits.is_cuda or self.custom_fn is not None or not _fused_routing_enabled()):
            return False
        from .kernels.route import unsupported_reason

        reason = self._pytorch_only() or unsupported_reason(self, logits)
        if fused is None:
            return reason is None
        expect(reason is None, "RouterConfig.route(fused=True)", reason)
        return True

    def _pytorch_only(self) -> str | None:
        """What of this config only the PyTorch path computes (the fused kernel has none of it)."""
        if self.logit_softcap is not None:
            return "no logit_softcap"
        if self.bias_on_logits:
            return "no bias_on_logits"
        if self.scoring == "sparsemixer":
            return "scoring 'softmax' or 'sigmoid', not 'sparsemixer'"
        if self.group_score is not None:
            # the kernel's rule: the two best with a correction bias, the best without; an explicit
            # score is only known to agree with it once the bias is seen, so it runs in PyTorch
            return "group_score None (the kernel scores groups by the default rule)"
        return None

    def _sparsemixer(self, logits: torch.Tensor) -> TopK:
        """PhiMoE's sparsemixer at inference (module docstring): two experts, each weighted by
        a softmax over the logits within 2 eps of its own (relative to max(|logit|, its logit))."""
        band = 2 * self.sparsemixer_eps
        m1, i1 = logits.max(dim=-1, keepdim=True)
        w1 = _banded_softmax_at(logits, logits, m1, i1, band)
        rest = logits.scatter(-1, i1, float("-inf"))
        m2, i2 = rest.max(dim=-1, keepdim=True)
        w2 = _banded_softmax_at(rest, logits, m2, i2, band)
        weights = torch.cat([w1, w2], dim=-1)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        ids = torch.cat([i1, i2], dim=-1)
        return TopK(ids=ids.to(torch.int32).contiguous(), weights=weights.contiguous())

    def _mask_groups(self, choice: torch.Tensor, two_best: bool) -> torch.Tensor:
        """``choice`` with the experts outside each token's TG best groups set to -inf."""
        t, e = choice.shape
        g = self.num_expert_group
        per_group = choice.view(t, g, e // g)
        if two_best:
            best = torch.sort(per_group, dim=-1, descending=True, stable=True).values
            group_score = best[..., : min(2, e // g)].sum(dim=-1)
        else:
            group_score = per_group.amax(dim=-1)
        keep = torch.zeros(t, g, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, _topk_ids(group_score, self.topk_group), True)
        keep = keep.repeat_interleave(e // g, dim=1)
        return choice.masked_fill(~keep, float("-inf"))

    def _route_custom(self, logits: torch.Tensor, check_values: bool) -> TopK:
        t, k, e = logits.shape[0], self.top_k, self.num_experts
        out = self.custom_fn(logits, k)
        expect(
            isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out),
            "custom_fn",
            "to return a tuple (weights, ids) of tensors",
            type(out),
        )
        weights, ids = out
        expect(
            tuple(weights.shape) == (t, k) and weights.is_floating_point(),
            "custom_fn weights",
            f"a floating tensor of shape {(t, k)}",
            (tuple(weights.shape), weights.dtype),
        )
        expect(
            tuple(ids.shape) == (t, k) and not ids.is_floating_point() and ids.dtype != torch.bool,
            "custom_fn ids",
            f"an integer tensor of shape {(t, k)}",
            (tuple(ids.shape), ids.dtype),
        )
        if check_values and t > 0:
            expect(bool(((ids >= 0) & (ids < e)).all()), "custom_fn ids", f"in [0, {e})")
            s = ids.sort(dim=-1).values
            expect(bool((s[:, 1:] != s[:, :-1]).all()), "custom_fn ids", "distinct within each row")
            expect(bool(torch.isfinite(weights).all()), "custom_fn weights", "finite values")
        # int32_ids: an int64 id past 2^31 must stay outside [0, E) (contributing nothing), not wrap into it
        return TopK(ids=int32_ids(ids, e).contiguous(), weights=weights.to(torch.float32).contiguous())


# Launch plans of the fused routing kernel (``modular.replay``), per router object: a router
# routes logits of a kind it has seen by replaying one launch, without the checks and the
# argument set-up (~150 us of an eager decode call's host time on the H200 host, 2026-11-28).
_PLANS: dict[int, tuple[weakref.ref, LaunchPlans]] = {}


def _plans_of(router: RouterConfig, create: bool = True) -> LaunchPlans | None:
    """``router``'s plans (made now if ``create``, else None when it has none)."""
    hit = _PLANS.get(id(router))
    if hit is not None and hit[0]() is router:
        return hit[1]
    if not create:
        return None
    key = id(router)
    plans = LaunchPlans()
    _PLANS[key] = (weakref.ref(router, lambda _: _PLANS.pop(key, None)), plans)
    return plans


def _replayed(router: RouterConfig, logits, bias) -> TopK | None:
    """The routing of ``logits`` by ``router``'s plan for logits of their kind, or None (no plan:
    the call is checked and routed as usual, and recorded)."""
    plans = _plans_of(router, create=False)
    if plans is None or not plans.plans or torch.compiler.is_compiling():  # traced, not replayed
        return None
    try:
        key = logits_plan_key(logits, bias)
    except (AttributeError, TypeError):  # not tensors: the checks name the argument
        return None
    out = plans.replay(key, (logits, bias))
    return None if out is None else TopK(*out)


@torch.compiler.assume_constant_result
def _fused_routing_enabled() -> bool:
    """``FUSEDMOE_FUSED_ROUTING`` (default on), a constant of a compiled graph."""
    return env.fused_routing()


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _banded_softmax_at(
    values: torch.Tensor, logits: torch.Tensor, top: torch.Tensor, at: torch.Tensor, band: float
) -> torch.Tensor:
    """softmax over ``values`` with the entries farther than ``band`` below ``top`` (relative to
    max(|logit|, top)) left out, read at column ``at``: sparsemixer's weight of one choice."""
    far = (top - logits) / logits.abs().clamp(min=top) > band
    return values.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, at)


def _topk_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [T, k]: columns of the k largest values per row; ties -> lower column first."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    custom_fn: CustomRoutingFn | None = None,
    check_values: bool = False,
    fused: bool | None = None,
) -> TopK:
    """Route ``router_logits`` [T, E] to ``top_k`` experts per token (see the module docstring).

    Equivalent to ``RouterConfig(E, top_k, ...).route(router_logits, correction_bias,
    check_values=check_values, fused=fused)`` with every setting passed; unlike
    ``RouterConfig``, ``renormalize`` defaults to False here (the chosen experts' scores as
    they are, the function's long-standing meaning). A ``custom_fn`` replaces the routing,
    so ``renormalize`` must then stay False.
    """
    expect(
        isinstance(router_logits, torch.Tensor) and router_logits.dim() == 2,
        "router_logits",
        "a tensor [T, E]",
        getattr(router_logits, "shape", type(router_logits)),
    )
    if custom_fn is not None:
        expect(not renormalize, "renormalize", "False with a custom_fn (it replaces the routing)", renormalize)
    cfg = RouterConfig(
        num_experts=router_logits.shape[1],
        top_k=top_k,
        scoring=scoring,
        renormalize=renormalize if custom_fn is None else RouterConfig.renormalize,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        custom_fn=custom_fn,
    )
    return cfg.route(router_logits, correction_bias, check_values=check_values, fused=fused)
