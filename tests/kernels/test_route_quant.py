"""The routing launch with x's quantization beside it (``route_launch(quantize=...)``,
``_route_quant_kernel``): the routing programs and the programs of x's one-pass quantization in one
launch. Each case compares, bit for bit, the ids, weights, codes and scales of that launch with the
two launches it replaces (``route_launch`` alone, ``act_quant_launch`` alone) on the same fresh random
inputs, the fused launch's buffers poisoned first, and counts the launches made (one).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fusedmoe.errors import FusedMoEError
from fusedmoe.kernels import route as route_mod
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.act_quant import act_quant_launch, plan_act_quant
from fusedmoe.kernels.route import route_launch, router_args
from fusedmoe.quant import QTensor, QuantScheme
from fusedmoe.routing import RouterConfig

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")


@dataclass(frozen=True)
class Case:
    """T tokens of H values quantized as ``scheme``'s a1, routed by ``router`` (E experts)."""

    label: str
    scheme: str
    t: int
    h: int
    router: RouterConfig


_SOFTMAX = RouterConfig(16, 4, renormalize=True)
_GROUPED = RouterConfig(32, 4, scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2)
CASES = [
    Case("fp8 per tensor, one tile (T 1)", "fp8_tensor", 1, 256, _SOFTMAX),
    Case("fp8 per tensor, one tile (T 3, odd H)", "fp8_tensor", 3, 200, _GROUPED),
    Case("fp8 static per tensor", "fp8_tensor_static", 2, 256, _SOFTMAX),
    Case("fp8 1 x 64 groups, programs along H", "fp8_block64x64", 2, 384, _GROUPED),
    Case("int8 per token, T 5", "int8_w8a8_channel", 5, 192, _SOFTMAX),
    Case("int8 1 x 128 groups, T 40: programs along T", "int8_w8a8_block", 40, 256, _SOFTMAX),
    Case("mxfp8 (1 x 32 e8m0), T 3", "mxfp4_mxfp8", 3, 128, _GROUPED),
    Case("nvfp4 (1 x 16 e4m3 over a global scale), T 2", "nvfp4", 2, 128, _SOFTMAX),
]


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(case.t, case.h, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    logits = torch.randn(case.t, case.router.num_experts, generator=g).to(DEVICE)
    tq = QuantScheme.by_name(case.scheme).a1
    kw = {}
    if not tq.dynamic:
        kw["scale"] = torch.tensor([0.02], device=DEVICE)
    if case.scheme == "nvfp4":
        kw["global_scale"] = torch.tensor([0.05], device=DEVICE)
    return x, logits, tq, kw


def _poison(q: QTensor, tq) -> None:
    # a static scale is the caller's tensor, read and not written: left alone
    for t in (q.data, q.scale if tq.dynamic else None):
        if t is not None and t.numel():
            t.view(torch.uint8).fill_(0xA5)  # a byte pattern every format shows (NaN codes in fp8)


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_one_launch_equals_the_two(case, monkeypatch):
    x, logits, tq, kw = _inputs(case, seed=len(case.label))
    ref_q = act_quant_launch(x, tq, **kw)
    ref_r = route_launch(logits, None, **router_args(case.router))
    plan = plan_act_quant(x, tq, **kw)
    assert len(plan.passes) == 1, plan.passes
    _poison(plan.result, tq)
    launched = []
    real = route_mod.launch
    monkeypatch.setattr(route_mod, "launch", lambda k, *a, **kw: (launched.append(k), real(k, *a, **kw))[1])
    got = route_launch(logits, None, **router_args(case.router), quantize=plan)
    assert launched == [route_mod._route_quant_kernel]
    assert torch.equal(got.ids, ref_r.ids) and torch.equal(got.weights, ref_r.weights)
    q = plan.result
    assert _equal(q.data, ref_q.data), "codes"
    assert _equal(q.scale, ref_q.scale), "scales"


@needs_triton
def test_nothing_to_route_still_quantizes():
    case = CASES[4]
    x, _, tq, kw = _inputs(case, seed=3)
    plan = plan_act_quant(x, tq, **kw)
    _poison(plan.result, tq)
    got = route_launch(torch.empty(0, 16, device=DEVICE), None, top_k=4, quantize=plan)
    assert got.ids.shape == (0, 4)
    assert _equal(plan.result.data, act_quant_launch(x, tq, **kw).data)


@needs_triton
def test_a_two_pass_quantization_is_refused():
    # a per-tensor dynamic scale of more than one tile takes an abs-max pass first: it cannot ride along
    x = torch.randn(4, 4096, device=DEVICE).to(torch.bfloat16)
    plan = plan_act_quant(x, QuantScheme.by_name("fp8_tensor").a1)
    assert plan.passes == (1, 2)
    with pytest.raises(FusedMoEError, match="^quantize: "):
        route_launch(torch.randn(4, 16, device=DEVICE), None, top_k=2, quantize=plan)


@needs_triton
def test_router_routes_in_pytorch_and_launches_the_quantization(monkeypatch):
    case = CASES[0]
    x, logits, tq, kw = _inputs(case, seed=9)
    plan = plan_act_quant(x, tq, **kw)
    _poison(plan.result, tq)
    got = case.router.route(logits, None, fused=False, replay=False, quantize=plan)
    assert torch.equal(got.ids, case.router.route(logits, None, fused=False).ids.to(got.ids.dtype))
    assert _equal(plan.result.data, act_quant_launch(x, tq, **kw).data)
    with pytest.raises(FusedMoEError, match="^quantize: "):
        case.router.route(logits, None, quantize=plan)  # with the router's own plans: refused
