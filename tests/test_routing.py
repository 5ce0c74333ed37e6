"""fusedmoe.routing: hand-computed tiny cases per mode, ties, invariants, validation.

Ids are compared exactly; weights to float32 rounding (1e-6 relative).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedmoe.env import CHECK_VALUES as ENV_CHECK_VALUES
from fusedmoe.errors import FusedMoEError
from fusedmoe.routing import RouterConfig, route
from fusedmoe.testing import EDGE_CASES, Case


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _ids(topk) -> list[list[int]]:
    return topk.ids.tolist()


def _close(w: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- hand-computed


def test_softmax_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    z = sum(math.exp(v) for v in (0, 1, 2, 3))
    out = route(logits, 2)
    assert _ids(out) == [[1, 2]]
    _close(out.weights, [[math.exp(3) / z, math.exp(2) / z]])
    out = route(logits, 2, renormalize=True)
    assert _ids(out) == [[1, 2]]
    e = math.e
    _close(out.weights, [[e / (e + 1), 1 / (e + 1)]])


def test_sigmoid_renormalize_and_scaling_by_hand():
    logits = torch.tensor([[0.0, math.log(3), -math.log(3), -math.log(9)]])  # 0.5, 0.75, 0.25, 0.1
    out = route(logits, 2, scoring="sigmoid")
    assert _ids(out) == [[1, 0]]
    _close(out.weights, [[0.75, 0.5]])
    out = route(logits, 2, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5)
    assert _ids(out) == [[1, 0]]
    _close(out.weights, [[1.5, 1.0]])  # (0.6, 0.4) * 2.5: scaling after renormalization


def test_correction_bias_chooses_but_does_not_weigh_by_hand():
    logits = torch.tensor([[0.0, math.log(3), -math.log(3), -math.log(9)]])  # 0.5, 0.75, 0.25, 0.1
    bias = torch.tensor([0.0, 0.0, 0.6, 0.0])  # choice: 0.5, 0.75, 0.85, 0.1
    out = route(logits, 2, scoring="sigmoid", correction_bias=bias)
    assert _ids(out) == [[2, 1]]
    _close(out.weights, [[0.25, 0.75]])


# scores of 4 groups of 2:      group max  top-2 sum
#   g0: 0.9  0.1                  0.9        1.0
#   g1: 0.6  0.6                  0.6        1.2
#   g2: 0.8  0.05                 0.8        0.85
#   g3: 0.7  0.45                 0.7        1.15
_GROUP_SCORES = [0.9, 0.1, 0.6, 0.6, 0.8, 0.05, 0.7, 0.45]
_GROUP_LOGITS = torch.tensor([[_logit(p) for p in _GROUP_SCORES]])
_GROUPED = dict(scoring="sigmoid", num_expert_group=4, topk_group=2)


def test_grouped_topk_by_hand():
    # no grouping: the 3 best experts anywhere
    assert _ids(route(_GROUP_LOGITS, 3, scoring="sigmoid")) == [[0, 4, 6]]
    # no bias: group score = max -> keep g0, g2 -> experts 0, 4, then 1 (0.1) beats 5 (0.05)
    out = route(_GROUP_LOGITS, 3, **_GROUPED)
    assert _ids(out) == [[0, 4, 1]]
    _close(out.weights, [[0.9, 0.8, 0.1]])
    # with a (zero) bias: group score = top-2 sum -> keep g1, g3 -> 6 (0.7), then tied 2, 3 (0.6)
    out = route(_GROUP_LOGITS, 3, correction_bias=torch.zeros(8), **_GROUPED)
    assert _ids(out) == [[6, 2, 3]]
    _close(out.weights, [[0.7, 0.6, 0.6]])


def test_grouped_topk_softmax_max_by_hand():
    """DeepSeek-V2 group_limited_greedy: softmax, group max, one group kept."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 1.5]])  # groups (0, 1), (2, 3): maxima 2.0 > 1.5
    out = route(logits, 2, num_expert_group=2, topk_group=1)
    assert _ids(out) == [[1, 0]]
    z = sum(math.exp(v) for v in (0.0, 2.0, 1.0, 1.5))
    _close(out.weights, [[math.exp(2.0) / z, 1 / z]])
    assert _ids(route(logits, 2)) == [[1, 3]]


def test_gpt_oss_routing_is_softmax_renormalize():
    """gpt-oss: top-k of the logits, then softmax over those k."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 32, generator=g)
    out = route(logits, 4, renormalize=True)
    top = torch.sort(logits, dim=1, descending=True)
    assert torch.equal(out.ids, top.indices[:, :4].to(torch.int32))
    torch.testing.assert_close(out.weights, top.values[:, :4].softmax(dim=1), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------- ties

_TIE_MODES = {
    "softmax": dict(),
    "sigmoid_renorm": dict(scoring="sigmoid", renormalize=True),
    "grouped_max": dict(num_expert_group=4, topk_group=2),
    "grouped_bias": dict(scoring="sigmoid", num_expert_group=4, topk_group=2, correction_bias=True),
}


@pytest.mark.parametrize("mode", _TIE_MODES)
@pytest.mark.parametrize("e,k", [(8, 1), (8, 2), (8, 4), (16, 8), (256, 8)])
def test_all_equal_logits_choose_the_lowest_ids(mode, e, k):
    kw = dict(_TIE_MODES[mode])
    if kw.pop("correction_bias", False):
        kw["correction_bias"] = torch.full((e,), 0.25)
    out = route(torch.full((3, e), 0.7), k, **kw)
    assert _ids(out) == [list(range(k))] * 3


@pytest.mark.parametrize("e", [7, 13, 300])
def test_all_equal_prime_and_large_e(e):
    out = route(torch.zeros(2, e, dtype=torch.bfloat16), e if e < 20 else 9)
    assert _ids(out) == [list(range(out.top_k))] * 2


def test_partial_ties_lower_id_first():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0, 5.0]])
    assert _ids(route(logits, 2)) == [[1, 2]]
    assert _ids(route(logits, 4)) == [[1, 2, 4, 3]]


def test_group_ties_lower_group_first():
    logits = torch.tensor([[1.0, 0.0, 1.0, 0.0]])  # groups (0, 1) and (2, 3) tie on max and on sum
    assert _ids(route(logits, 2, num_expert_group=2, topk_group=1)) == [[0, 1]]
    out = route(
        logits,
        2,
        scoring="sigmoid",
        num_expert_group=2,
        topk_group=1,
        correction_bias=torch.zeros(4),
    )
    assert _ids(out) == [[0, 1]]
    assert _ids(route(logits, 2)) == [[0, 2]]


def _spec_ids(choice: torch.Tensor, k: int, groups: int | None, topk_group: int | None, two_best: bool):
    """The documented choice, by brute force: sort keys (-value, id), per row."""
    e = choice.shape[1]
    rows = []
    for row in choice:
        allowed = list(range(e))
        if groups is not None:
            size = e // groups
            scores = []
            for gi in range(groups):
                vals = sorted(row[gi * size : (gi + 1) * size].tolist(), reverse=True)
                if two_best and size >= 2:  # float32 addition, as the router does it
                    s = (torch.tensor(vals[0], dtype=torch.float32) + torch.tensor(vals[1])).item()
                else:
                    s = vals[0]
                scores.append((-s, gi))
            kept = {gi for _, gi in sorted(scores)[:topk_group]}
            allowed = [x for x in allowed if x // size in kept]
        rows.append(sorted(allowed, key=lambda x: (-row[x].item(), x))[:k])
    return rows


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    groups=st.sampled_from([None, 1, 2, 4]),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    biased=st.booleans(),
)
def test_choice_matches_the_documented_order(data, groups, scoring, biased):
    """Small integer logits (many ties): ids = sort by (-choice, id) within the kept groups."""
    e = 8
    t = data.draw(st.integers(1, 5))
    vals = data.draw(st.lists(st.integers(-2, 2), min_size=t * e, max_size=t * e))
    logits = torch.tensor(vals, dtype=torch.float32).reshape(t, e) / 2
    tg = None if groups is None else data.draw(st.integers(1, groups))
    kmax = e if groups is None else tg * (e // groups)
    k = data.draw(st.integers(1, kmax))
    bias = None
    if biased:
        bvals = data.draw(st.lists(st.integers(-1, 1), min_size=e, max_size=e))
        bias = torch.tensor(bvals, dtype=torch.float32) / 4
    out = route(logits, k, scoring=scoring, correction_bias=bias, num_expert_group=groups, topk_group=tg)
    scores = logits.softmax(dim=1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    assert _ids(out) == _spec_ids(choice, k, groups, tg, two_best=bias is not None)
    assert torch.equal(out.weights, scores.gather(1, out.ids.long()))


# ------------------------------------------------------------------- invariants

_MODES = {
    "softmax": dict(),
    "softmax_renorm": dict(renormalize=True),
    "sigmoid_renorm_scaled": dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5),
    "sigmoid_bias": dict(scoring="sigmoid", correction_bias=True),
}

# grouped shapes (Case: label, T, E, K); their (groups, topk_group) in _GROUPING
_GROUP_CASES = [
    Case("grouped_8e_4g", 9, 8, 2, 64, 32),
    Case("grouped_K_max", 7, 16, 8, 64, 32),  # K = topk_group * E/groups (2 * 4)
    Case("grouped_K_eq_E", 5, 6, 6, 64, 32),
    Case("grouped_size1_prime", 11, 7, 1, 64, 32),
    Case("grouped_T0", 0, 8, 2, 64, 32),
]
_GROUPING = {
    "grouped_8e_4g": (4, 2),
    "grouped_K_max": (4, 2),
    "grouped_K_eq_E": (3, 3),
    "grouped_size1_prime": (7, 1),
    "grouped_T0": (4, 2),
}


def _check(out, logits, k, kw, bias, groups=None, topk_group=None):
    t, e = logits.shape
    assert out.ids.dtype == torch.int32 and out.weights.dtype == torch.float32
    assert out.ids.shape == (t, k) and out.weights.shape == (t, k)
    assert out.ids.is_contiguous() and out.weights.is_contiguous()
    ids = out.ids.long()
    assert bool(((ids >= 0) & (ids < e)).all())
    s = ids.sort(dim=1).values
    assert bool((s[:, 1:] != s[:, :-1]).all()), "ids repeat within a row"
    assert bool((out.weights >= 0).all())
    scoring = kw.get("scoring", "softmax")
    scores = logits.float().softmax(dim=1) if scoring == "softmax" else logits.float().sigmoid()
    w = scores.gather(1, ids)  # the weights are the unbiased scores, bias or not
    scale = kw.get("routed_scaling_factor", 1.0)
    if kw.get("renormalize"):
        torch.testing.assert_close(out.weights.sum(dim=1), torch.full((t,), scale), rtol=1e-6, atol=0)
        w = w / w.sum(dim=1, keepdim=True)
    torch.testing.assert_close(out.weights, w * scale, rtol=1e-6, atol=0)
    choice = scores if bias is None else scores + bias
    if groups is not None:
        size = e // groups
        for row in ids // size:
            assert len(set(row.tolist())) <= topk_group
    else:  # every chosen expert beats every other one
        chosen = choice.gather(1, ids)
        others = choice.scatter(1, ids, float("-inf"))
        if t and k < e:
            assert bool((chosen.min(dim=1).values >= others.max(dim=1).values).all())
    if t:  # listed by decreasing choice
        chosen = choice.gather(1, ids)
        assert bool((chosen[:, 1:] <= chosen[:, :-1]).all())


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: c.label)
def test_invariants(case, mode):
    g = torch.Generator().manual_seed(case.t * 31 + case.e)
    logits = torch.randn(case.t, case.e, generator=g) * 2
    kw = dict(_MODES[mode])
    bias = None
    if kw.pop("correction_bias", False):
        bias = torch.randn(case.e, generator=g) * 0.2
    out = route(logits, case.k, correction_bias=bias, **kw)
    _check(out, logits, case.k, kw, bias)


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("case", _GROUP_CASES, ids=lambda c: c.label)
def test_grouped_invariants(case, mode):
    groups, tg = _GROUPING[case.label]
    g = torch.Generator().manual_seed(case.t * 31 + case.e)
    logits = torch.randn(case.t, case.e, generator=g) * 2
    kw = dict(_MODES[mode])
    bias = None
    if kw.pop("correction_bias", False):
        bias = torch.randn(case.e, generator=g) * 0.2
    out = route(logits, case.k, correction_bias=bias, num_expert_group=groups, topk_group=tg, **kw)
    _check(out, logits, case.k, kw, bias, groups, tg)


def test_bias_changes_choice_not_weights():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 8, generator=g)
    bias = torch.zeros(8)
    bias[7] = 10.0
    plain = route(logits, 2, scoring="sigmoid")
    biased = route(logits, 2, scoring="sigmoid", correction_bias=bias)
    assert bool((biased.ids[:, 0] == 7).all())  # the bias decides the choice...
    assert not torch.equal(plain.ids, biased.ids)
    assert bool((biased.weights < 1).all())  # ...but weights stay sigmoid scores (bias 10 not added)
    torch.testing.assert_close(biased.weights, logits.sigmoid().gather(1, biased.ids.long()))


def test_renormalize_underflow_gives_zeros_not_nan():
    out = route(torch.full((2, 4), -200.0), 2, scoring="sigmoid", renormalize=True)
    assert torch.equal(out.weights, torch.zeros(2, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_computes_in_float32(dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(16, 12, generator=g) * 3).to(dtype)
    for kw in ({}, {"scoring": "sigmoid", "renormalize": True}):
        a, b = route(logits, 3, **kw), route(logits.float(), 3, **kw)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)


def test_route_equals_router_config():
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(10, 8, generator=g), torch.randn(8, generator=g) * 0.1
    kw = dict(
        scoring="sigmoid",
        renormalize=True,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    a = route(logits, 2, correction_bias=bias, **kw)
    b = RouterConfig(num_experts=8, top_k=2, **kw).route(logits, bias)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)


# -------------------------------------------------------------------- custom_fn


def llama4_routing(logits: torch.Tensor, top_k: int):
    """Llama-4 style: top-k of the logits, sigmoid of those."""
    vals, ids = torch.topk(logits, top_k, dim=1)
    return torch.sigmoid(vals.float()), ids


def test_custom_fn_is_used():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 8, generator=g)
    out = route(logits, 1, custom_fn=llama4_routing)
    w, ids = llama4_routing(logits, 1)
    assert out.ids.dtype == torch.int32 and torch.equal(out.ids, ids.to(torch.int32))
    assert torch.equal(out.weights, w)
    assert route(logits[:0], 1, custom_fn=llama4_routing).ids.shape == (0, 1)


_BAD_CUSTOM = {
    "not_a_tuple": (lambda lg, k: lg[:, :k], "custom_fn"),
    "weights_shape": (
        lambda lg, k: (lg[:, : k + 1], torch.zeros_like(lg[:, :k], dtype=torch.long)),
        "custom_fn weights",
    ),
    "weights_int": (
        lambda lg, k: (torch.zeros_like(lg[:, :k], dtype=torch.long),) * 2,
        "custom_fn weights",
    ),
    "ids_float": (lambda lg, k: (lg[:, :k], lg[:, :k]), "custom_fn ids"),
    "ids_out_of_range": (
        lambda lg, k: (lg[:, :k], torch.full_like(lg[:, :k], lg.shape[1], dtype=torch.long)),
        "custom_fn ids",
    ),
    "ids_negative": (
        lambda lg, k: (lg[:, :k], -torch.ones_like(lg[:, :k], dtype=torch.long)),
        "custom_fn ids",
    ),
    "ids_repeat": (
        lambda lg, k: (lg[:, :k], torch.zeros_like(lg[:, :k], dtype=torch.long)),
        "custom_fn ids",
    ),
    "weights_nan": (
        lambda lg, k: (torch.full_like(lg[:, :k], float("nan")), torch.topk(lg, k).indices),
        "custom_fn weights",
    ),
}


# What only value checks see (they read the data: a host sync, so off by default).
_BAD_VALUES = ("ids_out_of_range", "ids_negative", "ids_repeat", "weights_nan")


@pytest.mark.parametrize("label", _BAD_CUSTOM)
def test_custom_fn_result_is_checked(label, monkeypatch):
    fn, field = _BAD_CUSTOM[label]
    raises = pytest.raises(FusedMoEError, match=re.escape(field) + ": expected")
    if label in _BAD_VALUES:
        route(torch.randn(4, 8), 2, custom_fn=fn)  # shape and dtype are fine: not checked by default
        with raises:
            route(torch.randn(4, 8), 2, custom_fn=fn, check_values=True)
        monkeypatch.setenv(ENV_CHECK_VALUES, "1")
    with raises:
        RouterConfig(num_experts=8, top_k=2, custom_fn=fn).route(torch.randn(4, 8))


# ------------------------------------------------------------------- validation

_BAD_CONFIGS = [
    ("top_k_zero", dict(top_k=0), "RouterConfig.top_k"),
    ("top_k_gt_E", dict(top_k=9), "RouterConfig.top_k"),
    ("top_k_float", dict(top_k=2.0), "RouterConfig.top_k"),
    ("num_experts_zero", dict(num_experts=0, top_k=1), "RouterConfig.num_experts"),
    ("scoring", dict(scoring="relu"), "RouterConfig.scoring"),
    ("renormalize_int", dict(renormalize=1), "RouterConfig.renormalize"),
    ("group_alone", dict(num_expert_group=4), "RouterConfig.num_expert_group/topk_group"),
    ("topk_group_alone", dict(topk_group=2), "RouterConfig.num_expert_group/topk_group"),
    ("groups_not_divisor", dict(num_expert_group=3, topk_group=1), "RouterConfig.num_expert_group"),
    ("groups_zero", dict(num_expert_group=0, topk_group=1), "RouterConfig.num_expert_group"),
    ("topk_group_gt_groups", dict(num_expert_group=4, topk_group=5), "RouterConfig.topk_group"),
    ("topk_group_zero", dict(num_expert_group=4, topk_group=0), "RouterConfig.topk_group"),
    ("top_k_gt_kept", dict(top_k=3, num_expert_group=4, topk_group=1), "RouterConfig.top_k"),
    ("scaling_zero", dict(routed_scaling_factor=0.0), "RouterConfig.routed_scaling_factor"),
    ("scaling_nan", dict(routed_scaling_factor=float("nan")), "RouterConfig.routed_scaling_factor"),
    ("scaling_str", dict(routed_scaling_factor="2.5"), "RouterConfig.routed_scaling_factor"),
    ("custom_not_callable", dict(custom_fn="topk"), "RouterConfig.custom_fn"),
    (
        "custom_without_renorm",
        dict(custom_fn=llama4_routing, renormalize=False),
        "RouterConfig.custom_fn",
    ),
    (
        "custom_with_groups",
        dict(custom_fn=llama4_routing, num_expert_group=2, topk_group=1),
        "RouterConfig.custom_fn",
    ),
    ("softcap_zero", dict(logit_softcap=0.0), "RouterConfig.logit_softcap"),
    ("softcap_inf", dict(logit_softcap=float("inf")), "RouterConfig.logit_softcap"),
    ("bias_on_logits_int", dict(bias_on_logits=1), "RouterConfig.bias_on_logits"),
    ("group_score_name", dict(num_expert_group=4, topk_group=2, group_score="sum"), "RouterConfig.group_score"),
    ("group_score_alone", dict(group_score="max"), "RouterConfig.group_score"),
    ("sparsemixer_top3", dict(scoring="sparsemixer", top_k=3), "RouterConfig.top_k"),
    ("sparsemixer_renorm", dict(scoring="sparsemixer", renormalize=True), "RouterConfig.scoring"),
    ("sparsemixer_eps", dict(sparsemixer_eps=-0.1), "RouterConfig.sparsemixer_eps"),
    ("custom_with_softcap", dict(custom_fn=llama4_routing, logit_softcap=5.0), "RouterConfig.custom_fn"),
]


@pytest.mark.parametrize("label,kw,field", _BAD_CONFIGS, ids=[c[0] for c in _BAD_CONFIGS])
def test_config_errors_name_the_field(label, kw, field):
    args = {"num_experts": 8, "top_k": 2, **kw}
    with pytest.raises(FusedMoEError, match=re.escape(field) + ": expected"):
        RouterConfig(**args)


def test_route_errors_name_the_argument():
    cfg = RouterConfig(num_experts=8, top_k=2)
    cases = [
        (lambda: route(torch.randn(8), 2), "router_logits"),
        (lambda: route(torch.ones(4, 8, dtype=torch.int64), 2), "router_logits"),
        (lambda: cfg.route(torch.randn(4, 6)), "router_logits"),
        (lambda: cfg.route(torch.randn(4, 8), torch.zeros(6)), "correction_bias"),
        (
            lambda: cfg.route(torch.randn(4, 8), torch.zeros(8, dtype=torch.int64)),
            "correction_bias",
        ),
        (
            lambda: route(torch.randn(4, 8), 1, custom_fn=llama4_routing, correction_bias=torch.zeros(8)),
            "correction_bias",
        ),
        (lambda: route(torch.randn(4, 8), 9), "RouterConfig.top_k"),
    ]
    for call, field in cases:
        with pytest.raises(FusedMoEError, match="^" + re.escape(field) + ": expected"):
            call()


@pytest.mark.parametrize(
    "cfg",
    [
        RouterConfig(num_experts=8, top_k=2),
        RouterConfig(
            num_experts=256,
            top_k=8,
            scoring="sigmoid",
            renormalize=True,
            num_expert_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
        ),
        RouterConfig(num_experts=16, top_k=1, custom_fn=llama4_routing),
        RouterConfig(num_experts=8, top_k=2, scoring="sigmoid", logit_softcap=30.0, bias_on_logits=True),
        RouterConfig(num_experts=8, top_k=2, scoring="sparsemixer", sparsemixer_eps=0.02),
        RouterConfig(num_experts=8, top_k=2, num_expert_group=4, topk_group=2, group_score="top2_sum"),
    ],
    ids=["plain", "deepseek_v3", "custom", "softcap_bias_on_logits", "sparsemixer", "group_score"],
)
def test_repr_evaluates_back(cfg):
    assert eval(repr(cfg), {"RouterConfig": RouterConfig, "llama4_routing": llama4_routing}) == cfg
    assert RouterConfig(num_experts=4, top_k=1, routed_scaling_factor=2).routed_scaling_factor == 2.0


# ------------------------------------------------ soft-cap, bias on logits, group score, sparsemixer


def test_logit_softcap_routes_the_capped_logits():
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)) * 20
    cfg = RouterConfig(8, 2, scoring="sigmoid", renormalize=True, logit_softcap=5.0)
    got = cfg.route(logits)
    want = RouterConfig(8, 2, scoring="sigmoid", renormalize=True).route(torch.tanh(logits / 5.0) * 5.0)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=0)


def test_bias_on_logits_chooses_by_logits_and_weighs_by_scores_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 1.5, 0.0])  # logits + bias: 2, 1, 1.5, -1 -> experts 0 and 2
    out = RouterConfig(4, 2, scoring="sigmoid", bias_on_logits=True, renormalize=False).route(logits, bias)
    assert _ids(out) == [[0, 2]]
    _close(out.weights, [[1 / (1 + math.exp(-2.0)), 0.5]])
    # on the scores instead: sigmoid + bias = 0.88, 0.73, 2.0, 0.27 -> experts 2 and 0
    assert _ids(RouterConfig(4, 2, scoring="sigmoid").route(logits, bias)) == [[2, 0]]


def test_group_score_top2_sum_without_a_bias_by_hand():
    # groups {0,1}, {2,3}: best-of-group 0.9 vs 0.6, two-best sums 1.0 vs 1.2
    probs = torch.tensor([[0.9, 0.1, 0.6, 0.6]])
    logits = torch.logit(probs)
    grouped = dict(num_expert_group=2, topk_group=1, scoring="sigmoid")
    assert _ids(RouterConfig(4, 2, **grouped).route(logits)) == [[0, 1]]  # default without a bias: max
    assert _ids(RouterConfig(4, 2, **grouped, group_score="top2_sum").route(logits)) == [[2, 3]]
    bias = torch.zeros(4)
    assert _ids(RouterConfig(4, 2, **grouped, group_score="max").route(logits, bias)) == [[0, 1]]


def test_sparsemixer_by_hand():
    logits = torch.tensor([[4.0, 3.99, 1.0, 3.0]])
    # eps 0.01: expert 0 with the logits within 2% of 4 ((4 - l) / max(|l|, 4) <= 0.02): 0 and 1;
    # then expert 1 (best of the rest) with those within 2% of 3.99 among 1, 2, 3: only 1 itself
    out = RouterConfig(4, 2, scoring="sparsemixer", sparsemixer_eps=0.01).route(logits)
    assert _ids(out) == [[0, 1]]
    e = math.exp(-0.01)
    _close(out.weights, [[1 / (1 + e), 1.0]])
    wide = RouterConfig(4, 2, scoring="sparsemixer", sparsemixer_eps=10.0).route(logits)
    first = torch.softmax(logits, dim=-1)[0, 0]
    second = torch.softmax(logits[:, 1:], dim=-1)[0, 0]
    _close(wide.weights, [[float(first), float(second)]])


@pytest.mark.parametrize(
    "kw",
    [
        dict(logit_softcap=5.0),
        dict(bias_on_logits=True, scoring="sigmoid"),
        dict(scoring="sparsemixer"),
        dict(num_expert_group=4, topk_group=2, group_score="max"),
    ],
    ids=["softcap", "bias_on_logits", "sparsemixer", "group_score"],
)
def test_the_fused_kernel_refuses_what_only_pytorch_computes(kw):
    cfg = RouterConfig(8, 2, **kw)
    with pytest.raises(FusedMoEError, match=r"route\(fused=True\)"):
        cfg.route(torch.randn(4, 8), fused=True)
