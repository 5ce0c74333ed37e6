"""Validation at the public entry points: one test per class of bad input, the NaN policy, T = 0.

Every error must name the argument and what was expected (``fusedmoe.modular.validation``).
Device mismatches are shown with the ``meta`` device, which every CPU machine has.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fusedmoe import FusedMoEError, MoEConfig, QuantScheme, UnsupportedError
from fusedmoe.api import fused_moe
from fusedmoe.env import CHECK_VALUES as ENV_CHECK_VALUES
from fusedmoe.kernels._common import interpreting
from fusedmoe.layer import FusedMoE
from fusedmoe.modular.validation import check_weights, validate_call
from fusedmoe.quant import QTensor, all_schemes
from fusedmoe.testing import make_problem
from fusedmoe.weights import ExpertWeights

E, K, H, I, T = 4, 2, 64, 32, 5
CONFIG = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
BF16 = QuantScheme.unquantized()


@pytest.fixture
def prob():
    return make_problem(CONFIG, BF16, T, seed=3)


def _call(p, check_values=False, **over):
    args = dict(
        x=p.x,
        topk_ids=p.topk_ids,
        topk_weights=p.topk_weights,
        weights=p.weights,
        config=p.config,
        scheme=p.scheme,
        expert_map=p.expert_map,
    )
    args.update(over)
    validate_call(**args, check_values=check_values)


def _run(p, backend="cpu", **kw):
    routing = (p.topk_ids, p.topk_weights)
    return fused_moe(p.x, routing, p.weights, p.config, p.scheme, backend=backend, expert_map=p.expert_map, **kw)


def test_valid_call_passes(prob):
    _call(prob)
    _call(prob, check_values=True)


@pytest.mark.parametrize("scheme", all_schemes(), ids=lambda s: s.name)
@pytest.mark.parametrize("has_bias", [False, True])
def test_valid_weights_take_the_fast_path(scheme, has_bias):
    """Weights of every scheme pass, through the message-free fast path (it costs no measurable time)."""
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=128, intermediate_size=128, has_bias=has_bias)
    p = make_problem(config, scheme, T)
    check_weights(p.weights, config, scheme)
    _call(p, check_values=True)


# ---- x --------------------------------------------------------------------------------
def test_x_hidden_size(prob):
    with pytest.raises(FusedMoEError, match=r"^x: expected .*H = hidden_size = 64, got \(5, 63\)"):
        _call(prob, x=prob.x[:, :63])


def test_x_not_2d(prob):
    with pytest.raises(FusedMoEError, match=r"^x: expected a 2-D tensor \[T, H=64\]"):
        _call(prob, x=prob.x.reshape(1, T, H))


def test_x_not_a_tensor(prob):
    with pytest.raises(FusedMoEError, match=r"^x: expected a tensor"):
        _call(prob, x=prob.x.tolist())


def test_x_dtype(prob):
    with pytest.raises(
        FusedMoEError, match=r"^x: expected dtype torch.bfloat16 \(MoEConfig.dtype\), got torch.float32"
    ):
        _call(prob, x=prob.x.float())


def test_x_last_dim_stride(prob):
    xt = prob.x.t().contiguous().t()  # same values, column-major
    with pytest.raises(FusedMoEError, match=r"^x: expected last-dim stride 1 .*got \(1, 5\)"):
        _call(prob, x=xt)
    with pytest.raises(FusedMoEError, match=r"^x: expected last-dim stride 1"):
        _run(replace(prob, x=xt))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_x_strided_rows_are_accepted(prob, backend):
    """Rows may be strided (a slice of a wider buffer): same output as the contiguous input."""
    wide = torch.zeros(T, 2 * H, dtype=prob.x.dtype)
    wide[:, :H] = prob.x
    strided = replace(prob, x=wide[:, :H])
    assert strided.x.stride() == (2 * H, 1)
    assert torch.equal(_run(strided, backend), _run(prob, backend))


def test_x_device(prob):
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected on x's device \(meta\), got device\(type='cpu'\)"):
        _call(prob, x=prob.x.to("meta"))


# ---- top-k ------------------------------------------------------------------------------
def test_topk_ids_shape(prob):
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected shape \[T, K\] = \[5, 2\] .*got \(4, 2\)"):
        _call(prob, topk_ids=prob.topk_ids[:4])
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected shape \[T, K\] = \[5, 2\] .*K = top_k"):
        _call(prob, topk_ids=prob.topk_ids[:, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8])
def test_topk_ids_dtype(prob, dtype):
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected dtype torch.int32 or torch.int64"):
        _call(prob, topk_ids=prob.topk_ids.to(dtype))


def test_topk_ids_int64_accepted(prob):
    _call(prob, topk_ids=prob.topk_ids.long(), check_values=True)


@pytest.mark.parametrize(
    "dispatcher,backend",
    [
        ("local", "cpu"),
        ("local", "reference"),
        ("local", "loop"),
        ("local_batched", "reference_batched"),
        ("local_batched", "triton_batched"),
        ("local", "triton"),
    ],
)
def test_int64_topk_ids_run_on_every_backend(prob, dispatcher, backend):
    """validate_call accepts int64 ids, so every backend must give the int32 result for them."""
    out32 = _run(prob, backend, dispatcher=dispatcher)
    out64 = _run(replace(prob, topk_ids=prob.topk_ids.long()), backend, dispatcher=dispatcher)
    assert torch.equal(out64, out32)


def test_topk_ids_device(prob):
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected on x's device \(cpu\), got device\(type='meta'\)"):
        _call(prob, topk_ids=prob.topk_ids.to("meta"))


def test_topk_weights_shape(prob):
    with pytest.raises(FusedMoEError, match=r"^topk_weights: expected shape \[T, K\] = \[5, 2\].*got \(5,\)"):
        _call(prob, topk_weights=prob.topk_weights[:, 0])
    with pytest.raises(FusedMoEError, match=r"^topk_weights: expected shape \[T, K\] = \[5, 2\].*got \(5, 3\)"):
        _call(prob, topk_weights=torch.ones(T, 3))


def test_topk_weights_dtype_and_device(prob):
    with pytest.raises(FusedMoEError, match=r"^topk_weights: expected a floating dtype, got torch.int64"):
        _call(prob, topk_weights=torch.ones(T, K, dtype=torch.long))
    with pytest.raises(FusedMoEError, match=r"^topk_weights: expected on x's device \(cpu\)"):
        _call(prob, topk_weights=prob.topk_weights.to("meta"))


def test_topk_ids_out_of_range(prob, monkeypatch):
    ids = prob.topk_ids.clone()
    ids[3, 1] = E
    _call(prob, topk_ids=ids)  # a data check: off by default (it costs a host sync)
    want = r"^topk_ids: expected expert ids in \[0, E\) = \[0, 4\), or -1 for a dropped pair, got '4 at \(3, 1\)'"
    with pytest.raises(FusedMoEError, match=want):
        _call(prob, topk_ids=ids, check_values=True)
    ids[3, 1] = -1  # the documented "no expert" mark: the pair contributes nothing (metadata.TopK)
    _call(prob, topk_ids=ids, check_values=True)
    ids[3, 1] = -5
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected expert ids in \[0, E\)"):
        _call(prob, topk_ids=ids, check_values=True)
    monkeypatch.setenv(ENV_CHECK_VALUES, "1")
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected expert ids in \[0, E\)"):
        _run(replace(prob, topk_ids=ids))


def test_topk_ids_duplicate_in_row(prob, monkeypatch):
    ids = prob.topk_ids.clone()
    ids[2, 1] = ids[2, 0]
    _call(prob, topk_ids=ids)
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected distinct expert ids within each row, got 'row 2: "):
        _call(prob, topk_ids=ids, check_values=True)
    monkeypatch.setenv(ENV_CHECK_VALUES, "1")
    with pytest.raises(FusedMoEError, match=r"^topk_ids: expected distinct"):
        _run(replace(prob, topk_ids=ids))


# ---- NaN / Inf ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_raise_with_check_values(prob, bad):
    x = prob.x.clone()
    x[1, 7] = bad
    _call(prob, x=x)  # policy: not checked by default
    with pytest.raises(FusedMoEError, match=r"^x: expected finite values .*got 'NaN/Inf in token 1'"):
        _call(prob, x=x, check_values=True)
    w = prob.topk_weights.clone()
    w[4, 0] = bad
    with pytest.raises(FusedMoEError, match=r"^topk_weights: expected finite values, got 'row 4: "):
        _call(prob, topk_weights=w, check_values=True)


NAN_SCHEMES = [
    QuantScheme.unquantized(),
    QuantScheme.fp8_per_token(),
    QuantScheme.fp8_block(32, 32),
    QuantScheme.int8_w8a8("channel"),
    QuantScheme.int4_w4a16(32),
    QuantScheme.mxfp4_mxfp8(),
    QuantScheme.nvfp4(),
]


# The bug these guard against: an abs-max taken as ``where(amax > 0, s, 1)`` (or with a float max,
# which drops NaN on the GPU) quantizes the NaN token with a made-up scale, so its output comes out
# finite (int8 casts NaN to 0), and a per-tensor scale of 1 changes every other token too. The
# triton backend runs the activation-quant kernel (under the interpreter on a CPU).
def _nan_run(scheme, backend="cpu"):
    """(clean output, output with a NaN in token 4) of 9 tokens."""
    p = make_problem(CONFIG, scheme, 9, seed=11)
    clean = _run(p, backend)
    bad = p.x.clone()
    bad[4, 3] = float("nan")
    assert torch.isfinite(clean).all()
    return clean, _run(replace(p, x=bad), backend)


OTHERS = torch.arange(9) != 4
_ON_CPU = "x is on the CPU: triton runs there under TRITON_INTERPRET=1 (GPU: test_kernels_act_quant)"
NAN_BACKENDS = [
    "cpu",
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(not interpreting(), reason=_ON_CPU)),
]


@pytest.mark.parametrize("backend", NAN_BACKENDS)
@pytest.mark.parametrize("scheme", NAN_SCHEMES, ids=lambda s: s.name)
def test_nan_token_leaves_other_tokens_unchanged(backend, scheme):
    """The documented policy: a NaN in one token's input never reaches another token."""
    clean, out = _nan_run(scheme, backend)
    assert torch.isfinite(out[OTHERS]).all()
    assert torch.equal(out[OTHERS], clean[OTHERS])


@pytest.mark.parametrize("backend", NAN_BACKENDS)
@pytest.mark.parametrize(
    "scheme",
    [s for s in NAN_SCHEMES],
    ids=lambda s: s.name,
)
def test_nan_token_output_is_not_finite(backend, scheme):
    """...and shows in that token's own output (never silently turned into finite values)."""
    _, out = _nan_run(scheme, backend)
    assert not torch.isfinite(out[4]).all()


@pytest.mark.parametrize("backend", NAN_BACKENDS)
@pytest.mark.parametrize(
    "scheme", [QuantScheme.fp8_per_tensor(), QuantScheme.int8_w8a8("tensor")], ids=lambda s: s.name
)
def test_nan_with_per_tensor_dynamic_scale(backend, scheme):
    """The documented exception: a per-tensor dynamic scale is an abs-max over every token, so a NaN
    token may make the others NaN too, but must never change them into other finite values."""
    clean, out = _nan_run(scheme, backend)
    nan_rows = torch.isnan(out).any(dim=1)
    assert nan_rows[4]
    assert torch.equal(out[~nan_rows], clean[~nan_rows])


# ---- weights / scheme ---------------------------------------------------------------------
def test_weights_not_expert_weights(prob):
    with pytest.raises(FusedMoEError, match=r"^weights: expected an ExpertWeights, got <class 'tuple'>"):
        _call(prob, weights=(prob.weights.w13.data, prob.weights.w2.data))
    with pytest.raises(FusedMoEError, match=r"^weights: expected an ExpertWeights, got 'None'"):
        _call(prob, weights=None)


def test_weights_wrong_number_of_experts(prob):
    w = make_problem(CONFIG.replace(num_experts=3, top_k=2), BF16, 1).weights
    with pytest.raises(FusedMoEError, match=r"^weights: expected num_experts = 4 experts .*got 3"):
        _call(prob, weights=w)


def test_weights_wrong_shape(prob):
    w = make_problem(CONFIG.replace(hidden_size=96), BF16, 1).weights
    with pytest.raises(FusedMoEError, match=r"^weights.w13: expected logical shape \(4, 64, 64\)"):
        _call(prob, weights=w)


def test_weights_bias_mismatch(prob):
    w = make_problem(CONFIG.replace(has_bias=True), BF16, 1).weights
    with pytest.raises(FusedMoEError, match=r"^weights.b13/b2: expected None when has_bias=False"):
        _call(prob, weights=w)


def test_unquantized_weights_dtype(prob):
    w = ExpertWeights.from_float(prob.weights.w13.data.float(), prob.weights.w2.data.float(), BF16)
    with pytest.raises(FusedMoEError, match=r"^weights.w13.data: expected dtype torch.bfloat16 \(MoEConfig.dtype\)"):
        _call(prob, weights=w)


def test_scheme_weights_mismatch_unquantized_weights():
    p = make_problem(CONFIG, BF16, T)
    with pytest.raises(FusedMoEError, match=r"^weights.w13.scale: expected a scale for fp8_channel"):
        _call(p, scheme=QuantScheme.fp8_per_channel())


def test_scheme_weights_mismatch_int8_data_for_fp8():
    p = make_problem(CONFIG, QuantScheme.int8_w8a8("channel"), T)
    with pytest.raises(FusedMoEError, match=r"^weights.w13.data: expected dtype torch.float8_e4m3fn \(fp8_e4m3 stored"):
        _call(p, scheme=QuantScheme.fp8_per_channel())


def test_scheme_weights_mismatch_unpacked_int4():
    p = make_problem(CONFIG, QuantScheme.int4_w4a16(32), T)
    w = p.weights
    unpacked = ExpertWeights(
        w13=QTensor(torch.zeros(w.w13.shape, dtype=torch.int8), w.w13.shape, scale=w.w13.scale),
        w2=w.w2,
    )
    with pytest.raises(
        FusedMoEError, match=r"^weights.w13.data: expected dtype torch.uint8 \(int4 packed two per uint8\)"
    ):
        _call(p, weights=unpacked)
    wrong_width = ExpertWeights(
        w13=QTensor(torch.zeros(w.w13.shape, dtype=torch.uint8), w.w13.shape, scale=w.w13.scale),
        w2=w.w2,
    )
    with pytest.raises(FusedMoEError, match=r"^weights.w13.data: expected stored shape \(4, 64, 32\)"):
        _call(p, weights=wrong_width)


def test_scheme_weights_mismatch_scale_dtype():
    p = make_problem(CONFIG, QuantScheme.mxfp4_w4a16(), T)
    w13 = p.weights.w13
    w = ExpertWeights(w13=QTensor(w13.data, w13.shape, scale=w13.scale.float()), w2=p.weights.w2)
    with pytest.raises(FusedMoEError, match=r"^weights.w13.scale: expected e8m0 codes"):
        _call(p, weights=w)


def test_scheme_weights_mismatch_missing_zero_points():
    p = make_problem(CONFIG, QuantScheme.int4_w4a16(32), T)
    with pytest.raises(FusedMoEError, match=r"^weights.w13.zero: expected zero points for int4_g32_zp"):
        _call(p, scheme=QuantScheme.int4_w4a16(32, zero_points=True))


def test_scheme_weights_mismatch_missing_static_scale():
    p = make_problem(CONFIG, QuantScheme.fp8_per_tensor(), T)
    with pytest.raises(FusedMoEError, match=r"^weights.a1_scale: expected a static scale for fp8_tensor_static"):
        _call(p, scheme=QuantScheme.fp8_per_tensor(static_activations=True))


def test_weights_device(prob):
    with pytest.raises(FusedMoEError, match=r"^weights.w13.data: expected on x's device \(cpu\)"):
        _call(prob, weights=prob.weights.to("meta"))


def test_unsupported_shape_is_refused():
    config = CONFIG.replace(hidden_size=48)
    p = make_problem(config, BF16, T)
    with pytest.raises(UnsupportedError, match=r"scheme mxfp4: .*hidden_size=48 is not a multiple of the mxfp4 group"):
        _call(p, scheme=QuantScheme.mxfp4_w4a16())


# ---- expert map ---------------------------------------------------------------------------
def _ep_problem():
    emap = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    return make_problem(CONFIG, BF16, T, expert_map=emap, num_local_experts=2)


def test_expert_map_valid():
    p = _ep_problem()
    _call(p, check_values=True)
    assert torch.isfinite(_run(p)).all()


def test_expert_map_shape_dtype_device():
    p = _ep_problem()
    with pytest.raises(FusedMoEError, match=r"^expert_map: expected shape \[E\] = \[4\] .*got \(3,\)"):
        _call(p, expert_map=p.expert_map[:3])
    with pytest.raises(FusedMoEError, match=r"^expert_map: expected dtype torch.int32, got torch.int64"):
        _call(p, expert_map=p.expert_map.long())
    with pytest.raises(FusedMoEError, match=r"^expert_map: expected on x's device \(cpu\)"):
        _call(p, expert_map=p.expert_map.to("meta"))


def test_expert_map_values():
    p = _ep_problem()
    bad = torch.tensor([-1, 0, 2, 1], dtype=torch.int32)  # 2 local experts: ids 0 and 1
    _call(p, expert_map=bad)
    with pytest.raises(FusedMoEError, match=r"^expert_map: expected entries in \[-1, E_local\) = \[-1, 2\)"):
        _call(p, expert_map=bad, check_values=True)
    with pytest.raises(FusedMoEError, match=r"^expert_map: expected entries in \[-1, E_local\)"):
        _call(p, expert_map=torch.tensor([-2, 0, -1, 1], dtype=torch.int32), check_values=True)


def test_weights_more_than_num_experts_with_map():
    p = _ep_problem()
    w = make_problem(CONFIG.replace(num_experts=5), BF16, 1).weights
    with pytest.raises(FusedMoEError, match=r"^weights: expected between 1 and num_experts = 4 local experts"):
        _call(p, weights=w)


# ---- T = 0 -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dispatcher,backend", [("local", "cpu"), ("local", "reference"), ("local_batched", "reference_batched")]
)
def test_no_tokens(dispatcher, backend):
    p = make_problem(CONFIG, BF16, 0)
    _call(p, check_values=True)
    out = _run(p, backend, dispatcher=dispatcher)
    assert out.shape == (0, H) and out.dtype == CONFIG.dtype


# ---- FusedMoE.forward ---------------------------------------------------------------------
def _layer() -> FusedMoE:
    p = make_problem(CONFIG, BF16, 1)
    layer = FusedMoE(CONFIG, BF16, backend="cpu")
    for e in range(E):
        layer.weight_loader("w13_weight", p.weights.w13.data[e], e, "w13")
        layer.weight_loader("w2_weight", p.weights.w2.data[e], e, "w2")
    layer.process_weights_after_loading()
    return layer


def test_layer_forward_validates(monkeypatch):
    layer = _layer()
    x = torch.randn(2, 3, H).bfloat16()
    logits = torch.randn(2, 3, E)
    assert layer(x, logits).shape == (2, 3, H)
    assert layer(x[:, :0], logits[:, :0]).shape == (2, 0, H)
    with pytest.raises(FusedMoEError, match=r"^weights.w13.data: expected on x's device \(meta\)"):
        layer(x.to("meta"), logits.to("meta"))
    x[1, 2, 5] = float("nan")
    out = layer(x, logits)
    assert torch.isnan(out[1, 2]).any() and torch.isfinite(out.reshape(6, H)[:5]).all()
    monkeypatch.setenv(ENV_CHECK_VALUES, "1")
    with pytest.raises(FusedMoEError, match=r"^x: expected finite values .*token 5"):
        layer(x, logits)


@pytest.mark.parametrize("backend", NAN_BACKENDS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swigluoai", "relu2_no_mul", "silu_no_mul"])
def test_nan_survives_every_activation(backend, activation):
    """Clamps and relu must keep a NaN (the GPU's float max/min return the other operand), so a
    NaN token's output is NaN after any activation, also when GEMM1 applies it in its epilogue."""
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, activation=activation)
    p = make_problem(cfg, BF16, 9, seed=11)
    bad = p.x.clone()
    bad[4, 3] = float("nan")
    out = _run(replace(p, x=bad), backend)
    assert not torch.isfinite(out[4]).all()
    assert torch.isfinite(out[OTHERS]).all()
