"""``grouped_mm`` against the float64 reference: the labelled edge cases on the CPU (bf16), and
real shapes on a GPU (bf16 and fp8 row-wise), in both weight layouts; what it refuses and why."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.api import fused_moe
from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.experts.grouped_mm import FP8_ROWWISE, GroupedMMExperts
from fusedmoe.metadata import TopK
from fusedmoe.platform import Platform, current_platform
from fusedmoe.quant import QuantScheme, all_schemes
from fusedmoe.testing import EDGE_CASES, ODD_CASES, make_problem, poison_, rel_error, tolerance

BF16 = QuantScheme.unquantized()
SCHEMES = {s.name: s for s in all_schemes()}


def _run(prob, prepared: bool = False, device: str = "cpu") -> torch.Tensor:
    """The experts alone, behind the local dispatcher (which quantizes a1), into a poisoned output."""
    cfg, sch = prob.config, prob.scheme
    experts = GroupedMMExperts(cfg, sch)
    weights = experts.prepare_weights(prob.weights) if prepared else prob.weights
    topk = TopK(prob.topk_ids, prob.topk_weights)
    d = LocalDispatcher(cfg, sch).dispatch(prob.x, topk, prob.weights, expert_map=prob.expert_map)
    out = poison_(torch.empty(prob.x.shape[0], cfg.hidden_size, dtype=cfg.dtype, device=device))
    experts.apply(d.a, d.topk, weights, out, expert_map=prob.expert_map)
    return out


def _check(prob, out, ref=None) -> float:
    ref = prob.reference() if ref is None else ref
    assert torch.isfinite(out).all(), "every output element is written"
    err = rel_error(out, ref)
    assert err <= tolerance(prob.scheme, prob.config.dtype), f"rel. error {err:.3e}"
    return err


# ---- CPU: bf16 ---------------------------------------------------------------------------------

CASES = EDGE_CASES + ODD_CASES


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
@pytest.mark.parametrize("prepared", [False, True], ids=["reference_layout", "grouped_mm_layout"])
def test_edge_cases_bf16_cpu(case, prepared):
    config = case.config()
    why = GroupedMMExperts.why_not(config, BF16, Platform.simulated("cpu"))
    if config.hidden_size % 8 or config.intermediate_size % 8:
        assert why == "bfloat16 operands need H and I multiples of 8 (16-byte aligned rows), got H=71, I=37"
        return
    assert why is None
    prob = make_problem(config, BF16, case.t, seed=case.t + case.e, routing=case.routing)
    out = _run(prob, prepared)
    if case.t:
        _check(prob, out)


@pytest.mark.parametrize(
    "label,kw",
    [
        ("swigluoai_bias_interleaved", dict(activation="swigluoai", has_bias=True, gate_up_interleaved=True)),
        ("gelu_tanh", dict(activation="gelu_tanh")),
        ("relu2_no_mul_bias", dict(activation="relu2_no_mul", has_bias=True)),
    ],
)
def test_activations_and_biases_cpu(label, kw):
    prob = make_problem(MoEConfig(6, 2, 96, 64, **kw), BF16, 13, seed=7)
    _check(prob, _run(prob))


def test_router_weight_on_input_cpu():
    prob = make_problem(MoEConfig(5, 1, 64, 32, apply_router_weight_on_input=True), BF16, 9, seed=2)
    _check(prob, _run(prob, prepared=True))


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_expert_map_cpu(rank):
    """Pairs of other ranks' experts sort past the last offset and contribute nothing."""
    config = MoEConfig(7, 3, 64, 32)
    emap = ParallelConfig(ep_size=3, ep_rank=rank).expert_map(7)
    local = int((emap >= 0).sum())
    prob = make_problem(config, BF16, 11, seed=rank, expert_map=emap, num_local_experts=local)
    _check(prob, _run(prob, prepared=rank == 1))


def test_through_the_public_entry_point_cpu():
    config = MoEConfig(4, 2, 64, 32)
    prob = make_problem(config, BF16, 10, seed=4)
    out = fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, config, BF16, backend="grouped_mm")
    _check(prob, out)


def test_both_layouts_give_identical_outputs_cpu():
    prob = make_problem(MoEConfig(5, 2, 64, 48), BF16, 17, seed=9)
    assert torch.equal(_run(prob), _run(prob, prepared=True))


@pytest.mark.parametrize("sname", sorted(FP8_ROWWISE))
def test_fp8_is_refused_on_the_cpu_with_the_reason(sname):
    why = GroupedMMExperts.why_not(MoEConfig(4, 2, 64, 32), SCHEMES[sname], Platform.simulated("cpu"))
    assert why == "fp8 needs torch._scaled_grouped_mm, which runs on CUDA only; platform is cpu"


@pytest.mark.parametrize(
    "label,config,scheme,key",
    [
        ("sm80", MoEConfig(4, 2, 64, 32), "bf16", "needs compute capability sm90+"),
        ("sm100", MoEConfig(4, 2, 64, 32), "fp8_channel", "fp8 row-wise grouped GEMM is sm90 only"),
        ("sm90", MoEConfig(4, 2, 64, 32, dtype=torch.float16), "bf16", "bf16 only"),
        ("sm90", MoEConfig(4, 2, 71, 37), "bf16", "H and I multiples of 8"),
        ("cpu", MoEConfig(4, 2, 70, 36, dtype=torch.float32), "bf16", "float32 operands need H and I multiples of 4"),
        ("sm90", MoEConfig(4, 2, 72, 40), "fp8_token", "H and I multiples of 16"),
        ("sm90", MoEConfig(4, 2, 128, 128), "fp8_block", "quantization scheme fp8_block not supported"),
        ("sm90", MoEConfig(4, 2, 128, 128), "int4_g128", "quantization scheme int4_g128 not supported"),
        ("gfx942", MoEConfig(4, 2, 64, 32), "bf16", "platform rocm not supported"),
    ],
)
def test_refusals_name_the_reason(label, config, scheme, key):
    why = GroupedMMExperts.why_not(config, SCHEMES[scheme], Platform.simulated(label))
    assert why is not None and key in why


def test_claims_on_sm90():
    for sname in ("bf16", *sorted(FP8_ROWWISE)):
        assert GroupedMMExperts.why_not(MoEConfig(8, 2, 2048, 768), SCHEMES[sname], Platform.simulated("sm90")) is None


# ---- GPU: real shapes, bf16 and fp8 row-wise ----------------------------------------------------

GPU_SHAPES = [  # label, E, K, H, I, T
    ("qwen3_decode", 128, 8, 2048, 768, 1),
    ("qwen3_prefill", 128, 8, 2048, 768, 1024),
    ("mixtral_small_T", 8, 2, 4096, 14336, 16),
    ("odd_T", 64, 6, 2048, 1024, 77),
    ("gptoss_like", 32, 4, 2880, 2880, 256),
    ("deepseek_ep4_like", 64, 8, 7168, 2048, 128),  # 256 experts: the float32 reference alone is 45 GB
]
GPU_SCHEMES = ["bf16", *sorted(FP8_ROWWISE)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("sname", GPU_SCHEMES)
def test_real_shapes_gpu(shape, sname):
    label, e, k, h, i, t = shape
    gptoss = label == "gptoss_like"
    config = MoEConfig(
        e, k, h, i, activation="swigluoai" if gptoss else "silu", has_bias=gptoss, gate_up_interleaved=gptoss
    )
    scheme = SCHEMES[sname]
    assert GroupedMMExperts.why_not(config, scheme, current_platform()) is None
    prob = make_problem(config, scheme, t, seed=t + e, device="cuda")
    ref = prob.reference(torch.float32)  # float64 is too slow at these sizes; float32 is 100x tighter
    err = _check(prob, _run(prob, prepared=True, device="cuda"), ref)
    print(f"MAXERR grouped_mm {label} {sname} {err:.3e}")


@pytest.mark.gpu
@pytest.mark.parametrize("sname", ["bf16", "fp8_tensor", "fp8_channel"])
def test_expert_map_and_layouts_gpu(sname):
    config = MoEConfig(64, 8, 2048, 768)
    emap = ParallelConfig(ep_size=4, ep_rank=2).expert_map(64, "cuda")
    prob = make_problem(config, SCHEMES[sname], 200, seed=3, device="cuda", expert_map=emap, num_local_experts=16)
    ref = prob.reference(torch.float32)
    out = _run(prob, prepared=True, device="cuda")
    _check(prob, out, ref)
    assert torch.equal(out, _run(prob, prepared=False, device="cuda"))


@pytest.mark.gpu
def test_oracle_and_entry_point_on_the_gpu():
    config = MoEConfig(16, 2, 1024, 512)
    prob = make_problem(config, BF16, 33, seed=5, device="cuda", routing="skip_last")
    out = fused_moe(prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, config, BF16, backend="grouped_mm")
    _check(prob, out, prob.reference(torch.float32))
