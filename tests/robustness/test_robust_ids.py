"""Class 1: expert ids outside [0, E) (and expert-map entries outside [0, E_local)), from every
source, on every CPU backend and the Triton kernels under the interpreter.

The documented meaning (``fusedmoe.metadata.TopK``): such a (token, k) pair contributes
nothing and its weight is dropped; with value checks on, ids other than -1 raise. Before the
fix each backend did something else (dropped, IndexError, NaN or 1e28 from an out-of-bounds
read of the Triton path, a -1 sent to the last rank by all2all).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from robust_helpers import CFG, T, dropped_reference, equals_reference, problem, raises_clearly, robust

from fusedmoe import FusedMoE, RouterConfig, fused_moe
from fusedmoe.env import CHECK_VALUES
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.align import moe_align_launch, moe_align_ref
from fusedmoe.kernels.moe_sum import moe_sum_launch, moe_sum_ref
from fusedmoe.quant import QTensor
from fusedmoe.testing import poison_

E = CFG.num_experts


def _ids(pattern: str, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.clone()
    if pattern == "minus_one":
        ids[0, 1] = -1
    elif pattern == "eq_E":
        ids[1, 0] = E
    elif pattern == "far_above":
        ids[2, 1] = E + 100
    elif pattern == "far_below":
        ids[0, 0] = -7
    elif pattern == "int64_wraps":  # 2^32 + 1 is the valid id 1 after a plain int32 cast
        ids = ids.long()
        ids[1, 1] = 2**32 + 1
    elif pattern == "row_all_invalid":
        ids[3, :] = -1
    elif pattern == "all_invalid":
        ids[:] = torch.tensor([-1, E])
    return ids


PATTERNS = ("minus_one", "eq_E", "far_above", "far_below", "int64_wraps", "row_all_invalid", "all_invalid")
# schemes without a per-tensor dynamic activation scale: there a dropped pair and a pair of
# weight 0 differ (the 0-weight pair's row still enters the abs-max), so the reference would too
SCHEMES = ("bf16", "fp8_token", "fp8_block", "int4_g32", "mxfp4")

CASES = [(b, s, p) for b in ("reference", "cpu") for s in SCHEMES for p in PATTERNS]
CASES += [(b, "bf16", p) for b in ("loop", "grouped_mm") for p in PATTERNS]
if interpreting():
    CASES += [("triton", "bf16", p) for p in PATTERNS]
    CASES += [("triton", s, p) for s in ("fp8_block", "int4_g32") for p in ("eq_E", "int64_wraps")]


@robust(1, "reference")
@pytest.mark.parametrize("backend,scheme,pattern", CASES)
def test_pairs_outside_the_experts_contribute_nothing(backend, scheme, pattern):
    prob = problem(scheme)
    ids = _ids(pattern, prob.topk_ids)
    out = fused_moe(prob.x, (ids, prob.topk_weights), prob.weights, CFG, prob.scheme, backend=backend)
    ref = dropped_reference(prob, ids, prob.topk_weights)
    equals_reference(out, ref, prob.scheme, CFG.dtype)


# Expert maps of a rank holding 2 of the 4 experts: -1 (another rank's) and entries >= E_local
MAPS = {"minus_one_and_too_big": [0, -1, 1, 5], "negative_and_huge": [-3, 0, 1, 2**20]}
MAP_BACKENDS = ["reference", "cpu", "grouped_mm"] + (["triton"] if interpreting() else [])


@robust(1, "reference")
@pytest.mark.parametrize("backend", MAP_BACKENDS)
@pytest.mark.parametrize("emap", MAPS)
def test_expert_map_entries_outside_the_local_experts_contribute_nothing(backend, emap):
    full = problem("bf16")
    emap_t = torch.tensor(MAPS[emap], dtype=torch.int32)
    local_ids = [g for g, m in enumerate(MAPS[emap]) if 0 <= m < 2]
    weights = _local_weights(full.weights, local_ids, MAPS[emap])
    ids = _ids("eq_E", full.topk_ids)
    full.weights, full.expert_map = weights, emap_t
    out = fused_moe(full.x, (ids, full.topk_weights), weights, CFG, full.scheme, backend=backend, expert_map=emap_t)
    equals_reference(out, dropped_reference(full, ids, full.topk_weights, emap_t, 2), full.scheme, CFG.dtype)


def _local_weights(w, global_ids, emap):
    """The 2 local experts' weights in local-id order (local id m holds global expert g)."""
    order = sorted(global_ids, key=lambda g: emap[g])

    def pick(q):
        return QTensor(q.data[order], (len(order), *q.shape[1:]))

    return replace(w, w13=pick(w.w13), w2=pick(w.w2))


BATCHED = ["reference_batched"] + (["triton_batched"] if interpreting() else [])


@robust(1, "reference")
@pytest.mark.parametrize("backend", BATCHED)
@pytest.mark.parametrize("pattern", ("far_above", "int64_wraps", "all_invalid"))
def test_batched_dispatcher_drops_pairs_outside_the_experts(backend, pattern):
    prob = problem("bf16")
    ids = _ids(pattern, prob.topk_ids)
    out = fused_moe(
        prob.x, (ids, prob.topk_weights), prob.weights, CFG, prob.scheme, backend=backend, dispatcher="local_batched"
    )
    equals_reference(out, dropped_reference(prob, ids, prob.topk_weights), prob.scheme, CFG.dtype)


@robust(1, "error")
@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_value_checks_refuse_ids_outside_the_experts(monkeypatch, value):
    monkeypatch.setenv(CHECK_VALUES, value)
    prob = problem("bf16")
    ids = _ids("far_above", prob.topk_ids)
    raises_clearly(lambda: fused_moe(prob.x, (ids, prob.topk_weights), prob.weights, CFG), "topk_ids", "[0, 4)")


@robust(1, "error")
def test_value_checks_refuse_repeated_ids(monkeypatch):
    monkeypatch.setenv(CHECK_VALUES, "1")
    prob = problem("bf16")
    ids = prob.topk_ids.clone()
    ids[2, 1] = ids[2, 0]
    raises_clearly(lambda: fused_moe(prob.x, (ids, prob.topk_weights), prob.weights, CFG), "topk_ids", "distinct")


@robust(1, "reference")
def test_value_checks_let_minus_one_through(monkeypatch):
    monkeypatch.setenv(CHECK_VALUES, "true")
    prob = problem("bf16")
    ids = _ids("row_all_invalid", prob.topk_ids)  # a row of two -1: dropped pairs, not repeated ids
    out = fused_moe(prob.x, (ids, prob.topk_weights), prob.weights, CFG)
    equals_reference(out, dropped_reference(prob, ids, prob.topk_weights), prob.scheme, CFG.dtype)


@robust(1, "error")
def test_value_checks_refuse_a_map_entry_past_the_local_experts(monkeypatch):
    monkeypatch.setenv(CHECK_VALUES, "on")
    full = problem("bf16")
    emap = torch.tensor(MAPS["minus_one_and_too_big"], dtype=torch.int32)
    w = _local_weights(full.weights, [0, 2], MAPS["minus_one_and_too_big"])
    fn = lambda: fused_moe(full.x, (full.topk_ids, full.topk_weights), w, CFG, expert_map=emap)  # noqa: E731
    raises_clearly(fn, "expert_map", "[-1, 2)")


def _custom(ids_value: int):
    def fn(logits, k):
        w, ids = torch.topk(logits.softmax(-1), k)
        ids = ids.clone()
        ids[:, -1] = ids_value
        return w, ids

    return fn


@robust(1, "reference")
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("bad", [-1, E, 99, 2**32 + 1])
def test_custom_routing_function_ids_outside_the_experts(backend, bad):
    prob = problem("bf16")
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    router = RouterConfig(E, 2, custom_fn=_custom(bad))
    out = fused_moe(prob.x, logits, prob.weights, CFG, backend=backend, router=router)
    topk = router.route(logits)
    equals_reference(out, dropped_reference(prob, topk.ids, topk.weights), prob.scheme, CFG.dtype)


@robust(1, "reference")
def test_layer_with_a_custom_router_returning_ids_outside_the_experts():
    prob = problem("bf16")
    router = RouterConfig(E, 2, custom_fn=_custom(E + 1))
    layer = FusedMoE(CFG, router=router, backend="cpu")
    for name, t in (("w13_weight", prob.weights.w13.data), ("w2_weight", prob.weights.w2.data)):
        for e in range(E):
            layer.weight_loader(name, t[e], e, "w13" if name.startswith("w13") else "w2")
    layer.process_weights_after_loading()
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(2))
    topk = router.route(logits)
    equals_reference(layer(prob.x, logits), dropped_reference(prob, topk.ids, topk.weights), prob.scheme, CFG.dtype)


@robust(1, "error")
@pytest.mark.parametrize("router", [RouterConfig(E + 4, 2), RouterConfig(E, 1), RouterConfig(2, 2)])
def test_a_router_for_another_layer_shape_is_refused(router):
    prob = problem("bf16")
    logits = torch.randn(T, router.num_experts)
    msg = raises_clearly(lambda: fused_moe(prob.x, logits, prob.weights, CFG, router=router), "router")
    assert "routing" in msg or "num_experts=4, top_k=2" in msg


# ---- the kernels themselves (the interpreter runs them on the CPU; masked loads only) ----------

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton kernels need TRITON_INTERPRET=1 here")
GARBAGE = [-1, E, 2**31 - 1, -(2**31), 7, -5]


@needs_interpreter
@robust(1, "reference")
@pytest.mark.parametrize("with_map", [False, True], ids=["no_map", "map"])
@pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "three_launches"])
def test_moe_align_kernel_with_garbage_ids_matches_its_reference(with_map, one_launch):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, E, (9, 3), generator=g, dtype=torch.int32)
    ids.view(-1)[: len(GARBAGE)] = torch.tensor(GARBAGE, dtype=torch.int32)
    emap = torch.tensor([1, -1, 0, 9], dtype=torch.int32) if with_map else None
    got = moe_align_launch(ids, 2 if with_map else E, 4, emap, chunk=32 if one_launch else 16, one_launch=one_launch)
    want = moe_align_ref(ids, 2 if with_map else E, 4, emap)
    n = int(want.num_padded)
    assert int(got.num_padded) == n and torch.equal(got.expert_counts, want.expert_counts)
    assert torch.equal(got.sorted_ids[:n], want.sorted_ids[:n])


@needs_interpreter
@robust(1, "reference")
@pytest.mark.parametrize("with_map", [False, True], ids=["no_map", "map"])
def test_moe_sum_kernel_skips_pairs_outside_the_experts(with_map):
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, E, (7, 3), generator=g, dtype=torch.int32)
    ids.view(-1)[: len(GARBAGE)] = torch.tensor(GARBAGE, dtype=torch.int32)
    emap = torch.tensor([1, -1, 0, 9], dtype=torch.int32) if with_map else None
    e_l = 2 if with_map else E
    from fusedmoe.metadata import local_expert_ids  # new with the fix: imported here, so the rest runs before it

    c = torch.randn(7, 3, 40, generator=g)
    c[local_expert_ids(ids, emap, e_l) < 0] = float("nan")  # rows no GEMM wrote
    ref = moe_sum_ref(c, topk_ids=ids, expert_map=emap, num_local_experts=e_l)
    out = moe_sum_launch(c, poison_(torch.empty(7, 40)), ids, emap, e_l)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
