"""``FusedMoE``: loading (shards, TP, EP), conversion, padding, forward, and its errors.

Each test quantizes random float weights with the scheme (what an offline
quantizer stores), cuts them into the per-expert "checkpoint" tensors a
format module hands to ``weight_loader`` (canonical layout, full I), loads
them, and compares ``forward`` with ``moe_reference`` in float64 on the same
weights, within ``fusedmoe.testing.tolerance``. Tensor / expert parallelism is
checked by summing the partial outputs of every rank.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import FusedMoEError, MoEConfig, ParallelConfig, QuantScheme, UnsupportedError
from fusedmoe.experts.reference import ReferenceExperts, moe_reference
from fusedmoe.layer import FusedMoE
from fusedmoe.quant import dequantize
from fusedmoe.routing import RouterConfig
from fusedmoe.testing import rel_error, tolerance
from fusedmoe.weights import ExpertWeights

E, K, H, I = 4, 2, 128, 64
S = QuantScheme
SCHEMES = [
    S.unquantized(),
    S.fp8_per_tensor(),
    S.fp8_per_tensor(static_activations=True),
    S.fp8_per_channel(),
    S.fp8_block(32, 32),
    S.int8_w8a8("channel"),
    S.int8_w8a16(),
    S.int4_w4a16(32),
    S.int4_w4a16(32, zero_points=True),
    S.int4_w4a16(32, act_order=True),
    S.mxfp4_w4a16(),
    S.nvfp4_w4a16(),
    S.nvfp4(),
]


def _config(dtype=torch.float32, **kw) -> MoEConfig:
    return MoEConfig(**{**dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=dtype), **kw})


def _weights(config: MoEConfig, scheme: QuantScheme, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    h, i, e = config.hidden_size, config.intermediate_size, config.num_experts
    w13 = torch.randn(e, config.w13_rows, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    b13 = b2 = None
    if config.has_bias:
        b13 = (torch.randn(e, config.w13_rows, generator=g) * 0.1).to(config.dtype)
        b2 = (torch.randn(e, h, generator=g) * 0.1).to(config.dtype)
    if scheme.w1 is None:
        return ExpertWeights.from_float(w13.to(config.dtype), w2.to(config.dtype), scheme, b13=b13, b2=b2)
    return ExpertWeights.from_float(w13, w2, scheme, b13=b13, b2=b2, calib_x=torch.randn(64, h, generator=g))


def _rows(tq, rows: slice) -> slice:
    """Logical rows -> stored rows of a scale (block scales have one row per block_n rows)."""
    unit = tq.granularity.block_n if tq.granularity.kind == "block" else 1
    return rows if unit == 1 else slice(rows.start // unit, -(-rows.stop // unit))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a, b)


def _pieces(q, tq, e: int, rows: slice | None) -> dict[str, torch.Tensor]:
    """Canonical checkpoint pieces of expert ``e`` (rows in logical units for W13 halves)."""
    data = q.data[e] if rows is None else q.data[e, rows]
    out = {"weight": data}
    if tq is None:
        return out
    if tq.granularity.kind == "tensor":
        out["weight_scale"] = q.scale[e].reshape(())
    else:
        srows = slice(None) if rows is None else _rows(tq, rows)
        out["weight_scale"] = q.scale[e, srows]
        if q.zero is not None:
            out["weight_zero_point"] = q.zero[e, srows]
    if q.global_scale is not None:
        out["weight_global_scale"] = q.global_scale[e].reshape(())
    if q.g_idx is not None:
        out["g_idx"] = q.g_idx[e]
    return out


def _load(layer: FusedMoE, w: ExpertWeights, scheme: QuantScheme, fused: bool = False) -> None:
    """Feed ``w`` (full I) to ``layer`` as a checkpoint loader would."""
    c = layer.config
    i_full = w.w2.shape[2]
    for e in range(c.num_experts):
        if fused:
            parts = [("w13", _pieces(w.w13, scheme.w1, e, None), None)]
        elif c.gate_up_interleaved:
            parts = [("w1", _pieces(w.w13, scheme.w1, e, slice(0, 2 * i_full, 2)), slice(0, None, 2))]
            parts.append(("w3", _pieces(w.w13, scheme.w1, e, slice(1, 2 * i_full, 2)), slice(1, None, 2)))
        else:
            parts = [("w1", _pieces(w.w13, scheme.w1, e, slice(0, i_full)), slice(0, i_full))]
            parts.append(("w3", _pieces(w.w13, scheme.w1, e, slice(i_full, 2 * i_full)), slice(i_full, None)))
        parts.append(("w2", _pieces(w.w2, scheme.w2, e, None), None))
        for shard, pieces, brows in parts:
            prefix = "w2" if shard == "w2" else "w13"
            for key, t in pieces.items():
                layer.weight_loader(f"{prefix}_{key}", t, e, shard)
            bias = w.b2 if shard == "w2" else w.b13
            if bias is not None:
                layer.weight_loader(f"{prefix}_bias", bias[e] if brows is None else bias[e, brows], e, shard)
        for name, key in (("a1", "w13"), ("a2", "w2")):
            for suffix, field in (("input_scale", "scale"), ("input_global_scale", "global_scale")):
                v = getattr(w, f"{name}_{field}")
                if v is not None:
                    layer.weight_loader(f"{key}_{suffix}", v, e, "w2" if key == "w2" else "w1")


def _inputs(config: MoEConfig, t: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, config.hidden_size, generator=g).to(config.dtype)
    return x, torch.randn(t, config.num_experts, generator=g)


def _reference(layer: FusedMoE, w: ExpertWeights, x, logits, config=None) -> torch.Tensor:
    topk = layer.router.route(logits, layer.e_score_correction_bias)
    c = config or layer.config
    return moe_reference(x, topk.ids, topk.weights, w, c, layer.scheme, dtype=torch.float64)


def _build(config, scheme, backend="reference", parallel=None, fused=False, w=None, **kw):
    w = w or _weights(
        config.replace(intermediate_size=config.intermediate_size * (parallel.tp_size if parallel else 1)), scheme
    )
    layer = FusedMoE(config, scheme, parallel=parallel, backend=backend, **kw)
    _load(layer, w, scheme, fused)
    layer.process_weights_after_loading(keep_reference=True)
    return layer, w


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_layer_matches_reference(scheme, backend):
    dtype = torch.bfloat16 if backend == "cpu" else torch.float32
    config = _config(dtype)
    layer, w = _build(config, scheme, backend)
    assert layer.choice.backend == backend
    x, logits = _inputs(config)
    out = layer(x, logits)
    err = rel_error(out, _reference(layer, w, x, logits))
    assert out.shape == x.shape and out.dtype == dtype
    assert err < tolerance(scheme, dtype), (scheme.name, backend, err)


@pytest.mark.parametrize(
    "scheme", [S.unquantized(), S.fp8_block(32, 32), S.int4_w4a16(32, zero_points=True), S.nvfp4()]
)
def test_fused_w13_shard_loads_the_same(scheme):
    config = _config()
    a, w = _build(config, scheme)
    b, _ = _build(config, scheme, fused=True, w=w)
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert _same(p, pb[name]), name


@pytest.mark.parametrize("fused", [False, True])
def test_interleaved_gate_up_with_biases(fused):
    """gpt-oss: gate/up interleaved rows, biases on both GEMMs, swigluoai."""
    config = _config(activation="swigluoai", has_bias=True, gate_up_interleaved=True)
    scheme = S.mxfp4_w4a16()
    layer, w = _build(config, scheme, fused=fused)
    x, logits = _inputs(config)
    assert rel_error(layer(x, logits), _reference(layer, w, x, logits)) < tolerance(scheme, torch.float32)


@pytest.mark.parametrize(
    "scheme", [S.unquantized(), S.fp8_per_channel(), S.int4_w4a16(32), S.mxfp4_w4a16(), S.nvfp4()], ids=lambda s: s.name
)
@pytest.mark.parametrize("parallel", ["tp2", "ep2_linear", "ep2_round_robin", "ep3", "tp2_ep2"])
def test_parallel_ranks_sum_to_the_full_layer(scheme, parallel):
    """Each rank loads the same full checkpoint; the partial outputs add up to the whole layer."""
    tp = 2 if parallel.startswith("tp2") else 1
    ep = {"ep2_linear": 2, "ep2_round_robin": 2, "ep3": 3, "tp2_ep2": 2}.get(parallel, 1)
    placement = "round_robin" if parallel.endswith("round_robin") else "linear"
    full = _config(has_bias=True)
    w = _weights(full, scheme)
    x, logits = _inputs(full)
    total = torch.zeros_like(x, dtype=torch.float64)
    owners = []
    for tr in range(tp):
        for er in range(ep):
            par = ParallelConfig(tp_size=tp, tp_rank=tr, ep_size=ep, ep_rank=er, placement=placement)
            layer, _ = _build(full.replace(intermediate_size=I // tp), scheme, parallel=par, w=w)
            owners += layer.local_experts
            total += layer(x, logits).double()
    assert sorted(owners) == sorted(list(range(E)) * tp)
    ref = FusedMoE(full, scheme, backend="reference")
    _load(ref, w, scheme)
    ref.process_weights_after_loading()
    err = rel_error(total, _reference(ref, w, x, logits, full))
    assert err < tolerance(scheme, torch.float32), (parallel, err)


def test_expert_parallel_skips_other_experts():
    par = ParallelConfig(ep_size=2, ep_rank=1, placement="round_robin")
    layer = FusedMoE(_config(), parallel=par)
    assert layer.local_experts == [1, 3] and layer.w13_weight.shape[0] == 2
    assert not layer.weight_loader("w13_weight", torch.randn(2 * I, H), 0, "w13")
    assert layer.weight_loader("w13_weight", torch.randn(2 * I, H), 3, "w13")


def test_tensor_parallel_refuses_to_cut_a_block():
    with pytest.raises(FusedMoEError, match="whole groups/blocks"):
        _build(_config(intermediate_size=I // 2), S.fp8_block(64, 64), parallel=ParallelConfig(tp_size=2, tp_rank=1))


def test_different_w1_w3_tensor_scales_are_unified():
    """Per-tensor W1/W3 scales that differ: both halves requantized to the larger (as vLLM)."""
    config, scheme = _config(), S.fp8_per_tensor()
    w = _weights(config, scheme)
    layer = FusedMoE(config, scheme, backend="reference")
    x13 = dequantize(w.w13, scheme.w1)
    for e in range(E):
        for shard, rows, f in (("w1", slice(0, I), 1.0), ("w3", slice(I, None), 3.0)):
            q = (x13[e, rows] / (w.w13.scale[e] * f)).to(torch.float8_e4m3fn)
            layer.weight_loader("w13_weight", q, e, shard)
            layer.weight_loader("w13_weight_scale", w.w13.scale[e] * f, e, shard)
        layer.weight_loader("w2_weight", w.w2.data[e], e, "w2")
        layer.weight_loader("w2_weight_scale", w.w2.scale[e], e, "w2")
    layer.process_weights_after_loading(keep_reference=True)
    got = layer.reference_weights
    assert torch.equal(got.w13.scale.reshape(-1), 3.0 * w.w13.scale.reshape(-1))
    assert rel_error(dequantize(got.w13, scheme.w1), x13) < 0.1  # one fp8 step at up to 3x the scale
    x, logits = _inputs(config)
    assert rel_error(layer(x, logits), _reference(layer, got, x, logits)) < tolerance(scheme, torch.float32)


def test_online_quantization():
    config, scheme = _config(torch.bfloat16), S.fp8_per_tensor()
    w = _weights(config, S.unquantized())
    layer = FusedMoE(config, scheme, backend="cpu", online_quant=True)
    assert layer.w13_weight.dtype == torch.bfloat16
    _load(layer, w, S.unquantized())
    layer.process_weights_after_loading(keep_reference=True)
    assert layer.w13_weight.dtype == torch.float8_e4m3fn
    x, logits = _inputs(config)
    assert rel_error(layer(x, logits), _reference(layer, layer.reference_weights, x, logits)) < tolerance(
        scheme, torch.bfloat16
    )
    qw = ExpertWeights.from_float(w.w13.data.float(), w.w2.data.float(), scheme)
    assert torch.equal(layer.reference_weights.w13.scale, qw.w13.scale)


@pytest.mark.parametrize(
    "scheme", [S.unquantized(), S.fp8_block(32, 32), S.int4_w4a16(32, act_order=True), S.nvfp4()], ids=lambda s: s.name
)
def test_padding_for_a_backend_that_needs_it(scheme, monkeypatch):
    monkeypatch.setattr(ReferenceExperts, "alignment", classmethod(lambda cls, scheme, platform: (256, 128)))
    config = _config(hidden_size=160, intermediate_size=96)
    layer, w = _build(config, scheme)
    assert layer.w13_weight.shape[1:3] == ((256, 256) if scheme.w1 is None or scheme.w1.dtype.bits == 8 else (256, 128))
    x, logits = _inputs(config)
    out = layer(x.reshape(3, 3, -1), logits.reshape(3, 3, -1))
    assert out.shape == (3, 3, 160)
    assert rel_error(out.reshape(9, -1), _reference(layer, w, x, logits)) < tolerance(scheme, torch.float32)


def test_shared_experts_and_correction_bias_and_token_shapes():
    config = _config()
    bias = torch.randn(E) * 0.1
    router = RouterConfig(E, K, scoring="sigmoid", renormalize=True, num_expert_group=2, topk_group=1)
    shared = torch.nn.Linear(H, H, bias=False)
    layer, w = _build(config, S.unquantized(), router=router, correction_bias=bias, shared_experts=shared)
    x, logits = _inputs(config)
    with torch.no_grad():
        ref = _reference(layer, w, x, logits) + shared(x).double()
        assert rel_error(layer(x, logits), ref) < 1e-5
        assert layer(x[:0], logits[:0]).shape == (0, H)
        assert rel_error(layer(x[:1], logits[:1]), ref[:1]) < 1e-5


def test_parameters_are_named_like_a_checkpoint():
    layer = FusedMoE(_config(has_bias=True), S.nvfp4())
    names = dict(layer.named_parameters())
    assert names["w13_weight"].shape == (E, 2 * I, H // 2) and names["w13_weight"].dtype == torch.uint8
    assert (
        names["w13_weight_scale"].shape == (E, 2 * I, H // 16)
        and names["w13_weight_scale"].dtype == torch.float8_e4m3fn
    )
    assert names["w13_weight_global_scale"].shape == (E, 2)
    assert {"w13_bias", "w2_bias", "w13_input_global_scale", "w2_input_global_scale"} <= set(names)
    gptq = dict(FusedMoE(_config(), S.int4_w4a16(32, zero_points=True, act_order=True)).named_parameters())
    assert gptq["w2_weight_zero_point"].shape == (E, H, I // 32) and gptq["w13_g_idx"].shape == (E, H)


def test_errors_name_the_tensor():
    config = _config()
    layer = FusedMoE(config, S.fp8_per_channel())
    with pytest.raises(FusedMoEError, match="param_name: expected one of"):
        layer.weight_loader("w13_qweight", torch.zeros(1), 0, "w1")
    with pytest.raises(FusedMoEError, match=r"w13_weight \(expert 0, shard w1\): expected dtype torch.float8_e4m3fn"):
        layer.weight_loader("w13_weight", torch.zeros(I, H), 0, "w1")
    with pytest.raises(FusedMoEError, match=r"expected 64 stored rows for N = I = 64"):
        layer.weight_loader("w13_weight", torch.zeros(I + 1, H).to(torch.float8_e4m3fn), 0, "w1")
    with pytest.raises(FusedMoEError, match="shard_id: expected one of"):
        layer.weight_loader("w13_weight", torch.zeros(I, H), 0, "gate")
    with pytest.raises(FusedMoEError, match="'w2' for w2_"):
        layer.weight_loader("w2_weight", torch.zeros(H, I), 0, "w1")
    with pytest.raises(FusedMoEError, match="process_weights_after_loading"):
        layer(torch.zeros(1, H), torch.zeros(1, E))
    layer.weight_loader("w13_weight", torch.zeros(I, H).to(torch.float8_e4m3fn), 0, "w1")
    with pytest.raises(FusedMoEError, match="w13_weight: expected loaded for expert 0"):
        layer.process_weights_after_loading()


def test_an_explicit_backend_that_cannot_run_is_refused():
    layer = FusedMoE(_config(), S.unquantized(), backend="deep_gemm")
    _load(layer, _weights(_config(), S.unquantized()), S.unquantized())
    with pytest.raises(UnsupportedError, match="deep_gemm"):
        layer.process_weights_after_loading()
