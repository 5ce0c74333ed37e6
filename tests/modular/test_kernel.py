"""MoEKernel = Dispatcher x Experts: edge cases, chunking, expert maps, shared experts."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.api import fused_moe
from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.dispatch.local import LocalBatchedDispatcher, LocalDispatcher
from fusedmoe.errors import FusedMoEError, UnsupportedError
from fusedmoe.experts.cpu import CpuExperts, LoopExperts
from fusedmoe.experts.reference import ReferenceBatchedExperts, ReferenceExperts, moe_reference
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.quant.scheme import shape_supported
from fusedmoe.routing import RouterConfig
from fusedmoe.testing import EDGE_CASES, ODD_CASES, make_problem, poison_, rel_error, tolerance

SCHEMES = [
    QuantScheme.unquantized(),
    QuantScheme.fp8_per_tensor(),
    QuantScheme.fp8_per_token(),
    QuantScheme.fp8_block(),
    QuantScheme.int8_w8a8("channel"),
    QuantScheme.int4_w4a16(32, zero_points=True),
    QuantScheme.mxfp4_w4a16(),
    QuantScheme.nvfp4(),
]
KERNELS = [
    ("local", "cpu"),
    ("local", "reference"),
    ("local", "loop"),
    ("local_batched", "reference_batched"),
]
CASES = EDGE_CASES + ODD_CASES


def _run(prob, dname, ename, **kw):
    return fused_moe(
        prob.x,
        (prob.topk_ids, prob.topk_weights),
        prob.weights,
        prob.config,
        prob.scheme,
        backend=ename,
        dispatcher=dname,
        expert_map=prob.expert_map,
        **kw,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k[0]}+{k[1]}")
def test_edge_cases_match_reference(case, scheme, kernel):
    if kernel[1] == "loop" and scheme.name == "fp8_tensor":
        pytest.skip("loop refuses per-tensor dynamic a2 (tested in test_capabilities)")
    config = case.config()
    why = shape_supported(scheme, config.hidden_size, config.intermediate_size)
    if why:
        # a shape the formats cannot store must be refused, not computed wrongly
        prob_x = torch.randn(case.t, case.h).bfloat16()
        ids = torch.zeros(case.t, case.k, dtype=torch.int32)
        with pytest.raises(UnsupportedError, match="multiple of"):
            fused_moe(
                prob_x, (ids, torch.ones(case.t, case.k)), None, config, scheme, backend=kernel[1], dispatcher=kernel[0]
            )
        return
    prob = make_problem(config, scheme, case.t, seed=case.t * 31 + case.e, routing=case.routing)
    out = _run(prob, *kernel)
    assert out.shape == (case.t, case.h) and out.dtype == config.dtype
    ref = prob.reference()
    assert rel_error(out, ref) <= tolerance(scheme, config.dtype)


@pytest.mark.parametrize("scheme", [QuantScheme.unquantized(), QuantScheme.fp8_per_tensor()], ids=lambda s: s.name)
@pytest.mark.parametrize("kernel", KERNELS[:2] + KERNELS[3:], ids=lambda k: f"{k[0]}+{k[1]}")
def test_chunking_does_not_change_results(scheme, kernel):
    config = MoEConfig(6, 2, 64, 32)
    prob = make_problem(config, scheme, 23, seed=4)
    whole = _run(prob, *kernel, chunk_size=1000)
    chunked = _run(prob, *kernel, chunk_size=5)
    # a1's per-tensor scale is pinned over the whole input; a2's is per chunk
    tol = 0 if scheme.a2 is None or scheme.a2.granularity.kind != "tensor" else tolerance(scheme, config.dtype)
    assert rel_error(chunked, whole.double()) <= tol


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k[0]}+{k[1]}")
def test_expert_map_keeps_only_local_experts(placement, kernel):
    config = MoEConfig(7, 3, 64, 32)
    par = ParallelConfig(ep_size=3, ep_rank=1, placement=placement)
    emap = par.expert_map(7)
    n_local = len(par.local_experts(7))
    prob = make_problem(config, QuantScheme.fp8_per_token(), 13, seed=9, expert_map=emap, num_local_experts=n_local)
    out = _run(prob, *kernel)
    ref = prob.reference()
    assert rel_error(out, ref) <= tolerance(prob.scheme, config.dtype)
    # tokens none of whose experts are local get exactly zero
    local_any = (emap.long()[prob.topk_ids.long()] >= 0).any(dim=1)
    assert torch.all(out[~local_any] == 0)


def test_expert_maps_of_all_ranks_sum_to_the_whole_layer():
    config = MoEConfig(7, 2, 64, 32)
    full = make_problem(config, QuantScheme.unquantized(), 10, seed=2)
    total = torch.zeros(10, 64, dtype=torch.float64)
    for rank in range(3):
        par = ParallelConfig(ep_size=3, ep_rank=rank)
        local = par.local_experts(7)
        w = full.weights
        from fusedmoe.quant import QTensor
        from fusedmoe.weights import ExpertWeights

        lw = ExpertWeights(
            QTensor(w.w13.data[local], (len(local), 64, 64)), QTensor(w.w2.data[local], (len(local), 64, 32))
        )
        out = fused_moe(
            full.x, (full.topk_ids, full.topk_weights), lw, config, backend="cpu", expert_map=par.expert_map(7)
        )
        total += out.double()
    assert rel_error(total, full.reference()) <= 2e-2


def test_router_weight_on_input():
    config = MoEConfig(5, 1, 64, 32, apply_router_weight_on_input=True)
    for kernel in KERNELS:
        prob = make_problem(config, QuantScheme.fp8_per_token(), 9, seed=1)
        out = _run(prob, *kernel)
        assert rel_error(out, prob.reference()) <= tolerance(prob.scheme, config.dtype), kernel
    # weighting on input is not the same function as weighting the output (silu is not linear)
    off = moe_reference(
        prob.x,
        prob.topk_ids,
        prob.topk_weights,
        prob.weights,
        config.replace(apply_router_weight_on_input=False),
        prob.scheme,
    )
    assert rel_error(off, prob.reference()) > 0.05


@pytest.mark.parametrize("kernel", KERNELS[:3], ids=lambda k: k[1])
def test_identity_experts_add_their_weight_times_x(kernel):
    config = MoEConfig(4, 3, 64, 32, identity_experts=2)
    prob = make_problem(config.replace(identity_experts=0, top_k=2), QuantScheme.fp8_per_token(), 11, seed=5)
    g = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(11)]).to(torch.int32)
    w = torch.rand(11, 3, generator=g)
    out = fused_moe(prob.x, (ids, w), prob.weights, config, prob.scheme, backend=kernel[1])
    ref = moe_reference(prob.x, ids, w, prob.weights, config, prob.scheme)
    assert rel_error(out, ref) <= tolerance(prob.scheme, config.dtype)
    # by hand: the routed pairs alone, plus w * x for the identity ones
    routed = ids < 4
    alone = moe_reference(prob.x, ids.clamp(max=3), w * routed, prob.weights, config.replace(identity_experts=0),
                          prob.scheme)  # fmt: skip
    by_hand = alone + prob.x.double() * (w.double() * ~routed).sum(dim=1, keepdim=True)
    assert rel_error(ref, by_hand) < 1e-12


def test_identity_experts_are_refused_under_expert_parallelism():
    config = MoEConfig(4, 2, 64, 32, identity_experts=2)
    prob = make_problem(config.replace(identity_experts=0), QuantScheme.unquantized(), 3, seed=2)
    emap = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(FusedMoEError, match="MoEConfig.identity_experts: expected 0 under expert parallelism"):
        fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, config, backend="cpu", expert_map=emap)


def test_shared_experts_hook_is_added():
    config = MoEConfig(4, 2, 64, 32)
    prob = make_problem(config, QuantScheme.unquantized(), 6, seed=3)
    lin = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
    scheme = prob.scheme
    k = MoEKernel(LocalDispatcher(config, scheme), CpuExperts(config, scheme), shared_experts=lin)
    with torch.no_grad():
        out = k(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights)
        ref = prob.reference() + lin(prob.x).double()
    assert rel_error(out, ref) <= 2e-2


def test_layout_mismatch_is_refused():
    config = MoEConfig(4, 2, 64, 32)
    s = QuantScheme.unquantized()
    with pytest.raises(UnsupportedError, match="batched token layout but experts 'cpu' take standard"):
        MoEKernel(LocalBatchedDispatcher(config, s), CpuExperts(config, s))


def test_standard_backend_under_batched_dispatcher_maps_to_its_twin():
    config = MoEConfig(4, 2, 64, 32)
    prob = make_problem(config, QuantScheme.unquantized(), 5, seed=8)
    out = _run(prob, "local_batched", "reference")  # reference -> reference_batched
    assert rel_error(out, prob.reference()) <= 2e-2
    with pytest.raises(UnsupportedError, match="token layout batched not supported"):
        _run(prob, "local_batched", "cpu")  # cpu has no batched twin


def test_batched_capacity_overflow_raises():
    config = MoEConfig(4, 1, 64, 32)
    s = QuantScheme.unquantized()
    prob = make_problem(config, s, 8, seed=0, routing="one_expert")
    k = MoEKernel(LocalBatchedDispatcher(config, s, capacity=4), ReferenceBatchedExperts(config, s))
    with pytest.raises(FusedMoEError, match="expected at most 4 tokens per expert, got 8"):
        k(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights)


def test_batched_dispatch_layout_invariants():
    config = MoEConfig(5, 2, 64, 32)
    s = QuantScheme.fp8_per_token()
    prob = make_problem(config, s, 11, seed=6)
    d = LocalBatchedDispatcher(config, s).dispatch(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights)
    pair_token, pair_flat = d.ctx
    assert int(d.counts.sum()) == 11 * 2
    assert torch.equal(torch.bincount(prob.topk_ids.reshape(-1).long(), minlength=5).int(), d.counts)
    # every pair appears exactly once, in its expert's row, with its own token's data and scale
    flat = pair_flat[pair_flat >= 0]
    assert torch.equal(flat.sort().values, torch.arange(22))
    for e in range(5):
        for slot in range(int(d.counts[e])):
            f = int(pair_flat[e, slot])
            assert int(prob.topk_ids.reshape(-1)[f]) == e and int(pair_token[e, slot]) == f // 2
    ref_q = LocalDispatcher(config, s).dispatch(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights).a
    e, slot = 2, 0
    t = int(pair_token[e, slot])
    assert torch.equal(d.a.data[e, slot].view(torch.uint8), ref_q.data[t].view(torch.uint8))
    assert torch.equal(d.a.scale[e, slot], ref_q.scale[t])


def test_cpu_backend_writes_every_output_element():
    config = MoEConfig(5, 2, 64, 32)
    s = QuantScheme.unquantized()
    prob = make_problem(config, s, 7, seed=2, routing="skip_last")
    d = LocalDispatcher(config, s).dispatch(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights)
    for cls in (CpuExperts, LoopExperts, ReferenceExperts):
        out = poison_(torch.empty(7, 64, dtype=torch.bfloat16))
        cls(config, s).apply(d.a, d.topk, prob.weights, out)
        assert torch.isfinite(out).all(), cls.name


@pytest.mark.parametrize("seed", [78, 110, 253, 289])
def test_router_weight_on_input_is_quantized_from_fp32(seed):
    """x * w goes into the a1 quantizer in fp32, as in the reference (the fuzzer's seeds: a
    rounding to fp16 first gave 5e-2 against a 4.4e-2 tolerance)."""
    config = MoEConfig(2, 1, 64, 128, apply_router_weight_on_input=True, dtype=torch.float16)
    prob = make_problem(config, QuantScheme.fp8_per_tensor(), 1, seed=seed)
    out = _run(prob, "local", "reference")
    assert rel_error(out, prob.reference()) <= 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("upcast", ["half_gemm", "fp32_onednn", "fp32_mm"])
def test_cpu_backend_fp32_gemms_match_the_half_precision_ones(dtype, upcast, monkeypatch):
    """Experts with enough rows (``cpu.upcast``) run their GEMMs in fp32 on a CPU without
    half-precision GEMMs (``platform.cpu_has_half_gemm``), by oneDNN or, where the build lacks it,
    MKL's mm: every way agrees with the float64 reference, and the rounding of each GEMM's output
    is the same (they agree far inside the tolerance)."""
    from fusedmoe.experts import cpu as cpu_mod

    config = MoEConfig(4, 2, 96, 48, dtype=dtype)
    s = QuantScheme.unquantized()
    prob = make_problem(config, s, 64, seed=5)  # 32 rows per expert on average: every expert upcast
    d = LocalDispatcher(config, s).dispatch(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights)
    calls, gemms = [], []
    monkeypatch.setattr(cpu_mod, "cpu_has_half_gemm", lambda: calls.append(1) or upcast == "half_gemm")
    if upcast == "fp32_mm":
        monkeypatch.setattr(cpu_mod, "_dnn_linear", lambda: None)
    else:
        dnn = cpu_mod._dnn_linear()
        if dnn is None and upcast == "fp32_onednn":  # the fp32_mm case runs the path such builds take
            pytest.skip("this PyTorch build has no oneDNN linear")
        monkeypatch.setattr(cpu_mod, "_dnn_linear", lambda: lambda *a: gemms.append(1) or dnn(*a))
    out = poison_(torch.empty(64, 96, dtype=dtype))
    CpuExperts(config, s).apply(d.a, d.topk, prob.weights, out)
    assert calls, "the GEMMs did not ask which way to multiply"
    assert bool(gemms) == (upcast == "fp32_onednn"), gemms
    assert rel_error(out, prob.reference()) <= tolerance(s, dtype)
    monkeypatch.setattr(cpu_mod, "cpu_has_half_gemm", lambda: True)
    half = torch.empty(64, 96, dtype=dtype)
    CpuExperts(config, s).apply(d.a, d.topk, prob.weights, half)
    assert rel_error(out, half) <= tolerance(s, dtype) / 4


@pytest.mark.parametrize(
    ("label", "rows", "shape", "expected"),
    [
        ("large_w_8_rows", 8, (512, 1024), True),
        ("large_w_7_rows", 7, (512, 1024), False),
        ("small_w_15_rows", 15, (512, 512), False),
        ("small_w_16_rows", 16, (512, 512), True),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_cpu_backend_upcasts_from_the_measured_rows(label, rows, shape, expected, monkeypatch):
    """The rows from which a half GEMM goes to fp32 depend on W's size (``cpu.UPCAST_ROWS``), never
    for fp32 weights, nor where the CPU has half GEMMs."""
    from fusedmoe.experts import cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "cpu_has_half_gemm", lambda: False)
    w = torch.empty(shape, dtype=torch.bfloat16)
    assert cpu_mod.upcast(rows, w) is expected, label
    assert not cpu_mod.upcast(rows, w.float())
    monkeypatch.setattr(cpu_mod, "cpu_has_half_gemm", lambda: True)
    assert not cpu_mod.upcast(rows, w)


ONE_TOKEN_CASES = [
    # (label, config, ids of the token; experts 0, 2, 4, 6 are local to EP rank 0 of 2, round robin)
    ("ep_some_local", MoEConfig(8, 4, 64, 32), [[6, 1, 2, 3]]),
    ("ep_repeated_id_and_out_of_range", MoEConfig(8, 4, 64, 32, has_bias=True), [[4, 4, 9, 5]]),
    ("ep_none_local", MoEConfig(8, 2, 64, 32), [[1, 7]]),
    ("weight_on_input", MoEConfig(8, 1, 64, 32, apply_router_weight_on_input=True, dtype=torch.float16), [[2]]),
]


@pytest.mark.parametrize("scheme", SCHEMES[:3] + SCHEMES[5:6], ids=lambda s: s.name)
@pytest.mark.parametrize("case", ONE_TOKEN_CASES, ids=lambda c: c[0])
def test_cpu_backend_one_token_path_matches_reference(case, scheme, monkeypatch):
    """T = 1 takes the path without sort, gather or scatter (``CpuExperts._one_token``): it matches
    the float64 reference with an expert map whose -1 entries (and an id outside [0, E)) drop pairs,
    a repeated id, biases, top-k weights applied on the input, and quantized weights/activations;
    a token none of whose experts is local gets exactly 0."""
    _, config, ids = case
    par = ParallelConfig(ep_size=2, ep_rank=0, placement="round_robin")
    emap = par.expert_map(8)
    prob = make_problem(config, scheme, 1, seed=3, expert_map=emap, num_local_experts=4)
    prob.topk_ids = torch.tensor(ids, dtype=torch.int32)
    monkeypatch.setattr(CpuExperts, "_grouped", lambda *a: pytest.fail("T = 1 took the grouped path"))
    out = _run(prob, "local", "cpu")
    ref = prob.reference()
    if case[0] == "ep_none_local":
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert rel_error(out, ref) <= tolerance(scheme, config.dtype)


GROUPED_SIGMOID = RouterConfig(  # DeepSeek-V3's routing at a small size: 4 groups of 4, 2 groups kept
    16, 4, scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5
)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_fused_moe_routes_logits_with_the_correction_bias(backend):
    """The bias chooses the experts (not their weights): the call equals one given the router's
    own top-k of the same logits and bias, and differs from one without the bias."""
    config = MoEConfig(16, 4, 64, 32)
    prob = make_problem(config, QuantScheme.unquantized(), 9, seed=4)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 16, generator=g)
    bias = torch.zeros(16)
    bias[[1, 6, 11]] = 5.0  # in three of the four groups: every token takes two of them
    out = fused_moe(prob.x, logits, prob.weights, config, backend=backend, router=GROUPED_SIGMOID,
                    correction_bias=bias)  # fmt: skip
    topk = GROUPED_SIGMOID.route(logits, bias)
    assert (torch.isin(topk.ids, torch.tensor([1, 6, 11])).sum(dim=1) == 2).all()
    given = fused_moe(prob.x, (topk.ids, topk.weights), prob.weights, config, backend=backend)
    assert torch.equal(out, given)
    plain = fused_moe(prob.x, logits, prob.weights, config, backend=backend, router=GROUPED_SIGMOID)
    assert rel_error(plain, out) > 0.05


def test_fused_moe_refuses_a_correction_bias_it_cannot_use():
    config = MoEConfig(16, 4, 64, 32)
    prob = make_problem(config, QuantScheme.unquantized(), 3, seed=6)
    logits = torch.randn(3, 16)
    with pytest.raises(FusedMoEError, match="correction_bias: expected None where routing is already chosen"):
        fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, config, correction_bias=torch.zeros(16))
    with pytest.raises(FusedMoEError, match="correction_bias"):
        fused_moe(prob.x, logits, prob.weights, config, router=GROUPED_SIGMOID, correction_bias=torch.zeros(8))
