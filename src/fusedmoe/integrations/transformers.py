"""fusedmoe for transformers models: ``experts_implementation="fusedmoe"`` and ``patch(model)``.

Two ways in, both for transformers >= 5::

    import fusedmoe.integrations.transformers      # registers "fusedmoe" (``register()``)
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="fusedmoe")
    # or: model.set_experts_implementation("fusedmoe"); or: patch(model)

**The experts registry.** ``register()`` adds ``experts_forward`` to transformers'
``ALL_EXPERTS_FUNCTIONS``: every experts module decorated with ``use_experts_implementation``
then runs its experts on fusedmoe, with the routing left to the model. Per module, once:
``hf_experts.read_experts`` reads the layout (concatenated or interleaved gate/up,
transposed, biases, no gate, the activation, a post-expert norm) as views of the
parameters, and ``ExpertsRunner`` builds the kernel; the runner is cached on the module and
rebuilt only when a parameter moves or changes. Per call: a shape check, a ``TopK`` and the
kernel. ``register(quantize=QuantScheme.fp8_...())`` quantizes bf16 weights on the fly
(once per module; transformers keeps its bf16 parameters).

**patch(model).** Every MoE block, found by ``hf_moe.plan`` (by what its code is, not by a
list of class names): a block whose router and layout fusedmoe maps is replaced by a
``FusedMoEBlock`` (routing in fusedmoe too: one fused routing kernel on a GPU); a block it
does not map but whose experts are a transformers 5 experts module keeps its routing and
has its experts' forward replaced (as the registry does); anything else is refused with the
block class, the attribute and why. ``plan(model)`` says which, without changing anything.

A ``FusedMoEBlock`` is for inference (no router jitter, no auxiliary losses, no router
logits recorded); blocks that return (hidden_states, router output) return
(hidden_states, None), which their callers discard.
"""

from __future__ import annotations

import types
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..errors import expect
from ..platform import Platform
from ..quant import QuantScheme
from .hf_experts import ExpertsRunner, RunOptions, bind_runner
from .hf_moe import BlockSpec, Planned, plan

__all__ = ["FusedMoEBlock", "experts_forward", "patch", "plan", "register"]

_RUNNER = "_fusedmoe_runner"
_OPTIONS = "_fusedmoe_options"
_registry_options = RunOptions()


def register(
    *,
    backend: str = "auto",
    quantize: QuantScheme | None = None,
    platform: Platform | None = None,
    name: str = "fusedmoe",
) -> None:
    """Register ``experts_forward`` as transformers' experts implementation ``name``.

    backend: a fusedmoe Experts backend or "auto" (the oracle's choice per module).
    quantize: a scheme with dynamic activation scales to quantize unquantized experts to.
    Registering again replaces the options; every module rebuilds its runner at its next call.
    """
    global _registry_options
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    _registry_options = RunOptions(backend, quantize, platform)
    ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' experts forward on fusedmoe: hidden_states [T, H], top_k_index and
    top_k_weights [T, K] -> [T, H] (``self`` is the experts module)."""
    runner = self.__dict__.get(_RUNNER)
    if runner is None or not runner.fresh(self, top_k_index.shape[-1], _registry_options):
        runner = bind_runner(self, top_k_index.shape[-1], _registry_options)
    return runner(hidden_states, top_k_index, top_k_weights)


def _patched_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """An experts module's forward after ``patch`` (its block kept its routing)."""
    runner = bind_runner(self, top_k_index.shape[-1], self.__dict__[_OPTIONS])
    return runner(hidden_states, top_k_index, top_k_weights)


class FusedMoEBlock(torch.nn.Module):
    """A transformers MoE block computed by fusedmoe (``hf_moe.BlockSpec`` says what)::

    topk = route(logits(x)); out = out_norm(post(experts(pre(x), topk)) + shared(x) + bias)

    The tensors and modules are the block's own (the router weight, the experts module or the
    converted experts, the shared experts), held here so that ``.to()`` moves them.
    """

    fusedmoe_block = True  # ``plan`` leaves a patched block alone

    def __init__(self, spec: BlockSpec, options: RunOptions | None = None) -> None:
        super().__init__()
        options = options or RunOptions()
        r = spec.routing
        self.kind = spec.kind
        self.options = options
        self.router = None
        if r.config is not None:
            scale = r.config.routed_scaling_factor * spec.routed_scale
            self.router = replace(r.config, routed_scaling_factor=scale)
        else:
            expect(spec.routed_scale == 1.0, f"{spec.kind}", "no routed scale with the model's own router")
        for name, t in (("router_weight", r.weight), ("router_bias", r.bias), ("correction_bias", r.correction_bias)):
            self._hold(name, t)
        self._hold("out_bias", spec.out_bias)
        self.fp32, self.logit_scale = r.fp32, r.logit_scale
        self.logits_fn, self.topk_fn = r.logits_fn, r.topk_fn
        self.experts = spec.experts
        self.shared = torch.nn.ModuleList(spec.shared)
        self.pre, self.post, self.out_norm = spec.pre, spec.post, spec.out_norm
        self.returns_pair, self.flat = spec.returns_pair, spec.flat
        # the routers the functions above call, so that .to() moves them too
        self.routing_modules = torch.nn.ModuleList(_closure_modules(r.logits_fn, r.topk_fn))
        bind_runner(self.experts, 1 if r.config is None else r.config.top_k, options)  # the kernel, built now

    @property
    def runner(self) -> ExpertsRunner:
        """The experts' runner (cached on the experts module, rebuilt when their tensors change)."""
        return self.experts.__dict__[_RUNNER]

    def _hold(self, name: str, t: torch.Tensor | None) -> None:
        if isinstance(t, torch.nn.Parameter):
            self.register_parameter(name, t)
        else:
            self.register_buffer(name, t, persistent=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] of x [T, H], computed as the block's router does."""
        if self.logits_fn is not None:
            return self.logits_fn(x)
        w, b = self.router_weight, self.router_bias
        if self.fp32:
            x, w, b = x.float(), w.float(), None if b is None else b.float()
        elif x.dtype != w.dtype:
            x = x.to(w.dtype)
        out = F.linear(x, w, b)
        return out if self.logit_scale == 1.0 else out * self.logit_scale

    def route(self, hidden_states: torch.Tensor, x: torch.Tensor):
        """The ``TopK`` of the tokens x [T, H] (hidden_states: the block's input, any shape)."""
        if self.topk_fn is not None:
            return self.topk_fn(hidden_states)
        return self.router.route(self.logits(x), self.correction_bias)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        topk = self.route(hidden_states, x)
        runner = bind_runner(self.experts, topk.ids.shape[1], self.options)
        out = runner(x if self.pre is None else self.pre(x), topk.ids, topk.weights)
        if self.post is not None:
            out = self.post(out)
        for shared in self.shared:
            out = out + shared(x)
        if self.out_bias is not None:
            out = out + self.out_bias
        if not self.flat:
            out = out.reshape(shape)
        if self.out_norm is not None:
            out = self.out_norm(out)
        return (out, None) if self.returns_pair else out

    def extra_repr(self) -> str:
        return f"kind={self.kind}, backend={self.runner.kernel.choice.backend}"


def _closure_modules(*fns) -> list[torch.nn.Module]:
    """The modules the functions close over (a router ``topk_fn`` calls, ``logits_fn``'s Linear)."""
    cells = [c.cell_contents for fn in fns for c in (getattr(fn, "__closure__", None) or ())]
    return [v for v in cells if isinstance(v, torch.nn.Module)]


def _set_submodule(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def patch(
    model: torch.nn.Module,
    *,
    backend: str = "auto",
    quantize: QuantScheme | None = None,
    platform: Platform | None = None,
) -> list[str]:
    """Serve every MoE block of ``model`` with fusedmoe, in place (module docstring); returns the
    names of the modules replaced (blocks) or changed (experts modules), in module order.

    backend / quantize / platform: as ``register``. Raises ``FusedMoEError`` listing every
    block it refuses (class, attribute, why), before changing anything. Put the model in eval
    mode first (router jitter is random in training).
    """
    options = RunOptions(backend, quantize, platform)
    planned = plan(model)
    refused = [p for p in planned if p.mode == "refused"]
    expect(not refused, "model", "MoE blocks fusedmoe can serve", "; ".join(f"{p.name}: {p.reason}" for p in refused))
    served = [p for p in planned if p.mode in ("block", "experts")]
    expect(bool(served), "model", "at least one MoE block (none found)", type(model).__name__)
    with torch.no_grad():
        for p in served:
            _serve(model, p, options)
    return [p.name for p in served]


def _serve(model: torch.nn.Module, p: Planned, options: RunOptions) -> None:
    if p.mode == "block":
        _set_submodule(model, p.name, FusedMoEBlock(p.spec, options))
        return
    m = p.module
    m.__dict__[_OPTIONS] = options
    m.forward = types.MethodType(_patched_experts_forward, m)


try:  # registration on import, where transformers has the experts registry (>= 5)
    register()
except ImportError:
    pass
