"""Classes 2, 3, 4 and 6: what ``ExpertWeights`` hold, checked once when weights are built or
loaded (``check_weights``): scale, zero-point and global-scale shapes against the granularity
(class 2: a scale for 1 expert of 4, or a transposed block scale, ran 25-36% off), act-order
g_idx contents and length (class 3: garbage or a crash), stored data against the declared
shape (class 4: the kernel read past the buffer), static activation scales > 0 (class 6: a
scale of 0 turned the output into zeros). The Triton GEMM masks g_idx so a bad one cannot read
out of bounds even where the checks are bypassed.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from robust_helpers import CFG, dropped_reference, equals_reference, problem, raises_clearly, robust

from fusedmoe import ExpertWeights, FusedMoE, MoEConfig, QuantScheme, fused_moe
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.align import moe_align_ref
from fusedmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_ref
from fusedmoe.kernels.launch_config import LaunchConfig
from fusedmoe.quant import Operand, QTensor, all_schemes, dequantize

# H = 256, I = 128: every named scheme stores it (int4 groups of 128, fp8 blocks of 128 in
# more than one block along N and K, so a transposed block scale has another shape)
BIG = MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
QUANTIZED = [s.name for s in all_schemes() if s.w1 is not None]


@functools.cache
def _prob(scheme: str, config: MoEConfig = BIG):
    return problem(scheme, config, t=3)


def _with(w: ExpertWeights, operand: str, **fields) -> ExpertWeights:
    return replace(w, **{operand: replace(getattr(w, operand), **fields)})


def _run(prob, weights, config=BIG):
    return fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), weights, config, prob.scheme)


# ---- class 2: scale shapes ----------------------------------------------------------------------


def _corrupt(scale: torch.Tensor, how: str) -> torch.Tensor:
    if how == "one_expert":
        return scale[:1]
    if how == "transposed":
        t = scale.transpose(-1, -2)
        return t.contiguous() if t.shape != scale.shape else scale.reshape(scale.shape[0], -1, 1, 1)
    return scale[..., :-1] if scale.shape[-1] > 1 else scale[:, :-1]  # one group or channel short


SCALE_CASES = [(s, "w13", how) for s in QUANTIZED for how in ("one_expert", "transposed", "short")]
SCALE_CASES += [(s, "w2", "one_expert") for s in QUANTIZED]


@robust(2, "error")
@pytest.mark.parametrize("scheme,operand,how", SCALE_CASES)
def test_scale_of_another_shape_is_refused(scheme, operand, how):
    prob = _prob(scheme)
    q = getattr(prob.weights, operand)
    w = _with(prob.weights, operand, scale=_corrupt(q.scale, how))
    raises_clearly(lambda: _run(prob, w), f"weights.{operand}.scale", "shape")


@robust(2, "error")
@pytest.mark.parametrize("scheme", ["int4_g64_zp", "int4_g128_zp"])
@pytest.mark.parametrize("how", ["one_expert", "short"])
def test_zero_points_of_another_shape_are_refused(scheme, how):
    prob = _prob(scheme)
    w = _with(prob.weights, "w13", zero=_corrupt(prob.weights.w13.zero, how))
    raises_clearly(lambda: _run(prob, w), "weights.w13.zero", "shape")


@robust(2, "error")
@pytest.mark.parametrize("scheme", ["nvfp4_w4a16", "nvfp4"])
@pytest.mark.parametrize("how", ["flat", "one_expert"])
def test_weight_global_scale_of_another_shape_is_refused(scheme, how):
    prob = _prob(scheme)
    gs = prob.weights.w2.global_scale
    gs = gs.reshape(-1) if how == "flat" else gs[:1]
    raises_clearly(lambda: _run(prob, _with(prob.weights, "w2", global_scale=gs)), "weights.w2.global_scale")


@robust(2, "error")
@pytest.mark.parametrize("scheme,field", [("fp8_tensor_static", "a1_scale"), ("nvfp4", "a1_global_scale")])
def test_activation_scale_with_several_values_is_refused(scheme, field):
    prob = _prob(scheme)
    w = replace(prob.weights, **{field: getattr(prob.weights, field).expand(2, 2).clone()})
    raises_clearly(lambda: _run(prob, w), f"weights.{field}", "one value")


@robust(2, "reference")
@pytest.mark.parametrize("scheme", ["fp8_block", "int4_g128", "nvfp4_w4a16", "fp8_channel"])
def test_scales_of_the_right_shape_run(scheme):
    prob = _prob(scheme)
    equals_reference(_run(prob, prob.weights), prob.reference(), prob.scheme, BIG.dtype)


# ---- class 3: act-order g_idx -------------------------------------------------------------------

ACT_ORDER = QuantScheme.int4_w4a16(32, act_order=True)  # H = 64: 2 groups for W13, I = 32: 1 for W2


def _gidx(g: torch.Tensor, how: str):
    if how == "value_eq_groups":
        g = g.clone()
        g[0, 3] = int(g.max()) + 1
    elif how == "negative":
        g = g.clone()
        g[1, 0] = -1
    elif how == "huge":
        g = g.clone()
        g[-1, -1] = 2**30
    elif how == "short":
        g = g[:, :-1]
    elif how == "long":
        g = torch.cat([g, g[:, :1]], dim=1)
    elif how == "int64":
        g = g.long()
    elif how == "one_dim":
        g = g[0]
    elif how == "missing":
        g = None
    return g


GIDX_CASES = [("w13", h) for h in ("value_eq_groups", "negative", "huge", "short", "long", "int64", "one_dim")]
GIDX_CASES += [("w13", "missing")] + [("w2", h) for h in ("value_eq_groups", "negative", "short")]


@robust(3, "error")
@pytest.mark.parametrize("operand,how", GIDX_CASES)
def test_act_order_g_idx_is_checked_once_at_build(operand, how):
    prob = problem(ACT_ORDER)
    w = _with(prob.weights, operand, g_idx=_gidx(getattr(prob.weights, operand).g_idx, how))
    raises_clearly(lambda: _run(prob, w, CFG), f"weights.{operand}.g_idx")


@robust(3, "reference")
@pytest.mark.parametrize("backend", ["reference", "cpu"] + (["triton"] if interpreting() else []))
def test_act_order_with_a_valid_g_idx_runs(backend):
    prob = problem(ACT_ORDER)
    out = fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, CFG, ACT_ORDER, backend=backend)
    equals_reference(out, prob.reference(), ACT_ORDER, CFG.dtype)


@pytest.mark.skipif(not interpreting(), reason="the Triton GEMM needs TRITON_INTERPRET=1 here")
@robust(3, "reference")
@pytest.mark.parametrize("block_m", [1, 16], ids=["fma_tile", "dot_tile"])
def test_grouped_gemm_masks_g_idx_out_of_range(block_m):
    """Called below the checks: group ids outside [0, G) read no scale (their columns count 0)."""
    prob = problem(ACT_ORDER)
    q = prob.weights.w13
    bad = q.g_idx.clone()
    cols = torch.tensor([1, 6, 40])
    bad[:, cols] = torch.tensor([2, -1, 2**20], dtype=torch.int32)  # groups are 0 and 1
    w_bad = replace(q, g_idx=bad)
    fixed = dequantize(replace(q, g_idx=q.g_idx), ACT_ORDER.w1, torch.float32)
    fixed[:, :, cols] = 0.0  # what a column of an invalid group contributes
    routing = moe_align_ref(prob.topk_ids, CFG.num_experts, block_m)
    lc = LaunchConfig(block_m=block_m, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1)
    out = grouped_gemm(Operand(QTensor(prob.x, tuple(prob.x.shape))), Operand(w_bad, ACT_ORDER.w1), routing,
                       a_div=CFG.top_k, config=lc, out_dtype=torch.float32)  # fmt: skip
    ref = grouped_gemm_ref(Operand(QTensor(prob.x, tuple(prob.x.shape))), Operand(QTensor(fixed, q.shape)), routing,
                           a_div=CFG.top_k, dtype=torch.float32)  # fmt: skip
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


# ---- class 4: stored data against the declared shape --------------------------------------------

DATA_SCHEMES = ["bf16", "fp8_tensor", "int8_w8a16", "int4_g32", "mxfp4", "nvfp4_w4a16"]


@robust(4, "error")
@pytest.mark.parametrize("scheme", DATA_SCHEMES)
@pytest.mark.parametrize("how", ["short_k", "fewer_experts", "backend_layout_short"])
def test_data_smaller_than_its_declared_shape_is_refused(scheme, how):
    prob = problem(scheme)
    q = prob.weights.w13
    if how == "short_k":
        w = _with(prob.weights, "w13", data=q.data[..., :-1])
        want = "weights.w13.data"
    elif how == "fewer_experts":
        w = _with(prob.weights, "w2", data=prob.weights.w2.data[:-1])
        want = "weights.w2.data"
    else:  # a backend's layout is not checked shape by shape, but it must hold the bytes it declares
        w = replace(_with(prob.weights, "w13", data=q.data[:, :-1]), layout="custom")
        want = "bytes"
    raises_clearly(lambda: _run(prob, w, CFG), want)


@robust(4, "error")
@pytest.mark.parametrize("what", ["raw_tensor", "two_dim_shape", "declared_bigger"])
def test_weight_operand_that_is_not_a_3d_qtensor_is_refused(what):
    prob = problem("bf16")
    q = prob.weights.w13
    if what == "raw_tensor":
        w, name = replace(prob.weights, w13=q.data), "weights.w13"
    elif what == "two_dim_shape":
        w, name = _with(prob.weights, "w13", shape=q.shape[1:]), "weights.w13"
    else:
        w, name = _with(prob.weights, "w13", shape=(q.shape[0], q.shape[1] * 2, q.shape[2])), "weights.w13"
    raises_clearly(lambda: _run(prob, w, CFG), name)


# ---- class 6: static activation scales and global scales > 0 ------------------------------------


@robust(6, "error")
@pytest.mark.parametrize("field", ["a1_scale", "a2_scale"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_static_activation_scale_not_positive_is_refused(field, value):
    prob = problem("fp8_tensor_static")
    w = replace(prob.weights, **{field: torch.full((1, 1), value)})
    raises_clearly(lambda: _run(prob, w, CFG), f"weights.{field}", "> 0")


@robust(6, "error")
@pytest.mark.parametrize("field", ["w13.global_scale", "a1_global_scale"])
def test_nvfp4_global_scale_of_zero_is_refused(field):
    prob = problem("nvfp4")
    if field == "a1_global_scale":
        w = replace(prob.weights, a1_global_scale=torch.zeros(1, 1))
    else:
        w = _with(prob.weights, "w13", global_scale=torch.zeros_like(prob.weights.w13.global_scale))
    raises_clearly(lambda: _run(prob, w, CFG), f"weights.{field}", "> 0")


@robust(6, "error")
def test_calibrating_static_scales_on_zeros_is_refused():
    w13, w2 = torch.randn(4, 64, 64), torch.randn(4, 64, 32)
    fn = lambda: ExpertWeights.from_float(w13, w2, QuantScheme.fp8_per_tensor(True), calib_x=torch.zeros(8, 64))  # noqa: E731
    raises_clearly(fn, "calib_x")


@robust(6, "error")
@pytest.mark.parametrize("value", [0.0, float("nan")])
def test_layer_refuses_a_checkpoint_input_scale_of_zero(value):
    layer = FusedMoE(CFG, QuantScheme.fp8_per_tensor(True))
    fn = lambda: layer.weight_loader("w13_input_scale", torch.tensor(value), 0, "w1")  # noqa: E731
    raises_clearly(fn, "w13_input_scale", "> 0")


@robust(6, "reference")
def test_positive_static_scales_run():
    prob = problem("fp8_tensor_static")
    equals_reference(_run(prob, prob.weights, CFG), prob.reference(), prob.scheme, CFG.dtype)


@robust(6, "reference")
def test_weight_values_are_read_once_per_weights_object(monkeypatch):
    """The value checks (a host read each) run when weights are first seen, not per call."""
    import fusedmoe.modular.validation as v

    prob = problem("fp8_tensor_static")
    _run(prob, prob.weights, CFG)
    calls = []
    monkeypatch.setattr(v, "_can_read_values", lambda t: calls.append(t) or True)
    out = _run(prob, prob.weights, CFG)
    assert calls == []
    equals_reference(out, dropped_reference(prob, prob.topk_ids, prob.topk_weights), prob.scheme, CFG.dtype)
