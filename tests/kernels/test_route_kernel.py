"""The fused routing kernel (``fusedmoe.kernels.route``) against ``RouterConfig.route(fused=False)``.

Ids must be equal exactly. The kernel's softmax and sigmoid may round differently from
PyTorch's by an ulp or two, which could swap two choices that differ by less, so the
random logits are built (and checked in float64) to have no such near-ties: any two
choices the routing must order are equal (deliberate exact ties, which must resolve to
the lower id in both) or at least 1e-5 apart relatively. Weights agree within
``_rtol(E)``: the softmax denominator sums E terms in another order (error growing with
log2 E), plus a few ulps for exp, the divisions, the renormalizing sum and the scaling;
on the GPU exp is ex2.approx-based (2 ulp).

The eager launcher, the ``fusedmoe::route`` op and ``RouterConfig.route(fused=True)``
run in the same parametrize (STYLE.md point 3); ``out=`` buffers are poisoned first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from fusedmoe.env import FUSED_ROUTING as ENV_FUSED_ROUTING
from fusedmoe.errors import FusedMoEError
from fusedmoe.kernels import route as route_mod
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.route import MAX_EXPERTS, route_launch, router_args
from fusedmoe.metadata import TopK
from fusedmoe.routing import RouterConfig, route
from fusedmoe.testing import poison_

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

_NEAR = 1e-5  # relative gap below which two different choices count as a near-tie


def _rtol(e: int) -> float:
    return 2.0**-23 * (4 + 2 * math.log2(e))


@dataclass(frozen=True)
class Case:
    """A labelled routing problem: T tokens, the router (E, K and its settings), a bias or not."""

    label: str
    t: int
    router: RouterConfig
    bias: bool = False
    kw: dict = field(default_factory=dict)


def _r(e, k, **kw) -> RouterConfig:
    return RouterConfig(num_experts=e, top_k=k, **kw)


_DSV3 = dict(scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)
CASES = [
    Case("T0", 0, _r(8, 2, renormalize=True)),
    Case("T1", 1, _r(8, 2, renormalize=True)),
    Case("odd_T37", 37, _r(16, 4, scoring="sigmoid")),
    Case("prime_E7", 5, _r(7, 3)),
    Case("prime_E61_sigmoid_renorm", 9, _r(61, 6, scoring="sigmoid", renormalize=True)),
    Case("deepseek_v3", 17, _r(256, 8, **_DSV3), bias=True),
    Case("deepseek_v2_grouped_max", 5, _r(160, 6, num_expert_group=8, topk_group=3, routed_scaling_factor=16.0)),
    Case("qwen3_softmax_renorm", 11, _r(128, 8, renormalize=True)),
    Case("gpt_oss", 7, _r(32, 4, renormalize=True)),
    Case("mixtral", 6, _r(8, 2, renormalize=True)),
    Case("K1", 4, _r(16, 1)),
    Case("K1_renorm", 3, _r(16, 1, scoring="sigmoid", renormalize=True)),
    Case("K_eq_E", 3, _r(12, 12, scoring="sigmoid")),
    Case("sigmoid_bias_no_renorm", 6, _r(64, 6, scoring="sigmoid"), bias=True),
    Case("softmax_bias_scaled", 6, _r(24, 3, routed_scaling_factor=0.5), bias=True),
    Case("grouped_sigmoid_max", 9, _r(16, 4, scoring="sigmoid", num_expert_group=4, topk_group=2)),
    Case("grouped_K_max_bias", 7, _r(16, 8, num_expert_group=4, topk_group=2, renormalize=True), bias=True),
    Case("grouped_K_eq_E", 5, _r(6, 6, scoring="sigmoid", num_expert_group=3, topk_group=3), bias=True),
    Case("grouped_size1_prime", 6, _r(7, 2, scoring="sigmoid", num_expert_group=7, topk_group=3), bias=True),
    Case("E_max_1024", 3, _r(MAX_EXPERTS, 8, renormalize=True)),
]


def _scores64(logits: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    x = logits.double()
    return x.softmax(dim=1) if router.scoring == "softmax" else x.sigmoid()


def _near_ties(logits: torch.Tensor, bias: torch.Tensor | None, router: RouterConfig) -> bool:
    """Whether the float64 routing must order two choices (or groups) that are different but
    within ``_NEAR`` of each other: where the kernel and PyTorch could disagree on ids."""

    def near(sorted_vals: torch.Tensor) -> bool:
        a, b = sorted_vals[:, :-1], sorted_vals[:, 1:]
        gap = a - b
        ok = torch.isfinite(gap)
        rel = gap[ok] / a[ok].abs().clamp_min(1e-300)
        return bool(((gap[ok] > 0) & (rel < _NEAR)).any())

    choice = _scores64(logits, router)
    if bias is not None:
        choice = choice + bias.double()
    t, e = choice.shape
    if router.grouped:
        g, tg = router.num_expert_group, router.topk_group
        per = choice.view(t, g, e // g).sort(dim=-1, descending=True).values
        gs = per[..., : min(2, e // g)].sum(-1) if bias is not None else per[..., 0]
        order = gs.sort(dim=1, descending=True, stable=True)
        if tg < g and near(order.values[:, tg - 1 : tg + 1]):  # only the kept set matters
            return True
        keep = torch.zeros(t, g, dtype=torch.bool).scatter_(1, order.indices[:, :tg], True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))
    k = router.top_k
    return near(choice.sort(dim=1, descending=True).values[:, : min(k + 1, e)])


def _inputs(case: Case, dtype=torch.float32, seed: int = 0):
    """(logits [T, E] in ``dtype``, bias [E] or None) without near-ties (first good seed)."""
    e = case.router.num_experts
    for s in range(seed, seed + 50):
        g = torch.Generator().manual_seed(s)
        # a permutation of an evenly spaced grid per row: softmax scores of neighbours differ by
        # a factor exp(4 / E), sigmoid scores by >= 4 / E * 0.1; bf16/fp16 rounding makes exact ties
        grid = (torch.arange(e, dtype=torch.float64) - (e - 1) / 2) * (4.0 / e)
        perm = torch.stack([torch.randperm(e, generator=g) for _ in range(case.t)]) if case.t else None
        logits = (grid[perm] if case.t else torch.empty(0, e, dtype=torch.float64)) + 0.01 * s
        logits = logits.to(dtype)
        bias = (torch.rand(e, generator=g, dtype=torch.float64) * 0.2).float() if case.bias else None
        if not _near_ties(logits, bias, case.router):
            return logits.to(DEVICE), None if bias is None else bias.to(DEVICE)
    raise AssertionError(f"{case.label}: no seed without near-ties")


def _op(router: RouterConfig, logits, bias) -> TopK:
    ids, w = torch.ops.fusedmoe.route(
        logits,
        bias,
        router.top_k,
        router.scoring,
        router.renormalize,
        router.num_expert_group,
        router.topk_group,
        router.routed_scaling_factor,
    )
    return TopK(ids, w)


def _run(path: str, router: RouterConfig, logits, bias) -> TopK:
    if path == "route":  # eager: RouterConfig.route -> fused_route -> route_launch
        return router.route(logits, bias, fused=True)
    if path == "op":  # through the dispatcher, as a compiled graph calls it
        return _op(router, logits, bias)
    # the launcher into poisoned buffers, one row per program (the GPU's tiling)
    t, k = logits.shape[0], router.top_k
    out = TopK(
        poison_(torch.empty(t, k, dtype=torch.int32, device=logits.device)),
        poison_(torch.empty(t, k, dtype=torch.float32, device=logits.device)),
    )
    got = route_launch(logits, bias, **router_args(router), rows=1, out=out)
    assert got.ids is out.ids and got.weights is out.weights
    return got


def _check_valid(got: TopK, t: int, e: int, k: int) -> None:
    assert got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert got.ids.shape == (t, k) and got.weights.shape == (t, k)
    assert got.ids.is_contiguous() and got.weights.is_contiguous()
    ids = got.ids.long().cpu()
    assert bool(((ids >= 0) & (ids < e)).all()), "ids out of range"
    s = ids.sort(dim=1).values
    assert bool((s[:, 1:] != s[:, :-1]).all()), "ids repeat within a row"


def _compare(got: TopK, ref: TopK, e: int) -> None:
    _check_valid(got, *ref.ids.shape[:1], e, ref.ids.shape[1])
    assert torch.equal(got.ids, ref.ids)
    torch.testing.assert_close(got.weights, ref.weights, rtol=_rtol(e), atol=0)


_PATHS = [("float32", "launch_out_rows1"), ("float32", "op"), ("float32", "route")]
_PATHS += [("bfloat16", "route"), ("float16", "route")]


@needs_triton
@pytest.mark.parametrize("dtype,path", _PATHS, ids=[f"{d}-{p}" for d, p in _PATHS])
@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_fused_equals_reference(case, dtype, path):
    logits, bias = _inputs(case, getattr(torch, dtype))
    ref = case.router.route(logits, bias, fused=False)
    got = _run(path, case.router, logits, bias)
    _compare(got, ref, case.router.num_experts)


# ---------------------------------------------------------------- deliberate ties

_TIE_MODES = {
    "softmax": _r(16, 4),
    "sigmoid_renorm": _r(16, 4, scoring="sigmoid", renormalize=True),
    "grouped_max": _r(16, 4, num_expert_group=4, topk_group=2),
    "grouped_bias": _r(16, 4, scoring="sigmoid", num_expert_group=4, topk_group=2),
}


@needs_triton
@pytest.mark.parametrize("mode", _TIE_MODES)
def test_all_equal_logits_choose_the_lowest_ids(mode):
    router = _TIE_MODES[mode]
    bias = torch.full((16,), 0.25, device=DEVICE) if mode == "grouped_bias" else None
    logits = torch.full((3, 16), 0.7, device=DEVICE)
    got = router.route(logits, bias, fused=True)
    assert got.ids.tolist() == [[0, 1, 2, 3]] * 3
    _compare(got, router.route(logits, bias, fused=False), 16)


@needs_triton
@pytest.mark.parametrize("mode", _TIE_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_logits_lower_id_first(mode, dtype):
    """Few distinct logit values (many exact ties), as the reference's hypothesis test uses."""
    router = _TIE_MODES[mode]
    g = torch.Generator().manual_seed(5)
    logits = (torch.randint(-2, 3, (9, 16), generator=g) / 2).to(dtype).to(DEVICE)
    bias = (torch.randint(-1, 2, (16,), generator=g) / 4).to(DEVICE) if mode == "grouped_bias" else None
    _compare(router.route(logits, bias, fused=True), router.route(logits, bias, fused=False), 16)


@needs_triton
def test_partial_and_group_ties():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0, 5.0]], device=DEVICE)
    assert route(logits, 4, fused=True).ids.tolist() == [[1, 2, 4, 3]]
    logits = torch.tensor([[1.0, 0.0, 1.0, 0.0]], device=DEVICE)  # groups tie on max and on top-2 sum
    assert route(logits, 2, num_expert_group=2, topk_group=1, fused=True).ids.tolist() == [[0, 1]]
    out = route(
        logits,
        2,
        scoring="sigmoid",
        num_expert_group=2,
        topk_group=1,
        correction_bias=torch.zeros(4, device=DEVICE),
        fused=True,
    )
    assert out.ids.tolist() == [[0, 1]]


@needs_triton
def test_group_score_counts_a_repeated_maximum_twice():
    """Top-2 sum with the group's maximum reached twice: 0.9 + 0.9 beats 0.95 + 0.1."""
    p = [0.9, 0.9, 0.1, 0.95, 0.1, 0.0]
    logits = torch.tensor([[math.log(v / (1 - v)) if 0 < v < 1 else -20.0 for v in p]], device=DEVICE)
    router = _r(6, 2, scoring="sigmoid", num_expert_group=2, topk_group=1)
    bias = torch.zeros(6, device=DEVICE)
    got = router.route(logits, bias, fused=True)
    assert got.ids.tolist() == [[0, 1]]
    _compare(got, router.route(logits, bias, fused=False), 6)


# ---------------------------------------------------------------- NaN, inf


@needs_triton
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # numpy, under the interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("mode", ["softmax_renorm", "sigmoid", "grouped_bias", "grouped_max"])
def test_nan_and_inf_rows_give_valid_distinct_ids(mode):
    e, k = 16, 6
    router = {
        "softmax_renorm": _r(e, k, renormalize=True),
        "sigmoid": _r(e, k, scoring="sigmoid"),
        "grouped_bias": _r(e, k, scoring="sigmoid", num_expert_group=4, topk_group=2, renormalize=True),
        "grouped_max": _r(e, k, num_expert_group=4, topk_group=2),
    }[mode]
    bias = torch.linspace(0, 0.1, e, device=DEVICE) if mode == "grouped_bias" else None
    logits = _inputs(Case("nan", 8, router))[0]
    nan, inf = float("nan"), float("inf")
    logits[0] = nan  # all NaN
    logits[1, 3] = nan  # one NaN
    logits[2, ::2] = nan  # half NaN, in every group
    logits[3] = -inf  # softmax of all -inf is NaN
    logits[4, 5] = inf
    logits[5, :8] = inf
    for rows in (None, 1):
        got = route_launch(logits, bias, **router_args(router), rows=rows)
        _check_valid(got, 8, e, k)
        # rows 6 and 7 are finite: NaN elsewhere in the batch changes nothing there
        ref = router.route(logits[6:], bias, fused=False)
        assert torch.equal(got.ids[6:], ref.ids)
        torch.testing.assert_close(got.weights[6:], ref.weights, rtol=_rtol(e), atol=0)


@needs_triton
def test_float64_logits_and_strided_rows():
    """float64 logits are rounded to float32 first, as the reference does; a row stride
    that is not E (a column slice of a wider matrix) is read in place."""
    router = _r(32, 4, scoring="sigmoid", renormalize=True)
    logits, bias = _inputs(Case("f64", 6, router, bias=True))
    wide = torch.zeros(6, 40, dtype=torch.float64, device=DEVICE)
    wide[:, 3:35] = logits.double()
    view = wide[:, 3:35]
    assert view.stride(0) == 40
    ref = router.route(view, bias, fused=False)
    _compare(router.route(view, bias, fused=True), ref, 32)
    _compare(router.route(view.float(), bias.double(), fused=True), ref, 32)


# ---------------------------------------------------------------- the auto choice, errors


def test_auto_on_cpu_stays_in_pytorch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the fused kernel ran")

    monkeypatch.setattr(route_mod, "route_launch", boom)
    router = _r(8, 2, renormalize=True)
    logits = torch.randn(4, 8)
    assert torch.equal(router.route(logits).ids, router.route(logits, fused=False).ids)
    assert torch.equal(route(logits, 2).ids, router.route(logits, fused=False).ids)


def _custom(logits, k):
    w, i = logits.float().topk(k, dim=1)
    return w, i


@pytest.mark.parametrize(
    "label,router,logits,match",
    [
        ("E_too_large", _r(MAX_EXPERTS + 1, 2), torch.zeros(2, MAX_EXPERTS + 1), "num_experts <= 1024"),
        ("custom_fn", _r(8, 2, custom_fn=_custom), torch.zeros(2, 8), "custom_fn"),
        ("not_2d", _r(8, 2), torch.zeros(8), "router_logits"),
        ("wrong_E", _r(8, 2), torch.zeros(2, 9), "router_logits"),
        ("int_logits", _r(8, 2), torch.zeros(2, 8, dtype=torch.int32), "router_logits"),
    ],
)
def test_fused_true_errors_name_the_problem(label, router, logits, match):
    with pytest.raises(FusedMoEError, match=match):
        router.route(logits, fused=True)


def test_fused_true_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(FusedMoEError, match="CUDA"):
        _r(8, 2).route(torch.zeros(2, 8), fused=True)


def test_fused_must_be_a_bool_or_none():
    with pytest.raises(FusedMoEError, match="fused"):
        _r(8, 2).route(torch.zeros(2, 8), fused="yes")


@needs_triton
def test_launcher_errors():
    logits = torch.zeros(3, 8, device=DEVICE)
    kw = dict(top_k=2)
    with pytest.raises(FusedMoEError, match="logits"):
        route_launch(torch.zeros(3, 8, 2, device=DEVICE), None, **kw)
    with pytest.raises(FusedMoEError, match="correction_bias"):
        route_launch(logits, torch.zeros(7, device=DEVICE), **kw)
    with pytest.raises(FusedMoEError, match="num_expert_group"):
        route_launch(logits, None, num_expert_group=3, topk_group=1, **kw)
    with pytest.raises(FusedMoEError, match="rows"):
        route_launch(logits, None, rows=3, **kw)
    bad = TopK(torch.empty(3, 2, dtype=torch.int64, device=DEVICE), torch.empty(3, 2, device=DEVICE))
    with pytest.raises(FusedMoEError, match="out.ids"):
        route_launch(logits, None, out=bad, **kw)


# ---------------------------------------------------------------- torch.library, compile


@needs_triton
def test_opcheck():
    case = CASES[5]  # DeepSeek-V3: grouped, bias, renormalize, scaling
    logits, bias = _inputs(Case("opcheck", 3, case.router, bias=True))
    r = case.router
    args = (logits, bias, r.top_k, r.scoring, r.renormalize, r.num_expert_group, r.topk_group, r.routed_scaling_factor)
    torch.library.opcheck(torch.ops.fusedmoe.route.default, args)


@needs_triton
@pytest.mark.parametrize("fused", [True, None])
def test_compiles_without_graph_break(fused, monkeypatch):
    """torch.compile(fullgraph=True): fused=True records the op (one node); fused=None records
    the PyTorch reference on the CPU and the op on a GPU. Eager mode never goes through the
    dispatcher."""
    calls = []
    real = route_mod.route_launch

    def counting(*a, **k):
        calls.append(torch.compiler.is_compiling())
        return real(*a, **k)

    monkeypatch.setattr(route_mod, "route_launch", counting)
    torch._dynamo.reset()
    router = _r(16, 4, scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2)
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x, b: router.route(x, b, fused=fused), fullgraph=True, backend=counter)
    for t in (5, 9):
        logits, bias = _inputs(Case("compile", t, router, bias=True))
        got = f(logits, bias)
        _compare(got, router.route(logits, bias, fused=False), 16)
    assert counter.frame_count >= 1
    nodes = [n.target for gm in counter.graphs for n in gm.graph.nodes]
    op = torch.ops.fusedmoe.route
    assert any(n in (op, op.default) for n in nodes) == (HAS_CUDA if fused is None else fused)
    if fused:
        calls.clear()
        eager = router.route(logits, bias, fused=True)
        assert calls == [False], "eager mode must call the launcher directly"
        _compare(eager, got, 16)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 7, 64, 300])
@pytest.mark.parametrize("label", ["deepseek_v3", "qwen3_softmax_renorm", "gpt_oss", "mixtral", "E_max_1024"])
def test_gpu_real_shapes(label, t):
    case = next(c for c in CASES if c.label == label)
    case = Case(case.label, t, case.router, case.bias)
    for dtype in (torch.bfloat16, torch.float32):
        logits, bias = _inputs(case, dtype)
        ref = case.router.route(logits, bias, fused=False)
        _compare(case.router.route(logits, bias, fused=True), ref, case.router.num_experts)


@pytest.mark.gpu
@needs_cuda
def test_gpu_auto_uses_the_kernel_unless_disabled(monkeypatch):
    calls = []
    real = route_mod.route_launch
    monkeypatch.setattr(route_mod, "route_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    router = _r(256, 8, **_DSV3)
    logits, bias = _inputs(Case("auto", 4, router, bias=True))
    router.route(logits, bias)
    assert calls == [1]
    monkeypatch.setenv(ENV_FUSED_ROUTING, "0")
    router.route(logits, bias)
    assert calls == [1]


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay():
    router = _r(256, 8, **_DSV3)
    logits, bias = _inputs(Case("graph", 8, router, bias=True), torch.bfloat16)
    static = logits.clone()
    router.route(static, bias, fused=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router.route(static, bias, fused=True)
    new, _ = _inputs(Case("graph", 8, router, bias=True), torch.bfloat16, seed=7)
    static.copy_(new)
    graph.replay()
    _compare(out, router.route(new, bias, fused=False), 256)
