"""transformers MoE blocks in fusedmoe's terms: block module -> ``BlockSpec``, and ``plan(model)``.

A ``BlockSpec`` says what a block computes around its experts::

    topk   = route(logits(x))                    (``Routing``, hf_routers; or the model's router)
    routed = post(experts(pre(x), topk)) * routed_scale
    out    = out_norm(routed + sum(shared_i(x)) + out_bias)

Blocks are recognised by their code key (``hf_source.code_key``); ``BLOCKS`` maps each key
to a recipe reading the block's own attributes (the comment names a class with that code).
Shared experts, latent projections and norms are the block's own modules, called as they
are (a Qwen2-MoE shared expert is ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``,
Cohere2's "average" halves both terms). Experts are the block's transformers experts module
(``hf_experts.read_experts``, weights viewed), or, for layouts transformers does not decorate
(DBRX, JetMoE, Llama-4, LongCat-Flash, Doge, Switch), an ``OwnedExperts`` holding them in
fusedmoe's layout (converted once, when patched).

``plan(model)`` walks the model once and says, for every MoE block, how it is served:

- "block": the recipe maps it all; the block is replaced (routing in fusedmoe too);
- "experts": its experts module is a transformers 5 one but the block is not mapped
  (unknown code, or an attribute the recipe refuses): routing stays in transformers, the
  experts run on fusedmoe (what ``experts_implementation="fusedmoe"`` does);
- "skip": not an FFN MoE (JetMoE's mixture of attention heads);
- "refused": neither; the reason names the block class, the attribute and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ..errors import FusedMoEError, expect
from ..metadata import TopK
from ..routing import RouterConfig
from .hf_experts import ExpertsSpec, activation_of
from .hf_routers import Routing, get, routing_of
from .hf_source import code_key

__all__ = ["BLOCKS", "BlockSpec", "OwnedExperts", "Planned", "is_experts_module", "plan"]

_JITTER = ("jitter_noise", "router_jitter_noise", "input_jitter_noise", "moe_jitter_eps")


@dataclass
class BlockSpec:
    """What a block computes (see the module docstring). ``experts`` is a transformers experts
    module (weights viewed) or an ``OwnedExperts``; ``returns_pair``: the block returns
    (hidden_states, router output) and callers drop the second; ``flat``: its output is
    [T, H] whatever its input's shape (Llama-4)."""

    kind: str
    routing: Routing
    experts: torch.nn.Module
    shared: list[torch.nn.Module] = field(default_factory=list)
    routed_scale: float = 1.0
    pre: torch.nn.Module | None = None
    post: torch.nn.Module | None = None
    out_norm: torch.nn.Module | None = None
    out_bias: torch.Tensor | None = None
    returns_pair: bool = False
    flat: bool = False


class OwnedExperts(torch.nn.Module):
    """Experts whose weights the patched block owns, in fusedmoe's layout (an ``ExpertsSpec``
    whose tensors are parameters here, so ``.to()`` moves them and a runner keys on them)."""

    def __init__(self, spec: ExpertsSpec) -> None:
        super().__init__()
        self._spec = spec
        self.params = ("w13", "w2") + (("b13", "b2") if spec.b13 is not None else ())
        for name in self.params:
            self.register_parameter(name, torch.nn.Parameter(getattr(spec, name).detach(), requires_grad=False))

    def experts_spec(self) -> ExpertsSpec:
        """The spec with this module's current tensors (after a ``.to()``, the moved ones)."""
        tensors = {n: getattr(self, n).detach() for n in self.params}
        return replace(self._spec, params=self.params, **tensors)


class _GatedShared(torch.nn.Module):
    """sigmoid(gate(x)) * mlp(x) (Qwen2-MoE's shared expert)."""

    def __init__(self, mlp: torch.nn.Module, gate: torch.nn.Module) -> None:
        super().__init__()
        self.mlp, self.gate = mlp, gate

    def forward(self, x):
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


class _ScaledShared(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module, scale: float) -> None:
        super().__init__()
        self.mlp, self.scale = mlp, scale

    def forward(self, x):
        return self.mlp(x) * self.scale


class _DenseGLU(torch.nn.Module):
    """down_proj(act_fn(gate_proj(x)) * up_proj(x)) from a block's own Linears (Doge)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = block.gate_proj, block.up_proj, block.down_proj
        self.act_fn = block.act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _std(b, w: str, router: str = "gate", shared=(), **kw) -> BlockSpec:
    """A block with ``router`` and ``experts`` children and shared MLPs added to the output."""
    experts = get(b, "experts", w)
    expect(is_experts_module(experts), f"{w}.experts", "a transformers 5 experts module", type(experts).__name__)
    mlps = [get(b, s, w) for s in shared]
    return BlockSpec(w, routing_of(get(b, router, w), b), experts, [m for m in mlps if m is not None], **kw)


def _qwen2(b, w):
    spec = _std(b, w)
    spec.shared = [_GatedShared(get(b, "shared_expert", w), get(b, "shared_expert_gate", w))]
    return spec


def _cohere2(b, w):
    spec = _std(b, w)
    if get(b, "num_shared_experts", w) > 0:
        how = get(b, "shared_expert_combination_strategy", w)
        expect(how in ("sum", "average"), f"{w}.shared_expert_combination_strategy", "sum or average", how)
        scale = 0.5 if how == "average" else 1.0
        spec.shared, spec.routed_scale = [_ScaledShared(get(b, "shared_experts", w), scale)], scale
    return spec


def _check(m: torch.nn.Module, key: str, where: str, what: str) -> None:
    expect(code_key(type(m)) == key, where, f"{what} (code key {key})", f"{type(m).__name__}, key {code_key(type(m))}")


def _owned(kind: str, **spec_kw) -> OwnedExperts:
    return OwnedExperts(ExpertsSpec(kind=kind, **spec_kw))


def _dbrx(b, w):
    """DbrxFFN: softmax, top-k, weights / their p-norm (p = moe_normalize_expert_weights: 1 is
    renormalize, None none); experts w1, v1, w2 [E*I, H] (gate, up, down^T)."""
    router, mlp = get(b, "router", w), get(b, "experts.mlp", w)
    _check(router, "196158b7fbde", f"{w}.router", "DbrxRouter: logits = layer(x)")
    _check(b.experts, "d6c5d220092e", f"{w}.experts", "DbrxExperts")
    _check(mlp, "ac4dba72ff54", f"{w}.experts.mlp", "DbrxExpertGLU: act(x w1^T) * (x v1^T) @ w2")
    p = get(b, "moe_normalize_expert_weights", w)
    expect(p in (None, 1, 1.0), f"{w}.moe_normalize_expert_weights", "None or 1 (a sum)", p)
    weight = get(router, "layer.weight", w)
    e, h = weight.shape
    i = mlp.w1.shape[0] // e
    w13 = torch.cat([mlp.w1.detach().view(e, i, h), mlp.v1.detach().view(e, i, h)], dim=1)
    act = {"activation": activation_of(mlp.activation_fn, f"{w}.experts.mlp")}
    experts = _owned("DbrxExperts", w13=w13, w2=mlp.w2.detach().view(e, i, h).transpose(1, 2), act=act)
    config = RouterConfig(e, int(get(b, "top_k", w)), scoring="softmax", renormalize=p is not None)
    return BlockSpec(w, Routing(config, weight=weight), experts)


def _jetmoe(b, w):
    """JetMoeMoE: experts input_linear [E, 2I, H], output_linear [E, H, I], activation; + bias."""
    for name in ("input_linear", "output_linear"):
        _check(get(b, name, w), "80246ff7726c", f"{w}.{name}", "JetMoeParallelExperts")
    act = {"activation": activation_of(get(b, "activation", w), f"{w}.activation")}
    experts = _owned("JetMoeParallelExperts", w13=b.input_linear.weight.detach(), w2=b.output_linear.weight.detach(),
                     act=act)  # fmt: skip
    return BlockSpec(w, routing_of(get(b, "router", w), b), experts, out_bias=get(b, "bias", w))


def _llama4(b, w):
    """Llama4TextMoe: sigmoid of the top-k logits scales the expert input (top-1); experts
    gate_up_proj [E, H, 2I], down_proj [E, I, H]; + shared_expert."""
    ex = get(b, "experts", w)
    _check(ex, "1282b228affb", f"{w}.experts", "Llama4TextExperts")
    routing = routing_of(get(b, "router", w), b)
    k = routing.config.top_k
    expect(k == 1, f"{w}.top_k", "1 (the router weight scales the expert's input)", k)
    experts = _owned(type(ex).__name__, w13=ex.gate_up_proj.detach().transpose(1, 2),
                     w2=ex.down_proj.detach().transpose(1, 2), apply_router_weight_on_input=True,
                     act={"activation": activation_of(ex.act_fn, f"{w}.experts")})  # fmt: skip
    return BlockSpec(w, routing, experts, [get(b, "shared_expert", w)], returns_pair=True, flat=True)


def _longcat(b, w):
    """LongcatFlashMoE: zero_expert_num identity experts after the n_routed_experts real ones."""
    ex = get(b, "experts", w)
    _check(ex, "fcad149e88d6", f"{w}.experts", "LongcatFlashExperts (identity experts after the routed ones)")
    e = int(get(ex, "num_routed_experts", w))
    experts = _owned(type(ex).__name__, w13=ex.gate_up_proj.detach()[:e], w2=ex.down_proj.detach(),
                     identity_experts=int(get(ex, "zero_expert_num", w)),
                     act={"activation": activation_of(ex.act_fn, f"{w}.experts")})  # fmt: skip
    return BlockSpec(w, routing_of(get(b, "router", w), b), experts)


def _doge(b, w):
    """DogeCDMoE: product-key routing (expert i*nk + j scores sx[i] + sy[j], sx and sy from
    router_gate(x) [T, 2 nk] read as [2, T, nk], as transformers does), softmax over the
    top-k, rank-1 experts act(x . down_embed[e]) * up_embed[e]; + the block's dense GLU."""
    e, nk, k = int(get(b, "num_experts", w)), int(get(b, "num_keys", w)), int(get(b, "top_k", w))
    gate = get(b, "router_gate", w)

    def logits(x: torch.Tensor) -> torch.Tensor:
        sx, sy = F.linear(x, gate.weight).reshape(2, x.shape[0], nk)
        full = (sx.float().unsqueeze(-1) + sy.float().unsqueeze(-2)).reshape(x.shape[0], nk * nk)
        return F.pad(full, (0, e - nk * nk), value=float("-inf"))

    act = {"activation": activation_of(get(b, "act_fn", w), w, gated=False)}
    down, up = get(b, "down_embed.weight", w).detach(), get(b, "up_embed.weight", w).detach()
    experts = _owned("DogeCDMoE", w13=down.unsqueeze(1), w2=up.unsqueeze(2), act=act)
    config = RouterConfig(e, k, scoring="softmax", renormalize=True)
    return BlockSpec(w, Routing(config, logits_fn=logits), experts, [_DenseGLU(b)], returns_pair=True)


def _switch(b, w):
    """SwitchTransformersSparseMLP: the model's top-1 router with expert capacity (a dropped
    token gets weight 0); experts wi, wo Linears, a non-gated activation."""
    router, ex = get(b, "router", w), get(b, "experts", w)
    _check(router, "d19b1d87d42e", f"{w}.router", "SwitchTransformersTop1Router")
    _check(ex, "ea6fca00e0ce", f"{w}.experts", "SwitchTransformersExperts")
    mods = list(ex.values())
    for m in mods:
        _check(m, "ebbdcf027edf", f"{w}.experts", "SwitchTransformersDenseActDense: wo(act(wi(x)))")
    act = {"activation": activation_of(mods[0].act, f"{w}.experts", gated=False)}
    w13, w2 = torch.stack([m.wi.weight.detach() for m in mods]), torch.stack([m.wo.weight.detach() for m in mods])
    n = len(mods)

    def topk(hidden_states: torch.Tensor) -> TopK:
        index, probs, _ = router(hidden_states)
        index = index.reshape(-1, n)
        return TopK(index.argmax(dim=-1, keepdim=True), probs.reshape(-1, 1).float() * index.sum(-1, keepdim=True))

    return BlockSpec(w, Routing(None, topk_fn=topk), _owned(type(ex).__name__, w13=w13, w2=w2, act=act))


def _scaled(attr: str, shared=(), **kw):
    def recipe(b, w):
        spec = _std(b, w, shared=shared, **kw)
        spec.routed_scale = float(get(b, attr, w))
        return spec

    return recipe


def _post_norm(b, w):
    spec = _std(b, w, shared=("shared_experts",))
    spec.out_norm = get(b, "post_mlp_layernorm", w)
    return spec


def _latent(pre: tuple[str, ...], post: str, shared=()):
    """Experts between projections of the block: routing sees x, experts see pre(x)."""

    def recipe(b, w):
        spec = _std(b, w, shared=shared)
        mods = [get(b, p, w) for p in pre]
        spec.pre = mods[0] if len(mods) == 1 else torch.nn.Sequential(*mods)
        spec.post = get(b, post, w)
        return spec

    return recipe


# Block code key -> recipe(block, where) -> BlockSpec. The comment names a class with the code.
BLOCKS = {
    "f2d6f6dc19dd": lambda b, w: _std(b, w, shared=("shared_experts",)),  # DeepseekV3MoE and 21 copies
    "0dba24715b52": lambda b, w: _std(b, w),  # Qwen3MoeSparseMoeBlock (Qwen3-VL/Omni, Mellum, Inkling-2)
    "b8d1915833c3": lambda b, w: _std(b, w),  # OlmoeSparseMoeBlock, FlexOlmo
    "ec27a9da215b": lambda b, w: _std(b, w),  # MixtralSparseMoeBlock, MiniMax
    "7ad407761b21": lambda b, w: _std(b, w),  # MiMoV2FlashMoE
    "84b966e63641": lambda b, w: _std(b, w),  # Dots3NoteVisionMoE (bias on the block)
    "52a0cad6a8f5": lambda b, w: _std(b, w),  # MiniMaxM2SparseMoeBlock (bias on the block)
    "b9ec7acd4234": lambda b, w: _std(b, w),  # Lfm2MoeSparseMoeBlock (bias on the block)
    "42eeba3cf933": lambda b, w: _std(b, w, router="router"),  # GraniteMoeMoE (4 Granite variants)
    "08e9ff971579": lambda b, w: _std(b, w, router="router"),  # JambaSparseMoeBlock
    "c7190841f099": lambda b, w: _std(b, w, router="router"),  # PhimoeSparseMoeBlock
    "30e9bfea277f": lambda b, w: _std(b, w, router="router", returns_pair=True),  # GptOssMLP
    "44f8b8eded6a": lambda b, w: _std(b, w, shared=("shared_expert",)),  # FlintSparseMoeBlock, LaraMini
    "906790a7941c": lambda b, w: _std(b, w, shared=("shared_experts",)),  # HYV3MoE
    "ed4e01960a01": lambda b, w: _std(b, w, shared=("shared_experts",)),  # Ernie4_5_MoeSparseMoeBlock
    "65644ee2a3b2": lambda b, w: _std(b, w, shared=("shared_mlp",)),  # HunYuanMoEV1Moe
    "61a25aaf721b": lambda b, w: _std(b, w, router="router", shared=("shared_experts",)),  # AriaTextMoELayer
    "86776ac5ca1f": lambda b, w: _std(b, w, router="router", shared=("shared_experts",)),  # AfmoeSparseMoeBlock
    "71e95a0101db": _qwen2,  # Qwen2MoeSparseMoeBlock (Qwen3.5, Qwen3-Next, Qwen4-Exp, Qwen3-Omni talker)
    "e03f54163736": _cohere2,  # Cohere2MoeSparseMoeBlock
    "fd5e2a689ef2": _scaled("routed_scaling_factor"),  # BeamMoE
    "7b96bff2167b": _scaled("routed_scaling_factor", shared=("shared_experts",)),  # Laguna, MiniMaxM3VL, Step3p7
    "cb760c0b59dd": _scaled("num_experts", router="router", returns_pair=True),  # OpenAIPrivacyFilterMLP
    "85123fb147bc": _post_norm,  # AXK1MoE
    "1ad8159427c4": _latent(("fc1_latent_proj",), "fc2_latent_proj", shared=("shared_experts",)),  # NemotronHMoE
    "6e8606aaaa34": _latent(("pre_expert_proj", "pre_expert_norm"), "post_expert_proj"),  # MuseSparkMoE
    "3c927df2698c": _dbrx,  # DbrxFFN
    "2eaabc58379b": _jetmoe,  # JetMoeMoE
    "af1f07bfa269": _llama4,  # Llama4TextMoe
    "e6c7c4a69dab": _longcat,  # LongcatFlashMoE
    "2161e2b81226": _doge,  # DogeCDMoE
    "3a8a77463325": _switch,  # SwitchTransformersSparseMLP
}

# Modules that hold experts but are not FFN MoE blocks fusedmoe computes, by code key.
SKIPPED = {"de56a4d45868": "JetMoeMoA is a mixture of attention heads, not of FFN experts: left to transformers"}
REFUSED = {
    "fbcf2b6dec89": "experts: NllbMoeExperts one-hot encodes the router's 0/1 top-1 mask, so it runs experts 0 "
    "and 1 whatever the router chose (transformers 5.24); fusedmoe runs the chosen experts and would not match",
    "1534225ea2b2": "experts: VitPoseNaiveMoe is one Linear per expert (no activation or second GEMM) chosen by "
    "each sample's dataset index, not by a router",
}


def is_experts_module(m: torch.nn.Module) -> bool:
    """A transformers 5 experts module: 3-D gate_up_proj (or up_proj) and down_proj parameters."""
    w13 = getattr(m, "gate_up_proj", None)
    if w13 is None:
        w13 = getattr(m, "up_proj", None)
    w2 = getattr(m, "down_proj", None)
    return isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3 and w2.dim() == 3


def _decorated(m: torch.nn.Module) -> bool:
    """An experts module of ``use_experts_implementation`` (its forward takes (x, ids, weights))."""
    return is_experts_module(m) and hasattr(m, "has_gate") and hasattr(m, "is_transposed")


@dataclass
class Planned:
    """How ``plan`` serves one module: ``mode`` in {"block", "experts", "skip", "refused"}."""

    name: str
    module: torch.nn.Module
    mode: str
    spec: BlockSpec | None = None
    reason: str = ""

    @property
    def kind(self) -> str:
        return type(self.module).__name__


def _jitter_reason(b: torch.nn.Module) -> str | None:
    if not b.training:
        return None
    for m in (b, getattr(b, "gate", None), getattr(b, "router", None)):
        for a in _JITTER:
            v = getattr(m, a, None)
            if isinstance(v, (int, float)) and v > 0:
                return f"{type(b).__name__}.{a}: expected 0 or the model in eval mode (router jitter is random)"
    return None


def _block(name: str, m: torch.nn.Module, key: str) -> Planned:
    where = type(m).__name__
    try:
        why = _jitter_reason(m)
        expect(why is None, where, "eval mode", why)
        return Planned(name, m, "block", spec=BLOCKS[key](m, where))
    except (FusedMoEError, AttributeError) as e:  # an attribute a recipe reads, missing in this version
        experts = getattr(m, "experts", None)
        if isinstance(experts, torch.nn.Module) and _decorated(experts):
            return Planned(f"{name}.experts" if name else "experts", experts, "experts", reason=str(e))
        return Planned(name, m, "refused", reason=f"{where}: {e}")


def plan(model: torch.nn.Module) -> list[Planned]:
    """How each MoE block of ``model`` is served (module docstring), in module order."""
    out: list[Planned] = []
    taken: list[str] = []
    for name, m in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if getattr(m, "fusedmoe_block", False):  # patched already
            taken.append(name)
            continue
        cls = type(m)
        key = code_key(cls) if cls.__module__.startswith("transformers.") else None
        if key in BLOCKS:
            out.append(_block(name, m, key))
        elif key in SKIPPED:
            out.append(Planned(name, m, "skip", reason=SKIPPED[key]))
        elif key in REFUSED:
            out.append(Planned(name, m, "refused", reason=f"{cls.__name__}: {REFUSED[key]}"))
        elif _decorated(m):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            why = f"{type(parent).__name__}: its code (key {code_key(type(parent))}) is not a block fusedmoe maps"
            out.append(Planned(name, m, "experts", reason=why))
        elif isinstance(getattr(m, "experts", None), torch.nn.Module) and not _decorated(m.experts):
            experts_key = code_key(type(m.experts))
            if experts_key in SKIPPED:
                out.append(Planned(name, m, "skip", reason=SKIPPED[experts_key]))
            else:
                why = f"{cls.__name__}.experts: {type(m.experts).__name__} is not a transformers 5 experts module"
                out.append(Planned(name, m, "refused", reason=f"{why} and the block's code is not one fusedmoe maps"))
        else:
            continue
        taken.append(out[-1].name)
    return out
