"""Routing and experts in one launch plan (``MoEKernel.route_and_run``): ``fused_moe`` from router
logits and the ``FusedMoE`` layer record the routing launch with the experts' launches and replay
them as one plan.

Every call is on fresh random inputs, the memory its output lands in poisoned first (a freed
NaN-filled block of the same size, which the allocator hands out again); each output equals the
same call with plans off (``FUSEDMOE_LAUNCH_PLANS=0``) bit for bit, and the float64 reference of
its routing within the scheme's tolerance. On the CPU a router takes PyTorch's path unless the
fused kernel is asked for; the CPU cases ask for it (``fused_routing``: the interpreter runs it),
so the plan has a routing launch to record, as on a GPU, where the cases route as a model does.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import FusedMoEError, fused_moe
from fusedmoe.api import cached_kernel
from fusedmoe.config import MoEConfig
from fusedmoe.dispatch import base as dispatch_base
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.act_quant import quantize_activations
from fusedmoe.layer import FusedMoE
from fusedmoe.modular.replay import LaunchPlans
from fusedmoe.quant import QuantScheme
from fusedmoe.routing import RouterConfig
from fusedmoe.testing import make_problem, rel_error, tolerance

on_cpu_replays = pytest.mark.skipif(not interpreting(), reason="CPU launch plans replay through TRITON_INTERPRET=1")

CONFIG = MoEConfig(num_experts=6, top_k=2, hidden_size=64, intermediate_size=32)

# (label, scheme, T, router): "softmax" (fused_moe's default router) or "bias" (sigmoid scores
# with a correction bias, DeepSeek-V3's kind)
CPU_CASES = [
    ("bf16, T 1, default router", "bf16", 1, "softmax"),
    ("bf16, T 5, sigmoid with a correction bias", "bf16", 5, "bias"),
    ("int4 g32, T 3", "int4_g32", 3, "softmax"),
    ("mxfp4, T 2, sigmoid with a correction bias", "mxfp4", 2, "bias"),
    ("fp8 per tensor, T 1: x quantized in the routing launch", "fp8_tensor", 1, "softmax"),
    ("int8 per token, T 3, sigmoid with a correction bias", "int8_w8a8_channel", 3, "bias"),
]


@pytest.fixture
def fused_routing(monkeypatch):
    """Routers take the fused routing kernel for CPU logits too (through the interpreter)."""
    use = RouterConfig._use_fused
    monkeypatch.setattr(RouterConfig, "_use_fused", lambda self, logits, fused: use(self, logits, fused is not False))


def _router(config: MoEConfig, kind: str, device) -> tuple[RouterConfig | None, torch.Tensor | None]:
    if kind == "softmax":
        return None, None
    g = torch.Generator(device=device).manual_seed(7)
    bias = torch.randn(config.num_experts, generator=g, device=device) * 0.1
    return RouterConfig(config.num_experts, config.top_k, scoring="sigmoid", renormalize=True), bias


def _poison_next(shape, dtype, device) -> None:
    torch.full(shape, float("nan"), dtype=dtype, device=device)


def _check(problem, router, bias, calls: int, device, monkeypatch) -> None:
    """``calls`` calls of ``fused_moe`` from fresh logits: plans off equal, the reference near."""
    config, scheme = problem.config, problem.scheme
    t = problem.x.shape[0]
    ref_router = router or RouterConfig(config.num_experts, config.top_k, renormalize=True)
    for seed in range(calls):
        g = torch.Generator(device=device).manual_seed(100 + seed)
        x = torch.randn(t, config.hidden_size, generator=g, device=device).to(config.dtype)
        logits = torch.randn(t, config.num_experts, generator=g, device=device)
        kw = dict(backend="triton", router=router, correction_bias=bias)
        _poison_next((t, config.hidden_size), config.dtype, device)
        out = fused_moe(x, logits, problem.weights, config, scheme, **kw)
        with monkeypatch.context() as m:
            m.setenv("FUSEDMOE_LAUNCH_PLANS", "0")
            plain = fused_moe(x, logits, problem.weights, config, scheme, **kw)
        assert torch.equal(out, plain), f"call {seed} differs from plans off"
        topk = ref_router.route(logits, bias, fused=False)
        problem.x, problem.topk_ids, problem.topk_weights = x, topk.ids, topk.weights
        err = rel_error(out, problem.reference())
        assert err <= tolerance(scheme, config.dtype), f"call {seed}: rel error {err:.2e}"


def _logits_plans(kernel) -> list[tuple]:
    return [k for k in kernel._plans.plans if k[0] == "logits"]


def _fresh_kernel(scheme: QuantScheme, config: MoEConfig = CONFIG):
    """The kernel ``fused_moe`` runs (cached across tests), its plans forgotten."""
    kernel = cached_kernel(config, scheme, "triton")
    kernel._plans.clear()
    return kernel


@on_cpu_replays
@pytest.mark.parametrize("label,scheme,t,router", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_fused_moe_from_logits_replays_one_plan(label, scheme, t, router, fused_routing, monkeypatch):
    scheme = QuantScheme.by_name(scheme)
    problem = make_problem(CONFIG, scheme, t, seed=1)
    rtr, bias = _router(CONFIG, router, "cpu")
    kernel = _fresh_kernel(scheme)
    _check(problem, rtr, bias, 4, "cpu", monkeypatch)
    assert len(_logits_plans(kernel)) == 1, (label, kernel._plans.refused)
    (plan,) = [kernel._plans.plans[k] for k in _logits_plans(kernel)]
    launched = [s for s in plan.steps if s[0] == "launch"]
    assert len(launched) >= 3, "the routing launch and the experts' launches in one plan"


def _launches(plan) -> int:
    return sum(s[0] == "launch" for s in plan.steps)


@on_cpu_replays
@pytest.mark.parametrize("scheme,t", [("fp8_tensor", 1), ("int8_w8a8_channel", 3)])
def test_x_is_quantized_in_the_routing_launch(scheme, t, fused_routing, monkeypatch):
    """The joint plan makes one launch fewer than the same call with x quantized by a launch of
    its own (the dispatcher's kernel, which on the CPU it takes only when told to)."""
    scheme = QuantScheme.by_name(scheme)
    problem = make_problem(CONFIG, scheme, t, seed=6)
    kernel = _fresh_kernel(scheme)
    _check(problem, None, None, 3, "cpu", monkeypatch)
    (fused,) = [kernel._plans.plans[k] for k in _logits_plans(kernel)]
    with monkeypatch.context() as m:
        m.setattr(LocalDispatcher, "input_quantization", lambda self, x, weights: None)
        m.setattr(dispatch_base, "quantize", lambda x, tq, **kw: quantize_activations(x, tq, **kw))
        kernel._plans.clear()
        _check(problem, None, None, 3, "cpu", monkeypatch)
        (separate,) = [kernel._plans.plans[k] for k in _logits_plans(kernel)]
    assert _launches(separate) == _launches(fused) + 1, (_launches(separate), _launches(fused))


@on_cpu_replays
def test_another_router_or_bias_is_another_plan(fused_routing, monkeypatch):
    scheme = QuantScheme.unquantized()
    problem = make_problem(CONFIG, scheme, 3, seed=2)
    rtr, bias = _router(CONFIG, "bias", "cpu")
    kernel = _fresh_kernel(scheme)
    _check(problem, rtr, bias, 3, "cpu", monkeypatch)
    _check(problem, rtr, bias.clone(), 3, "cpu", monkeypatch)  # same values, another tensor: its own plan
    other = RouterConfig(CONFIG.num_experts, CONFIG.top_k, scoring="sigmoid", renormalize=False)
    _check(problem, other, bias, 3, "cpu", monkeypatch)
    assert len(_logits_plans(kernel)) == 3, kernel._plans.refused


@on_cpu_replays
def test_pytorch_routing_is_refused_and_runs_as_before(monkeypatch):
    # without the fused kernel a CPU router computes with PyTorch ops: no joint plan, same results
    scheme = QuantScheme.unquantized()
    problem = make_problem(CONFIG, scheme, 2, seed=3)
    kernel = _fresh_kernel(scheme)
    _check(problem, None, None, 3, "cpu", monkeypatch)
    refused = [why for k, why in kernel._plans.refused.items() if k[0] == "logits"]
    assert refused and all("aten." in why for why in refused), kernel._plans.refused


def test_a_call_that_raised_is_not_recorded():
    # the second call of a key records ``fn`` unchecked: only after a first call that ran through
    plans, fn_calls = LaunchPlans(), []

    def bad():
        raise FusedMoEError("x: expected something else")

    for _ in range(3):
        with pytest.raises(FusedMoEError, match="^x: "):
            plans.call(("k",), lambda: fn_calls.append(1), (), plain=bad)
    assert not fn_calls and not plans._seen and not plans.plans


@on_cpu_replays
def test_the_layer_replays_one_plan(fused_routing, monkeypatch):
    scheme = QuantScheme.unquantized()
    problem = make_problem(CONFIG, scheme, 4, seed=4)
    rtr, bias = _router(CONFIG, "bias", "cpu")
    layer = FusedMoE(CONFIG, scheme, router=rtr, backend="triton", correction_bias=bias)
    w, i = problem.weights, CONFIG.intermediate_size
    for e in range(CONFIG.num_experts):  # as a checkpoint loader feeds it
        layer.weight_loader("w13_weight", w.w13.data[e, :i], e, "w1")
        layer.weight_loader("w13_weight", w.w13.data[e, i:], e, "w3")
        layer.weight_loader("w2_weight", w.w2.data[e], e, "w2")
    layer.process_weights_after_loading()
    for seed in range(4):
        g = torch.Generator().manual_seed(30 + seed)
        x = torch.randn(4, CONFIG.hidden_size, generator=g).to(CONFIG.dtype)
        logits = torch.randn(4, CONFIG.num_experts, generator=g)
        out = layer(x, logits)
        with monkeypatch.context() as m:
            m.setenv("FUSEDMOE_LAUNCH_PLANS", "0")
            assert torch.equal(out, layer(x, logits)), f"call {seed}"
    assert len(_logits_plans(layer.kernel)) == 1, layer.kernel._plans.refused


# ---- GPU: real shapes, routing as a model does it ----------------------------------------------

GPU_CONFIG = MoEConfig(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=768)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 64])
@pytest.mark.parametrize("router", ["softmax", "bias"])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor", "fp8_block", "int4_g128", "mxfp4"])
def test_gpu_fused_moe_from_logits_replays_one_plan(scheme, router, t, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    scheme = QuantScheme.by_name(scheme)
    problem = make_problem(GPU_CONFIG, scheme, t, seed=5, device="cuda")
    rtr, bias = _router(GPU_CONFIG, router, "cuda")
    kernel = _fresh_kernel(scheme, GPU_CONFIG)
    _check(problem, rtr, bias, 5, "cuda", monkeypatch)
    assert _logits_plans(kernel), kernel._plans.refused
