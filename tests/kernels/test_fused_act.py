"""The triton experts with the activation fused into GEMM1 vs unfused vs the reference.

Where the scheme allows (a2 unquantized or static per-tensor fp8/int8) the triton
backends apply the activation in GEMM1's epilogue; ``fuse_act = False`` (what
``FUSEDMOE_FUSE_ACT=0`` sets) runs GEMM1 -> act_and_quantize instead. Every activation x
(bf16, int4 GPTQ, int4 AWQ, mxfp4, fp8 static, int8 w8a16) on both layouts, with biases,
an expert map and the workspace poisoned (NaN) before each call, must match the float64
reference within the scheme's tolerance whichever path runs, and the two paths must agree.
The kernels' own tests (``test_kernels_gemm.py``) compare them tightly, tile by tile.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import Activation, MoEConfig, ParallelConfig
from fusedmoe.dispatch.local import LocalBatchedDispatcher, LocalDispatcher
from fusedmoe.env import FUSE_ACT as FUSE_ACT_ENV
from fusedmoe.experts.triton import TritonBatchedExperts, TritonExperts
from fusedmoe.kernels._common import interpreting
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem, poison_, rel_error, tolerance

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

SCHEMES = {
    "bf16": QuantScheme.unquantized(),
    "int4_gptq": QuantScheme.int4_w4a16(32, act_order=True),
    "int4_awq": QuantScheme.int4_w4a16(32, zero_points=True),
    "mxfp4": QuantScheme.mxfp4_w4a16(),
    "fp8_static": QuantScheme.fp8_per_tensor(static_activations=True),
    "int8_w8a16": QuantScheme.int8_w8a16(),
    # per-tensor dynamic a2: the epilogue applies the activation, quantize_activations follows
    "fp8_tensor": QuantScheme.fp8_per_tensor(),
}
ACTS = list(Activation)
LAYOUTS = ["standard", "batched"]


def _config(act: Activation, e=6, k=2, h=64, i=32, **kw) -> MoEConfig:
    return MoEConfig(
        e, k, h, i, activation=act, has_bias=True, gate_up_interleaved=act is Activation.SWIGLUOAI, **kw
    )  # fmt: skip


def _kernel(layout: str, config: MoEConfig, scheme: QuantScheme, fuse: bool) -> MoEKernel:
    if layout == "standard":
        experts, disp = TritonExperts(config, scheme), LocalDispatcher(config, scheme)
    else:
        experts, disp = TritonBatchedExperts(config, scheme), LocalBatchedDispatcher(config, scheme)
    experts.fuse_act = fuse
    return MoEKernel(disp, experts)


def _run(prob, layout: str, fuse: bool, num_local: int | None = None) -> torch.Tensor:
    """One call with the workspace allocated and poisoned first."""
    kernel = _kernel(layout, prob.config, prob.scheme, fuse)
    t = prob.x.shape[0]
    shapes = kernel.workspace(t, num_local).shapes
    assert ("experts.h" in shapes) == (not fuse), "the fused path declares no [T*K, 2I] intermediate"
    for buf in kernel.allocate(t, prob.x.device, num_local_experts=num_local).values():
        poison_(buf)
    return kernel(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights, expert_map=prob.expert_map)


def _compare(prob, layout: str, num_local: int | None = None) -> None:
    ref = prob.reference()
    tol = tolerance(prob.scheme, prob.config.dtype)
    fused = _run(prob, layout, True, num_local)
    unfused = _run(prob, layout, False, num_local)
    errs = {"fused": rel_error(fused, ref), "unfused": rel_error(unfused, ref)}
    errs["fused vs unfused"] = rel_error(fused, unfused.double())
    assert all(v <= tol for v in errs.values()), f"{errs} > {tol:.2g}"


@needs_triton
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", ACTS, ids=[a.value for a in ACTS])
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=list(SCHEMES))
def test_fused_matches_unfused_and_reference(scheme, act, layout):
    """E 6 split over 2 ranks (this is rank 1: the pairs of experts 0-2 are not local)."""
    config = _config(act)
    par = ParallelConfig(ep_size=2, ep_rank=1)
    emap = par.expert_map(config.num_experts)
    n_local = len(par.local_experts(config.num_experts))
    prob = make_problem(config, SCHEMES[scheme], 7, seed=11, expert_map=emap, num_local_experts=n_local)
    _compare(prob, layout, n_local)


@needs_triton
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=list(SCHEMES))
def test_fused_router_weight_on_input(scheme, layout):
    """K = 1 with the router weight applied to x before GEMM1 (never in the epilogue)."""
    config = _config(Activation.SWIGLUOAI, k=1, apply_router_weight_on_input=True)
    _compare(make_problem(config, SCHEMES[scheme], 9, seed=4), layout)


@needs_triton
def test_env_turns_fusion_off(monkeypatch):
    config = _config(Activation.SILU)
    scheme = SCHEMES["fp8_static"]
    assert TritonExperts(config, scheme).act_epilogue() is not None
    monkeypatch.setenv(FUSE_ACT_ENV, "0")
    assert TritonExperts(config, scheme).act_epilogue() is None
    monkeypatch.setenv(FUSE_ACT_ENV, "1")
    # a per-tensor dynamic a2: the activation is fused, the quantization follows
    ep = TritonBatchedExperts(config, QuantScheme.by_name("fp8_tensor")).act_epilogue()
    assert ep is not None and ep.quant is None
    # per-row dynamic a2 scales: GEMM1 stays plain, act_and_quantize follows
    for name in ("fp8_token", "fp8_block", "mxfp4_mxfp8", "nvfp4"):
        assert TritonBatchedExperts(config, QuantScheme.by_name(name)).act_epilogue() is None, name
    assert TritonExperts(config, scheme).act_epilogue().quant == scheme.a2  # static: quantized in it


# ---- real shapes (GPU) ------------------------------------------------------------------

REAL = [  # (E, K, H, I): Qwen3-30B-A3B; DeepSeek-V3's H and I with 32 of its 256 experts
    (128, 8, 2048, 768),
    (32, 8, 7168, 2048),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 64])
@pytest.mark.parametrize("act", [Activation.SILU, Activation.SWIGLUOAI], ids=lambda a: a.value)
@pytest.mark.parametrize("shape", REAL, ids=[f"E{s[0]}_H{s[2]}_I{s[3]}" for s in REAL])
@pytest.mark.parametrize("scheme", ["bf16", "int4_g128", "mxfp4", "fp8_tensor_static", "fp8_tensor"])
def test_fused_real_shapes(scheme, shape, act, t):
    e, k, h, i = shape
    config = _config(act, e=e, k=k, h=h, i=i)
    prob = make_problem(config, QuantScheme.by_name(scheme), t, seed=2, device="cuda")
    for layout in LAYOUTS:
        _compare(prob, layout)
