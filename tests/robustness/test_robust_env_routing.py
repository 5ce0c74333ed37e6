"""Classes 7, 8 and 9: determinism of the reference, the environment and the router, and
error messages that name the argument at fault.

7. The reference backend under FUSEDMOE_DETERMINISTIC in fp32 gave a token ~7e-7 apart alone
   and in a batch (MKL sgemm differs with the row count); now bitwise equal.
8. FUSEDMOE_* values are parsed strictly (a bad one is an error naming the variable; booleans
   take 1/true/yes/on and 0/false/no/off); FUSEDMOE_SKIP_BACKENDS with a typo was ignored;
   ``RouterConfig(E, K)`` did not renormalize while ``fused_moe``'s default router did (outputs
   50% apart for the "same" router).
9. A logits row-count mismatch was reported as ``topk_ids``; a weight was called ``x``.
"""

from __future__ import annotations

import pytest
import torch
from robust_helpers import CFG, T, dropped_reference, equals_reference, problem, raises_clearly, robust

from fusedmoe import ExpertWeights, FusedMoE, MoEConfig, QuantScheme, RouterConfig, TopK, fused_moe, select_experts
from fusedmoe import env as fenv
from fusedmoe.api import cached_kernel
from fusedmoe.kernels._common import interpreting
from fusedmoe.routing import route

FP32 = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, dtype=torch.float32)


# ---- class 7: batch invariance of the reference (and the cpu backend) ---------------------------


@robust(7, "reference")
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "int4_g32"])
def test_deterministic_backends_give_a_token_the_same_bits_alone_and_in_a_batch(monkeypatch, backend, scheme):
    monkeypatch.setenv(fenv.DETERMINISTIC, "yes")
    prob = problem(scheme, FP32, t=37)
    run = lambda s: fused_moe(prob.x[s], (prob.topk_ids[s], prob.topk_weights[s]), prob.weights, FP32, prob.scheme,  # noqa: E731
                              backend=backend)  # fmt: skip
    full = run(slice(None))
    for i in (0, 17, 36):
        assert torch.equal(run(slice(i, i + 1))[0], full[i]), f"token {i}"
    equals_reference(full, prob.reference(), prob.scheme, FP32.dtype)


# ---- class 8: the environment -------------------------------------------------------------------

BAD_ENV = [
    (fenv.CHUNK_SIZE, "abc"),
    (fenv.CHUNK_SIZE, "0"),
    (fenv.CHUNK_SIZE, "-4"),
    (fenv.CHUNK_SIZE, "1.5"),
    (fenv.DETERMINISTIC, "maybe"),
    (fenv.DETERMINISTIC, "2"),
    (fenv.FUSE_ACT, "nope"),
    (fenv.CHECK_VALUES, "enabled"),
    (fenv.SKIP_BACKENDS, "cpuu"),
    (fenv.SKIP_BACKENDS, "reference,tritn"),
    (fenv.BACKEND, "no_such_backend"),
    (fenv.family_backend("unquantized"), "cpux"),
]


@robust(8, "error")
@pytest.mark.parametrize("var,value", BAD_ENV)
def test_a_bad_environment_value_is_refused_naming_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    prob = problem("bf16")
    raises_clearly(lambda: fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, CFG), var)


@pytest.mark.skipif(not interpreting(), reason="the launch config is read by the Triton path")
@robust(8, "error")
@pytest.mark.parametrize("value", ["16,16", "a,b,c,d,e,f", "16,16,16,1,4,0"])
def test_a_bad_launch_config_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(fenv.LAUNCH_CONFIG, value)
    prob = problem("bf16")
    fn = lambda: fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, CFG, backend="triton")  # noqa: E731
    raises_clearly(fn, fenv.LAUNCH_CONFIG)


GOOD_BOOLS = [("1", True), ("true", True), ("Yes", True), (" ON ", True), ("0", False), ("off", False),
              ("NO", False), ("", False)]  # fmt: skip


@robust(8, "reference")
@pytest.mark.parametrize("value,on", GOOD_BOOLS)
def test_boolean_variables_take_every_spelling(monkeypatch, value, on):
    monkeypatch.setenv(fenv.DETERMINISTIC, value)
    prob = problem("bf16", FP32)
    kern = cached_kernel(FP32, prob.scheme, "cpu")
    assert kern.deterministic is on and kern.experts.deterministic is on
    out = fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, FP32, backend="cpu")
    equals_reference(out, prob.reference(), prob.scheme, FP32.dtype)


@robust(8, "reference")
@pytest.mark.parametrize("value", ["3", " 2 "])
def test_chunk_size_in_the_environment_chunks(monkeypatch, value):
    monkeypatch.setenv(fenv.CHUNK_SIZE, value)
    prob = problem("bf16", t=7)
    assert cached_kernel(CFG, prob.scheme, "cpu").chunk_size == int(value)
    out = fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, CFG, backend="cpu")
    equals_reference(out, prob.reference(), prob.scheme, CFG.dtype)


@robust(8, "reference")
def test_skip_list_with_known_names_is_honoured(monkeypatch):
    monkeypatch.setenv(fenv.SKIP_BACKENDS, " cpu , grouped_mm ")
    c = select_experts(CFG, QuantScheme.unquantized())
    assert c.backend not in ("cpu", "grouped_mm")
    prob = problem("bf16")
    equals_reference(fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, CFG), prob.reference(),
                     prob.scheme, CFG.dtype)  # fmt: skip


@robust(8, "reference")
@pytest.mark.parametrize("router", ["default", "RouterConfig(E, K)", "FusedMoE"])
def test_the_default_router_renormalizes_everywhere(router):
    """fused_moe's default router, RouterConfig(E, K) and FusedMoE's router are one router."""
    prob = problem("bf16")
    logits = torch.randn(T, CFG.num_experts, generator=torch.Generator().manual_seed(9))
    top = torch.topk(logits.softmax(-1), 2)
    w = top.values / top.values.sum(-1, keepdim=True)
    ref = dropped_reference(prob, top.indices.int(), w)
    if router == "FusedMoE":
        assert FusedMoE(CFG).router == RouterConfig(CFG.num_experts, CFG.top_k)
        return
    r = None if router == "default" else RouterConfig(CFG.num_experts, CFG.top_k)
    out = fused_moe(prob.x, logits, prob.weights, CFG, router=r)
    equals_reference(out, ref, prob.scheme, CFG.dtype)


@robust(8, "reference")
def test_a_router_that_does_not_renormalize_says_so():
    prob = problem("bf16")
    logits = torch.randn(T, CFG.num_experts, generator=torch.Generator().manual_seed(9))
    top = torch.topk(logits.softmax(-1), 2)
    out = fused_moe(prob.x, logits, prob.weights, CFG, router=RouterConfig(4, 2, renormalize=False))
    equals_reference(out, dropped_reference(prob, top.indices.int(), top.values), prob.scheme, CFG.dtype)


@robust(8, "error")
def test_route_refuses_renormalize_with_a_custom_function():
    fn = lambda logits, k: torch.topk(logits, k)  # noqa: E731
    raises_clearly(lambda: route(torch.randn(3, 4), 2, renormalize=True, custom_fn=fn), "renormalize")


# ---- class 9: messages that name the argument at fault ------------------------------------------


def _call(**kw):
    prob = problem("bf16")
    args = dict(x=prob.x, routing=(prob.topk_ids, prob.topk_weights), weights=prob.weights, config=CFG)
    args.update(kw)
    return lambda: fused_moe(**args)


MESSAGES = [
    ("logits_rows", dict(routing=torch.randn(T + 1, 4)), "routing"),
    ("logits_columns", dict(routing=torch.randn(T, 5)), "routing"),
    ("logits_1d", dict(routing=torch.randn(T)), "routing"),
    ("routing_triple", dict(routing=(1, 2, 3)), "routing"),
    ("routing_string", dict(routing="topk"), "routing"),
    ("router_not_a_router", dict(routing=torch.randn(T, 4), router="softmax"), "router"),
    ("ids_shape", dict(routing=(torch.zeros(T, 3, dtype=torch.int32), torch.ones(T, 3))), "topk_ids"),
    ("ids_float", dict(routing=(torch.zeros(T, 2), torch.ones(T, 2))), "topk_ids"),
    (
        "weights_int",
        dict(routing=(torch.zeros(T, 2, dtype=torch.int32), torch.ones(T, 2, dtype=torch.int32))),
        "topk_weights",
    ),  # fmt: skip
    ("weights_rows", dict(routing=(torch.zeros(T, 2, dtype=torch.int32), torch.ones(T - 1, 2))), "topk_weights"),
    ("x_dtype", dict(x=torch.randn(T, 64)), "x"),
    ("x_width", dict(x=torch.randn(T, 65, dtype=torch.bfloat16)), "x"),
    ("x_1d", dict(x=torch.randn(64, dtype=torch.bfloat16)), "x"),
    ("weights_type", dict(weights="w"), "weights"),
    ("weights_experts", dict(config=MoEConfig(5, 2, 64, 32)), "weights"),
    ("config_type", dict(config="cfg"), "config"),
    ("expert_map_length", dict(expert_map=torch.tensor([0, 1, 2], dtype=torch.int32)), "expert_map"),
    ("expert_map_dtype", dict(expert_map=torch.arange(4)), "expert_map"),
    ("backend_unknown", dict(backend="tritonn"), "backend"),
    ("dispatcher_unknown", dict(dispatcher="local2"), "dispatcher"),
]


@robust(9, "error")
@pytest.mark.parametrize("label,kw,name", MESSAGES, ids=[m[0] for m in MESSAGES])
def test_fused_moe_errors_name_the_argument(label, kw, name):
    raises_clearly(_call(**kw), name)


BUILD = [
    ("w13_1d", lambda: ExpertWeights.from_float(torch.randn(64), torch.randn(4, 64, 32), QuantScheme.fp8_block()),
     "w13"),
    ("w13_int", lambda: ExpertWeights.from_float(torch.ones(4, 64, 64, dtype=torch.int32), torch.randn(4, 64, 32),
                                                 QuantScheme.unquantized()), "w13"),
    ("w2_experts", lambda: ExpertWeights.from_float(torch.randn(4, 64, 64), torch.randn(3, 64, 32),
                                                    QuantScheme.unquantized()), "w2"),
    ("w2_hidden", lambda: ExpertWeights.from_float(torch.randn(4, 64, 64), torch.randn(4, 60, 32),
                                                   QuantScheme.unquantized()), "w2"),
    ("group_size", lambda: ExpertWeights.from_float(torch.randn(4, 64, 64), torch.randn(4, 64, 32),
                                                    QuantScheme.int4_w4a16(128)), "w13/w2"),
]  # fmt: skip


@robust(9, "error")
@pytest.mark.parametrize("label,fn,name", BUILD, ids=[b[0] for b in BUILD])
def test_building_weights_names_w13_or_w2_not_x(label, fn, name):
    msg = raises_clearly(fn, name)
    assert not msg.startswith("x:"), msg


def _layer():
    layer = FusedMoE(CFG, backend="cpu")
    prob = problem("bf16")
    for name, t in (("w13_weight", prob.weights.w13.data), ("w2_weight", prob.weights.w2.data)):
        for e in range(4):
            layer.weight_loader(name, t[e], e, "w13" if name.startswith("w13") else "w2")
    layer.process_weights_after_loading()
    return layer, prob


@robust(9, "error")
@pytest.mark.parametrize("what", ["logits_rows", "hidden_width", "hidden_dtype", "logits_columns"])
def test_layer_forward_errors_name_the_argument(what):
    layer, prob = _layer()
    x, logits = prob.x, torch.randn(T, 4)
    name = {"logits_rows": "router_logits", "hidden_width": "hidden_states", "hidden_dtype": "hidden_states",
            "logits_columns": "router_logits"}[what]  # fmt: skip
    if what == "logits_rows":
        logits = torch.randn(T + 2, 4)
    elif what == "hidden_width":
        x = torch.randn(T, 65, dtype=torch.bfloat16)
    elif what == "hidden_dtype":
        x = x.float()
    else:
        logits = torch.randn(T, 5)
    raises_clearly(lambda: layer(x, logits), name)


@robust(9, "error")
@pytest.mark.parametrize("what", ["expert_id", "param_name", "shard_id", "shape"])
def test_layer_loader_errors_name_the_argument(what):
    layer = FusedMoE(CFG, backend="cpu")
    args = dict(param_name="w13_weight", loaded=torch.randn(32, 64), expert_id=0, shard_id="w1")
    if what == "expert_id":
        args["expert_id"] = 4
    elif what == "param_name":
        args["param_name"] = "w13_weights"
    elif what == "shard_id":
        args["shard_id"] = "w4"
    else:
        args["loaded"] = torch.randn(31, 64)
    name = {"shape": "w13_weight (expert 0, shard w1)"}.get(what, what)
    raises_clearly(lambda: layer.weight_loader(**args), name)


@robust(9, "reference")
def test_a_topk_object_is_taken_as_routing():
    prob = problem("bf16")
    out = fused_moe(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights, CFG)
    equals_reference(out, prob.reference(), prob.scheme, CFG.dtype)
